"""Rewrites: records of the member's log copied into their streams' own segments.

A commit of a stream this process serves alone is durable once its record is in the
member's log (log.py). The stream's own objects stay the long-term layout: readers of
other releases, forks, retention, compaction and the listing all read segments. So
each stream's records are rewritten, in the background, into one segment at the
first one's start, exactly as a commit would have written them:

    streams/<key>/<incarnation>/seg/<start>     records [start, end) of the stream

Until then a record is held in memory (`Pieces.hold`, under the stream's `logged_key`)
and its payload serves its reads. A stream's records are rewritten once the oldest is
`rewrite_seconds` old or they hold `rewrite_bytes`, all of them at once when the
process holds more than `held_bytes`, and on demand: before a fork of the stream is
made, and when the process stops. The segment is written create-only, as every
segment: one at that name already means the records were rewritten by whoever
replayed this member's log, which happens only after it fenced the log; the member
then gives up its identity (`Log.give_up`).
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import time
from array import array

import gevent
from gevent.event import Event
from gevent.pool import Pool

from log import Log, Record
from objectstore import StorageUnavailable
from pieces import Pieces
from segments import (
    MAX_SEGMENT_BYTES,
    POSITION_SIZE,
    POSITION_TYPE,
    SegmentIndex,
    count_within,
    encode_segment,
    positions_of,
)
from streams import Stream

log = logging.getLogger("picomq.storage")

CONCURRENT_REWRITES = 8  # object stores: a PUT each, in flight together
RETRY_SECONDS = 1.0
# A run's records are joined without a yield: this many keep other requests waiting a
# few milliseconds at most (bench/README.md, "Rewrites over many streams").
RUN_RECORDS = 4096


def join(start: int, records: list[Record], token: str) -> tuple[bytes, SegmentIndex]:
    """The segment at `start` holding consecutive `records`, in order.

    The state is the last one's: it carries every producer entry changed since the
    table's last snapshot, as each record does. The ends are joined in C-level passes,
    with no index (nor yield) per record: over many streams nearly every append is a
    record of its own, and that per-record work made a rewrite cost about half as
    much as the appends it follows (bench/README.md, "Rewrites over many streams").
    """
    payload = b"".join(record.payload for record in records)
    shifts = [record.start - start for record in records]
    appends = _shifted(shifts, [record.append_ends for record in records])
    messages = _shifted(shifts, [record.message_ends for record in records])
    last = records[-1]
    return encode_segment(
        start, payload, appends, messages, last.state(), written_at=last.written_at, token=token
    )


def _shifted(shifts: list[int], stored: list[bytes]) -> array:
    """Records' stored ends (each relative to its record's start), each record's moved
    by its shift: relative to the segment's start."""
    counts = map(operator.floordiv, map(len, stored), itertools.repeat(POSITION_SIZE))
    moves = itertools.chain.from_iterable(map(itertools.repeat, shifts, counts))
    return array(POSITION_TYPE, map(operator.add, positions_of(b"".join(stored)), moves))


