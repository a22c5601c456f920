"""Rewrites: records of the member's log copied into their streams' own segments.

A commit of a stream this process serves alone is durable once its record is in the
member's log (log.py). The stream's own objects stay the long-term layout: readers of
other releases, forks, retention, compaction and the listing all read segments. So
each stream's records are rewritten, in the background, into one segment at the
first one's start, exactly as a commit would have written them:

    streams/<key>/<incarnation>/seg/<start>     records [start, end) of the stream

Until then the records are held in memory, joined into runs as they come (runs.py:
one piece each, held by `Pieces` under the stream's `logged_key`), and serve reads.
A stream's records are rewritten once the oldest is
`rewrite_seconds` old or they hold `rewrite_bytes`, all of them at once when the
process holds more than `held_bytes`, and on demand: before a fork of the stream is
made, and when the process stops. The segment is written create-only, as every
segment: one at that name already means the records were rewritten by whoever
replayed this member's log, which happens only after it fenced the log; the member
then gives up its identity (`Log.give_up`). A record whose log object is shaped as its
segment (log.py) is a run of its own, and its rewrite links that object instead.
"""

from __future__ import annotations

import logging
import os
import time

import gevent
from gevent.event import Event
from gevent.pool import Pool

from log import Log, Record
from objectstore import StorageUnavailable
from pieces import Pieces
from runs import Run
from segments import SegmentIndex
from streams import Stream

log = logging.getLogger("picomq.storage")

CONCURRENT_REWRITES = 8  # object stores: a PUT each, in flight together
RETRY_SECONDS = 1.0


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

    def hold(self, stream: Stream, record: Record, seq: int) -> bool:
        """A commit is in log object `seq`: hold its record until rewritten. Whether
        it began a run, which is a new piece of the stream."""
        runs = stream.runs
        shaped = seq in self.log.shaped
        began = shaped or not runs or not runs[-1].takes(record)
        if began:
            run = Run(record.start)
            key = stream.logged_key(run.start)
            self.pieces.hold(key, run)
            stream.add_run(run, key)
            self.holding[id(stream)] = stream  # a stream holds runs until it holds none
        size = runs[-1].add(record, seq)
        if shaped:  # its segment is stored already: nothing may join it
            runs[-1].closed = True
        stream.logged_bytes += size
        self.held_bytes += size
        settings = self.settings
        if stream.logged_bytes >= settings.rewrite_bytes or self.held_bytes > settings.held_bytes:
            self.due.set()
        if self.worker is None:
            self.worker = gevent.spawn(self._rewrite_while_held)
        return began

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
        """Write the runs `stream` holds now as segments, and let go of them.

        Raises StorageUnavailable when storage fails (the records stay held)."""
        with stream.rewriting:  # two at once would both write the first run's name
            linked: list[Run] = []
            try:
                for run in list(stream.runs):  # not the runs begun meanwhile
                    if not self._rewrite(stream, run, linked):
                        break
            finally:
                self._settle(stream, linked)

    def _settle(self, stream: Stream, linked: list[Run]) -> None:
        """The segments linked in one rewrite of `stream` share its folder: one sync
        makes them durable, and only then may the log objects they came from go (if the
        sync fails, they stay: a replay finds their segments in place)."""
        if linked:
            self.objects.make_durable(stream.segment_key(linked[-1].start))
            for run in linked:
                self.log.release(run.seqs)

    def _rewrite(self, stream: Stream, run: Run, linked: list[Run]) -> bool:
        """Write `run`, the first `stream` holds, as its segment (added to `linked` when
        linked: see `_settle`); False if it holds it no more (given up, or dropped
        meanwhile)."""
        run.closed = True  # the records logged while its segment is stored start the next
        key = stream.segment_key(run.start)
        try:
            stored = self._store(run, key)
        except FileNotFoundError:  # the stream was deleted meanwhile (local disk)
            self.drop(stream, erased=True)
            return False
        if stored is None:
            log.warning("%s was rewritten by another member: this one was fenced", key)
            self.log.give_up()
            return False
        data, index = stored
        if not stream.runs or stream.runs[0] is not run:
            return False  # dropped meanwhile: deleted, or served elsewhere now
        self.pieces.let_go([stream.logged_key(run.start)])
        if data is not None:  # a linked one is read from its file, as any other process's
            self.pieces.cache.put(key, data)
        self.pieces.indexes.put(key, index, index.nbytes)
        stream.adopt_rewrite(run)
        self.held_bytes -= run.nbytes
        if data is None:
            linked.append(run)
        else:
            self.log.release(run.seqs)
        if not stream.runs:
            self.holding.pop(id(stream), None)
        return True

    def _store(self, run: Run, key: str) -> tuple[bytes | None, SegmentIndex] | None:
        """Store `run` as segment `key`: its bytes (None when linked) and its index; None
        if another member's segment is there. A run of a shaped log object links that
        object, unless it is gone (replayed by a member that fenced this one): then the
        create tells what happened."""
        shaped = self.log.shaped_source(run.seqs)
        if shaped is not None:
            source, index = shaped
            try:
                self.objects.link(source, key)
                return None, index
            except FileExistsError:
                return self._ours(key, None, index)
            except FileNotFoundError:
                pass
        data, index = run.segment(os.urandom(16).hex())
        try:
            self.objects.create(key, data, verified_on_load=True)
        except FileExistsError:
            return self._ours(key, data, index)
        return data, index

    def _ours(
        self, key: str, data: bytes | None, index: SegmentIndex
    ) -> tuple[bytes | None, SegmentIndex] | None:
        """A segment was at `key` already: ours if it has our token (an earlier try
        landed; only its answer was lost)."""
        if self.pieces.read_piece(key)[0].token != index.token:
            return None
        return data, index

    def drop(self, stream: Stream, *, erased: bool) -> None:
        """The stream is erased, or served elsewhere now: its records are held no more.
        Erased, the log may let go of them; served elsewhere, the log keeps them for
        whoever replays it (whoever serves the stream now did, unless storage lost
        the partition's claims)."""
        if not stream.runs:
            return
        self.held_bytes -= stream.logged_bytes
        runs = stream.drop_runs()
        self.pieces.let_go([stream.logged_key(run.start) for run in runs])
        self.holding.pop(id(stream), None)
        if erased:
            for run in runs:
                self.log.release(run.seqs)

    def rewrite_all(self, seconds: float) -> bool:
        """Rewrite everything held, within `seconds`; True if nothing is held after."""
        deadline = time.monotonic() + seconds
        while self.holding and time.monotonic() < deadline:
            pool = Pool(CONCURRENT_REWRITES)
            pool.map(self._rewrite_quietly, list(self.holding.values()))
        return not self.holding
