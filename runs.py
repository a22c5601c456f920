"""Runs: a stream's records of the member's log, joined as they are committed.

A member holds what it logged of a stream until the rewrite (rewrites.py) writes it
as one of the stream's segments. The records are joined as they come: over many
streams each append is a record of its own, and keeping each one a piece of its own
only for the rewrite to join them made every record pay twice for being one
(docs/shared-log.md, "Held runs"; bench/README.md has the figures). A run is one
piece: readers read its payload at its ends, and the rewrite encodes it as it is.
"""

from __future__ import annotations

import itertools
import operator
import time
from array import array
from collections.abc import Iterator

from log import Record
from segments import (
    MAX_SEGMENT_BYTES,
    POSITION_SIZE,
    SegmentIndex,
    StreamState,
    encode_segment,
    positions,
)

# The last record is kept for the state it carries. One larger than this is kept
# without its payload and ends, which the run holds already: a copy of each held
# stream's last record would take memory past PICOMQ_LOG_HELD_BYTES, twice it at worst.
KEPT_RECORD_BYTES = 1024


class Run:
    """Consecutive records of one stream: one payload, its ends relative to `start`,
    the log object of each record, and the stream's state after the last."""

    __slots__ = (
        "start", "end", "payload", "append_ends", "message_ends", "seqs", "last", "since",
        "nbytes", "closed", "_index",
    )  # fmt: skip

    def __init__(self, start: int) -> None:
        self.start = self.end = start
        self.payload = bytearray()
        self.append_ends, self.message_ends = positions(), positions()
        self.seqs = array("q")  # one entry a record: the log counts records per object
        self.last: Record | None = None
        self.since = time.monotonic()  # when its first record was logged
        self.nbytes = 0  # what its records hold in memory, payload and ends
        self.closed = False  # taken by a rewrite, or full: records go to the next run
        self._index: SegmentIndex | None = None

    def takes(self, record: Record) -> bool:
        """Whether `record` may join: the run is open, and the segment it becomes stays
        within MAX_SEGMENT_BYTES (or holds nothing yet)."""
        if self.closed:
            return False
        return not self.payload or len(self.payload) + len(record.payload) <= MAX_SEGMENT_BYTES

    def add(self, record: Record, seq: int) -> int:
        """Join `record`, stored in log object `seq` (0 for one read back from a log);
        the bytes it holds in memory (payload and ends).

        Each commit over many streams adds one: its ends are moved in C-level passes
        written out here, not through `extend_shifted`, a call less each. A run's first
        record (a large batch's run holds only that) needs no move: its ends are copied
        whole. Most records over many streams are one append of one message: their one
        end each is moved by hand, without the passes' iterators."""
        appends, messages, payload = record.append_ends, record.message_ends, record.payload
        length = len(payload)
        self.payload += payload
        if self.end == self.start:
            self.append_ends.extend(appends)
            self.message_ends.extend(messages)
        elif len(appends) == 1 and len(messages) == 1:
            shift = self.end - self.start
            self.append_ends.append(appends[0] + shift)
            self.message_ends.append(messages[0] + shift)
        else:
            shift = itertools.repeat(self.end - self.start)
            self.append_ends.extend(map(operator.add, appends, shift))
            self.message_ends.extend(map(operator.add, messages, shift))
        self.seqs.append(seq)
        self.end = record.end
        self.last = record if length <= KEPT_RECORD_BYTES else _without_data(record)
        self._index = None
        size = length + POSITION_SIZE * (len(appends) + len(messages))
        self.nbytes += size
        return size

    def index(self) -> SegmentIndex:
        """Where its appends and messages sit in its payload, as it stands now: a copy
        of its ends, which the run keeps extending."""
        if self._index is None:
            last = self.last
            assert last is not None
            self._index = SegmentIndex(
                self.start, self.end, 0, array(self.append_ends.typecode, self.append_ends),
                array(self.message_ends.typecode, self.message_ends), written_at=last.written_at,
            )  # fmt: skip
        return self._index

    def state(self) -> StreamState:
        assert self.last is not None
        return self.last.state()

    def bytes_at(self, position: int, length: int) -> bytes:
        """A copy of `length` bytes of its payload from `position`: no view of the
        payload outlives the call (a bytearray cannot grow while one exists)."""
        with memoryview(self.payload) as view:
            return bytes(view[position : position + length])

    def segment(self, token: str) -> tuple[bytes, SegmentIndex]:
        """The segment at `start` holding the run: its state is the last record's,
        which carries every producer entry changed since the table's last snapshot."""
        last = self.last
        assert last is not None
        return encode_segment(
            self.start, self.payload, self.append_ends, self.message_ends, last.state(),
            written_at=last.written_at, token=token,
        )  # fmt: skip


def _without_data(record: Record) -> Record:
    return record._replace(payload=b"", append_ends=positions(), message_ends=positions())


def runs_of(records: list[Record]) -> Iterator[Run]:
    """Consecutive records joined into runs, each within MAX_SEGMENT_BYTES (a replay)."""
    run: Run | None = None
    for record in records:
        if run is None or not run.takes(record):
            if run is not None:
                yield run
            run = Run(record.start)
        run.add(record, 0)
    if run is not None:
        yield run