class Rewrites:
    """The streams whose records this process holds, and the greenlet rewriting them."""

    def __init__(self, pieces: Pieces, log: Log) -> None:
        self.pieces = pieces
        self.objects = pieces.objects
        self.log = log
        self.settings = pieces.settings
        self.holding: dict[int, Stream] = {}  # by id(): handles are not hashable
        self.held_bytes = 0
        self.due = Event()
        self.worker: gevent.Greenlet | None = None

    def hold(self, stream: Stream, record: Record, seq: int) -> None:
        """A commit is in log object `seq`: hold its record until rewritten."""
        key = stream.logged_key(record.start)
        self.pieces.hold(key, record)
        size = record.nbytes
        stream.add_logged(record.start, seq, size, key)
        self.holding[id(stream)] = stream
        self.held_bytes += size
        settings = self.settings
        if stream.logged_bytes >= settings.rewrite_bytes or self.held_bytes > settings.held_bytes:
            self.due.set()
        if self.worker is None:
            self.worker = gevent.spawn(self._rewrite_while_held)

    def _rewrite_while_held(self) -> None:
        try:
            while self.holding:
                self.due.wait(timeout=self._next_due())
                self.due.clear()
                due = self._due_streams()
                if due:
                    Pool(CONCURRENT_REWRITES).map(self._rewrite_quietly, due)
        finally:
            self.worker = None

    def _next_due(self) -> float:
        oldest = min((stream.logged_since() for stream in self.holding.values()), default=0.0)
        return max(0.0, oldest + self.settings.rewrite_seconds - time.monotonic()) + 0.01

    def _due_streams(self) -> list[Stream]:
        if self.held_bytes > self.settings.held_bytes:
            return list(self.holding.values())
        old = time.monotonic() - self.settings.rewrite_seconds
        return [
            stream
            for stream in self.holding.values()
            if stream.logged_since() <= old or stream.logged_bytes >= self.settings.rewrite_bytes
        ]

    def _rewrite_quietly(self, stream: Stream) -> None:
        try:
            self.rewrite(stream)
        except StorageUnavailable as error:
            log.warning("rewrite of %s postponed: %s", stream.config.path, error)
            gevent.sleep(RETRY_SECONDS)

    def rewrite(self, stream: Stream) -> None:
        """Write the records `stream` holds now as one segment, and let go of them.

        Raises StorageUnavailable when storage fails (the records stay held)."""
        with stream.rewriting:  # two at once would both write the first record's name
            while stream.logged and self._rewrite(stream):
                pass

    def _rewrite(self, stream: Stream) -> bool:
        """Rewrite the first records `stream` holds, MAX_SEGMENT_BYTES of them; False if
        it holds none of them any more (given up, or dropped meanwhile)."""
        run = _first_run(stream)
        keys = [stream.keys[start] for start in run]  # each held record's `logged_key`
        token = os.urandom(16).hex()
        data, index = join(run[0], self.pieces.held_run(keys), token)
        key = stream.segment_key(run[0])
        try:
            self.objects.create(key, data, verified_on_load=True)
        except FileExistsError:
            if self.pieces.read_piece(key)[0].token != token:
                log.warning("%s was rewritten by another member: this one was fenced", key)
                self.log.give_up()
                return False
        except FileNotFoundError:  # the stream was deleted meanwhile (local disk)
            self.drop(stream, erased=True)
            return False
        if not stream.logged or next(iter(stream.logged)) != run[0]:
            return False  # dropped meanwhile: deleted, or served elsewhere now
        self.pieces.let_go(keys)
        self.pieces.cache.put(key, data)
        self.pieces.indexes.put(key, index, index.nbytes)
        held = stream.logged_bytes
        self.log.release(stream.adopt_rewrite(run))
        self.held_bytes -= held - stream.logged_bytes
        if not stream.logged:
            self.holding.pop(id(stream), None)
        return True

    def drop(self, stream: Stream, *, erased: bool) -> None:
        """The stream is erased, or served elsewhere now: its records are held no more.
        Erased, the log may let go of them; served elsewhere, the log keeps them for
        whoever replays it (whoever serves the stream now did, unless storage lost
        the partition's claims)."""
        if not stream.logged:
            return
        seqs = [seq for seq, _, _ in stream.logged.values()]
        self.held_bytes -= stream.logged_bytes
        self.pieces.let_go(stream.drop_logged())
        self.holding.pop(id(stream), None)
        if erased:
            self.log.release(seqs)

    def rewrite_all(self, seconds: float) -> bool:
        """Rewrite everything held, within `seconds`; True if nothing is held after."""
        deadline = time.monotonic() + seconds
        while self.holding and time.monotonic() < deadline:
            pool = Pool(CONCURRENT_REWRITES)
            pool.map(self._rewrite_quietly, list(self.holding.values()))
        return not self.holding


def _first_run(stream: Stream) -> list[int]:
    """The starts of the first records `stream` holds: one at least, and at most
    MAX_SEGMENT_BYTES and RUN_RECORDS of them (mostly all, which needs no adding up)."""
    taken = RUN_RECORDS
    if stream.logged_bytes > MAX_SEGMENT_BYTES:
        sizes = (size for _, size, _ in stream.logged.values())
        taken = min(taken, count_within(sizes, MAX_SEGMENT_BYTES))
    return list(itertools.islice(stream.logged, taken))
