"""Retention: whole pieces dropped from the head of a stream that keeps data by age or size.

Streams keep everything unless created with `retention_age` or `retention_bytes`
(or the store's defaults for them). Offsets never change: trimming raises the
stream's earliest offset, published as a create-only marker

    <root>/streams/<key>/<incarnation>/trim/<offset>

so every process answers 410 below it within `index_max_age`; the pieces are
deleted `delete_grace` later. A piece goes only once the piece after it is older
than twice `index_max_age`: no writer can then hold a tail so old that the trimmed
name would look free. Forked streams are not trimmed: their forks read the data
(`StreamStore.publish_trim` says how a trim and a fork being created see each other).
The last piece, with the stream's state (closed flag, producers), always stays.
Commits held in memory, not yet rewritten from the member's log (rewrites.py), are
rewritten first: a stream kept by age or size pays a segment per look, not one per
`rewrite_seconds`, so that what it must drop goes as soon.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from objectstore import StorageUnavailable
from segments import CorruptSegment

if TYPE_CHECKING:
    from pieces import Pieces
    from streams import Stream, StreamConfig, StreamInfo

# Housekeeping of the store's objects: its warnings carry the store's logger name.
log = logging.getLogger("picomq.storage")

# Makes a new earliest offset known unless a fork reads below it (lifecycle.py).
PublishTrim = Callable[["Stream", int], bool]
# Rewrites what the member's log holds of a stream into its segments (rewrites.py).
Rewrite = Callable[["Stream"], None]


def retains(limits: StreamConfig | StreamInfo) -> bool:
    """Whether a stream has a retention setting: only those are ever trimmed."""
    return limits.retention_age is not None or limits.retention_bytes is not None


def schedule_trim(pieces: Pieces, publish: PublishTrim, rewrite: Rewrite, stream: Stream) -> None:
    """Check retention soon, once: after appends, on load, and when data comes of age.

    Only streams with a retention setting and data past it get a timer, so idle
    streams with nothing to trim cost nothing.
    """
    if not retains(stream.config):
        return
    if len(stream.starts) >= 2 or stream.runs:  # a look makes the runs pieces of their own
        trim = functools.partial(_trim, pieces, publish, rewrite, stream)
        stream.trim_later(pieces.settings.index_max_age / 10, trim)


def _trim(pieces: Pieces, publish: PublishTrim, rewrite: Rewrite, stream: Stream) -> None:
    """Publish a new earliest offset, then delete the pieces below it after the grace."""
    if not stream.begin_housekeeping():  # compaction is rewriting the index: look again soon
        schedule_trim(pieces, publish, rewrite, stream)
        return
    try:
        if stream.runs:
            rewrite(stream)
        cut, wake_at = _trim_point(pieces, stream)
        if cut > stream.earliest and publish(stream, cut):
            pieces.delete_later(stream.trim(cut))
        if wake_at is not None:
            delay = max(wake_at - time.time(), pieces.settings.index_max_age / 10)
            stream.trim_later(delay, functools.partial(_trim, pieces, publish, rewrite, stream))
    except (StorageUnavailable, FileNotFoundError, CorruptSegment) as error:
        log.warning("retention of %s postponed: %s", stream.config.path, error)
    finally:
        stream.end_housekeeping()


def _trim_point(pieces: Pieces, stream: Stream) -> tuple[int, float | None]:
    """The first offset to keep, and when to look again (None: nothing will age out)."""
    config, now = stream.config, time.time()
    fence_age = 2 * pieces.settings.index_max_age
    starts = list(stream.starts)
    cut, wake_at = stream.earliest, None
    for start, following in zip(starts, starts[1:], strict=False):
        if stream.holds(start):  # held in memory, not yet a segment: the tail stays
            break
        piece, after = pieces.segment(stream, start), pieces.segment(stream, following)
        too_old = config.retention_age is not None and (
            piece.written_at < now - config.retention_age
        )
        too_big = config.retention_bytes is not None and (
            stream.state.tail - start > config.retention_bytes
        )
        if not (too_old or too_big):
            if config.retention_age is not None:
                wake_at = piece.written_at + config.retention_age
            break
        if after.written_at > now - fence_age:
            wake_at = after.written_at + fence_age
            break
        cut = following
    return cut, wake_at
