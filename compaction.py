"""Compaction: runs of small segments merged into packs covering the same offsets.

Group commit writes one segment per batch, so a stream fed by a slow producer holds
one small object per append, and reading it back would cost one request per append.
Once a stream has more than `compact_after` unpacked segments, a run of consecutive
small ones (at most `compact_max_segments` and `compact_max_bytes`, never the last
piece, which holds the stream's state) is copied into one pack named by the offsets it
covers. Segments of a sixteenth of `compact_max_bytes` or more (a batched producer's)
stay as they are: packing them would copy megabytes to save a request per megabyte.

    <root>/streams/<key>/<incarnation>/pack/<start>-<end>

The pack is written create-only (two nodes packing the same run write the same
bytes; one wins). The originals stay for `delete_grace` so that readers and writers
holding an older index never miss them; a writer that still knew an old tail would
otherwise find its segment name free again. Which piece serves which offsets when
the index is listed is decided in `Pieces._list` (pieces.py).
"""

from __future__ import annotations

import itertools
import logging
from array import array
from typing import TYPE_CHECKING

import gevent

from objectstore import StorageUnavailable
from segments import CorruptSegment, SegmentIndex, encode_segment, extend_shifted, positions

if TYPE_CHECKING:
    from pieces import Pieces
    from streams import Stream

# Housekeeping of the store's objects: its warnings carry the store's logger name.
log = logging.getLogger("picomq.storage")


def maybe_compact(pieces: Pieces, stream: Stream) -> None:
    """Compact in the background once enough segments are unpacked, one job at a time."""
    if stream.unpacked > pieces.settings.compact_after and stream.begin_housekeeping():
        gevent.spawn(_compact, pieces, stream)


def _compact(pieces: Pieces, stream: Stream) -> None:
    """Merge a run of small segments into one pack; storage errors only postpone it."""
    settings = pieces.settings
    try:
        run = _unpacked_run(stream, settings.compact_max_segments, settings.compact_max_bytes)
        if len(run) < 2:
            stream.nothing_to_pack()
            return
        headers = [pieces.read_segment(stream, start) for start in run]
        payload = b"".join(
            pieces.objects.read(stream.piece_key(index.start), index.payload_position)
            for index, _ in headers
        )
        end, state = headers[-1][0].end, headers[-1][1]
        appends, messages = joined_ends(run[0], [index for index, _ in headers])
        pack = stream.pack_key(run[0], end)
        try:
            data, _ = encode_segment(run[0], payload, appends, messages, state)
            pieces.objects.create(pack, data)
        except FileExistsError:
            pass
        originals = [stream.segment_key(start) for start in run]
        stream.adopt_pack(run, pack)
        pieces.delete_later(originals)
    except (StorageUnavailable, FileNotFoundError, CorruptSegment) as error:
        log.warning("compaction of %s postponed: %s", stream.config.path, error)
    finally:
        stream.end_housekeeping()


def joined_ends(start: int, indexes: list[SegmentIndex]) -> tuple[array, array]:
    """The append and message ends of consecutive segments, relative to the first's start.

    A run holds up to compact_max_bytes of small messages: the loop yields between
    segments, so other requests never wait on more than one segment's worth.
    """
    appends, messages = positions(), positions()
    for index in indexes:
        shift = index.start - start
        extend_shifted(appends, index.append_ends, shift)
        extend_shifted(messages, index.message_ends, shift)
        gevent.sleep(0)
    return appends, messages


def _unpacked_run(stream: Stream, max_segments: int, max_bytes: int) -> list[int]:
    """Consecutive small unpacked segments before the tail segment, oldest first.

    A segment's size is the distance to the next start, so no header is read to choose.
    """
    run: list[int] = []
    run_bytes = 0
    for start, next_start in itertools.pairwise(stream.starts):
        size = next_start - start
        if start in stream.keys or size >= max_bytes // 16:
            run, run_bytes = [], 0
            continue
        if run_bytes + size > max_bytes:
            break
        run.append(start)
        run_bytes += size
        if len(run) == max_segments:
            break
    return run
