"""The member's log: the commits of every stream a process serves, one object per flush.

A member (members.py) commits the batches of all its streams together: each batch
becomes a *record* (its data, its ends, the stream's state after it), and the records
that come while one flush is stored form the next. An append is durable, and
answered, once the log object holding its record exists:

    log/<member>/<seq>          one flush: its records, in order (create-only)

    b"PMQLOG2\n" | header length (u32) | CRC-32 of header and body (u32) | header JSON
    | body: each record's append ends, message ends (little-endian u32s) and payload

The header lists each record's stream, folder, start, end, its ends' lengths and state
(closed, closer, Stream-Seq, producer snapshot, the producer entries changed since
it, when written): what a segment's header holds, so a record never depends on
another. Objects of the release before (`MAGIC_BEFORE`, each record a whole segment)
are still read.

On local disk a flush of one large record is written as that record's segment
instead (a *shaped* object, `encode_shaped`), which the rewrite links into the
stream's folder rather than writing its bytes again (docs/shared-log.md, "Large
records: the log object is the segment").

Objects are numbered in order, one flush in flight at a time, and a member never
writes `seq + 1` before it knows `seq` is stored. That order is the fence: a member
that takes over another's streams (believing it dead) first creates the next number
of its log itself (`fence`). Everything the other stored is below it, and its next
flush, a create at that same number, fails: it learns it was fenced, answers its
batch 503 and gives up its identity (`on_fenced`). No clock is involved, so a process
paused past its lease and resumed can acknowledge nothing more.

A member that cannot tell whether a flush was stored (storage failed and keeps
failing) gives up its identity the same way: its log is then read by whoever serves
its streams next (`replay` in storage.py), stored flush or not.

Records are rewritten into their streams' own segments in the background
(rewrites.py); `release` counts them off, and a log object all of whose records are
rewritten is deleted, except the latest: a fence must find the number it has to take.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

import gevent
import orjson
from gevent.event import AsyncResult

from objectstore import ObjectStore, StorageUnavailable
from segments import MAGIC as SEGMENT_MAGIC
from segments import (
    PREFIX,
    CorruptSegment,
    ProducerEntry,
    SegmentIndex,
    StreamState,
    closer_of,
    decode_header,
    encode_segment,
    header_length,
    positions_bytes,
    positions_of,
    producer_entries,
    verify_payload,
)

log = logging.getLogger("picomq.log")

LOG = "log"
MAGIC = b"PMQLOG2\n"
MAGIC_BEFORE = b"PMQLOG1\n"  # each record a whole segment: read, no longer written
FENCE = b"PMQFENCE\n"
HEADER = struct.Struct(">II")  # the header's length; the checksum of header and body
LENGTH = struct.Struct(">I")  # the header's length (MAGIC_BEFORE)
# A flush whose outcome is unknown is tried again this many times before the member
# gives up its identity.
FLUSH_ATTEMPTS = 3
FENCE_ATTEMPTS = 5
MAX_FLUSH_BYTES = 64 * 1024 * 1024  # a flush holds at most this much, or one record
# A flush of one record at least this large is shaped as its segment, where the store
# links objects cheaply: below it, joining records into one segment saves more.
SHAPED_RECORD_BYTES = 64 * 1024
FLUSHED_OR_NOT = "the log could not be written; the append may have been stored"


class Fenced(StorageUnavailable):
    """Another member took this member's log over: it serves none of its streams now."""


class Record(NamedTuple):
    """One batch of one stream, as the commit planned it: its data, where its appends
    and messages end (relative to `start`), and the stream's state after it.

    Not a segment: over many streams each append is a commit with a record of its
    own, and encoding each as a segment was a large part of its commit
    (bench/README.md, "Many streams"). Once stored, a record joins its stream's held
    run (runs.py), which becomes a segment when rewritten; a replay joins records the
    same way. A tuple, as a frozen dataclass costs several times a tuple to build.
    """

    path: str
    prefix: str  # the stream's folder, incarnation included: streams/<key>/<incarnation>
    start: int
    end: int
    payload: bytes
    append_ends: array
    message_ends: array
    closed: bool
    closer: tuple[str, int, int] | None
    stream_seq: str | None
    producer_snapshot: str | None
    producers: tuple[tuple[str, ProducerEntry], ...]  # (id, entry) changed since the snapshot
    written_at: float

    def state(self) -> StreamState:
        """The stream's state after it, as a segment's header gives it."""
        producers = dict(self.producers)
        return StreamState(
            self.end, self.closed, producers, self.closer, self.stream_seq,
            self.producer_snapshot, set(producers),
        )  # fmt: skip


def record_of(path: str, prefix: str, segment: bytes) -> Record:
    """The record a whole segment holds; CorruptSegment if it fails its checks."""
    index, state = decode_header(segment)
    verify_payload(segment, index)
    return Record(
        path, prefix, index.start, index.end, segment[index.payload_position :],
        index.append_ends, index.message_ends,
        state.closed, state.closer, state.stream_seq, state.producer_snapshot,
        tuple(state.producers.items()), index.written_at,
    )  # fmt: skip


def log_key(member: str, seq: int) -> str:
    return f"{LOG}/{member}/{seq:012d}"


def encode_log(token: str, records: list[Record]) -> bytes:
    """One flush: a header naming every record, then each record's ends and payload,
    and one checksum over both (a torn object is skipped whole)."""
    # Each record's fields but its payload and ends, whose lengths stand for them.
    ends = [(positions_bytes(r.append_ends), positions_bytes(r.message_ends)) for r in records]
    pairs = list(zip(records, ends, strict=True))
    fields = [[*r[:4], len(appends), len(messages), *r[7:]] for r, (appends, messages) in pairs]
    header = orjson.dumps({"token": token, "records": fields})
    body = b"".join(
        [part for r, (appends, messages) in pairs for part in (appends, messages, r.payload)]
    )
    checksum = zlib.crc32(body, zlib.crc32(header))
    return b"".join([MAGIC, HEADER.pack(len(header), checksum), header, body])


def encode_shaped(token: str, record: Record) -> tuple[bytes, SegmentIndex]:
    """A flush of one record as the segment it will be, naming its stream besides, and
    that segment's index."""
    return encode_segment(
        record.start, record.payload, record.append_ends, record.message_ends, record.state(),
        written_at=record.written_at, token=token,
        extra={"path": record.path, "prefix": record.prefix},
    )  # fmt: skip


def decode_log(data: bytes) -> tuple[str, list[Record]]:
    """The token and records of a log object; a fence holds none. ValueError if torn."""
    if data.startswith(FENCE):
        return "", []
    if data.startswith(SEGMENT_MAGIC):
        return _decode_shaped(data)
    if data.startswith(MAGIC_BEFORE):
        return _decode_segments(data)
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + HEADER.size:
        raise ValueError("not a log object")
    length, checksum = HEADER.unpack_from(data, len(MAGIC))
    position = len(MAGIC) + HEADER.size
    view = memoryview(data)
    if zlib.crc32(view[position:]) != checksum:
        raise ValueError("log object checksum mismatch")
    header = orjson.loads(view[position : position + length])
    position += length
    records = []
    for path, prefix, start, end, appends_length, messages_length, *state in header["records"]:
        append_ends, position = _bytes_at(data, position, appends_length)
        message_ends, position = _bytes_at(data, position, messages_length)
        payload, position = _bytes_at(data, position, end - start)
        closed, closer, stream_seq, snapshot, producers, written_at = state
        records.append(Record(
            path, prefix, start, end, payload, positions_of(append_ends),
            positions_of(message_ends), closed,
            closer_of(closer), stream_seq, snapshot,
            tuple(producer_entries(dict(producers), written_at).items()),
            written_at,
        ))  # fmt: skip
    return header["token"], records


def _bytes_at(data: bytes, position: int, length: int) -> tuple[bytes, int]:
    """The `length` bytes at `position`, and where they end."""
    end = position + length
    if end > len(data):
        raise ValueError("log object shorter than its header says")
    return data[position:end], end


def _decode_shaped(data: bytes) -> tuple[str, list[Record]]:
    """A flush of one record shaped as its segment (`encode_shaped`)."""
    try:
        record = record_of("", "", data)  # checks header and payload first
    except (CorruptSegment, struct.error) as error:
        raise ValueError(f"a torn log object: {error}") from error
    fields = orjson.loads(data[PREFIX.size : header_length(data)])
    return fields["token"], [record._replace(path=fields["path"], prefix=fields["prefix"])]


def _decode_segments(data: bytes) -> tuple[str, list[Record]]:
    """A log object of the release before (`MAGIC_BEFORE`): each record a whole segment."""
    if len(data) < len(MAGIC_BEFORE) + LENGTH.size:
        raise ValueError("not a log object")
    (length,) = LENGTH.unpack_from(data, len(MAGIC_BEFORE))
    position = len(MAGIC_BEFORE) + LENGTH.size
    header = orjson.loads(data[position : position + length])
    position += length
    records = []
    for path, prefix, _, size in header["records"]:
        if position + size > len(data):
            raise ValueError("log object shorter than its header says")
        try:
            records.append(record_of(path, prefix, data[position : position + size]))
        except (CorruptSegment, struct.error) as error:
            raise ValueError(f"a torn record: {error}") from error
        position += size
    return header["token"], records


class Flush:
    """The records of one log object to come, and the answer their commits share: the
    object's number, or why it was not stored (one result for the flush, not one per
    record: over many streams each record is a commit of its own)."""

    __slots__ = ("records", "nbytes", "done")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.nbytes = 0
        self.done: AsyncResult = AsyncResult()


class Log:
    """This member's log writer: one flush in flight, each one object.

    Off (`member` None) until the process serves as a member: then the streams it
    serves alone commit through it (commits.py).
    """

    def __init__(self, objects: ObjectStore, linger: float) -> None:
        """`linger`: how long a flush that finds the log idle waits for company."""
        self.objects = objects
        self.linger = linger
        self.member: str | None = None
        self.seq = 0  # the last object stored
        # Flushes to come, in order; each holds MAX_FLUSH_BYTES at most, or one record.
        self.waiting: deque[Flush] = deque()
        self.flushing = False
        self.unreleased: dict[int, int] = {}  # seq -> its records not yet rewritten
        self.shaped: dict[int, SegmentIndex] = {}  # seq -> its segment's, until rewritten
        self.emptied: set[int] = set()  # objects all of whose records are, not yet deleted
        self.on_fenced: list[Callable[[], None]] = []
        self._collecting = False

    def begin(self, member: str) -> None:
        """Write as `member` from now on, from its first number."""
        self.member, self.seq, self.unreleased, self.emptied = member, 0, {}, set()
        self.shaped = {}

    def write(self, record: Record) -> int:
        """Store `record` with the next flush; the number of the object that holds it.

        Raises Fenced, or StorageUnavailable when the flush failed (then whether it
        was stored is unknown, and the member has given up its identity).
        """
        if self.member is None:
            raise Fenced("this process serves no streams now; retry")
        waiting, size = self.waiting, len(record.payload)
        if not waiting or waiting[-1].nbytes + size > MAX_FLUSH_BYTES:
            waiting.append(Flush())
        flush = waiting[-1]
        flush.records.append(record)
        flush.nbytes += size
        if not self.flushing:
            self.flushing = True
            self._flush_and_hand_on(first=True)
        return flush.done.get()

    def _flush_and_hand_on(self, *, first: bool = False) -> None:
        try:
            if first and self.linger:
                gevent.sleep(self.linger)  # let the other streams' commits join
            self._flush()
        finally:
            if self.waiting:
                gevent.spawn(self._flush_and_hand_on)
            else:
                self.flushing = False

    def _flush(self) -> None:
        flush = self.waiting.popleft()
        member = self.member
        if member is None:
            flush.done.set_exception(Fenced("this process serves no streams now; retry"))
            return
        seq = self.seq + 1
        token = os.urandom(16).hex()
        data, index = self._encode(token, flush.records)
        try:
            self._store(member, seq, data, token)
        except Exception as error:
            flush.done.set_exception(error)
            return
        except BaseException:
            flush.done.set_exception(StorageUnavailable(FLUSHED_OR_NOT))
            self._give_up(member)
            raise
        self.seq = seq
        self.unreleased[seq] = len(flush.records)
        if index is not None:
            self.shaped[seq] = index
        flush.done.set(seq)

    def _encode(self, token: str, records: list[Record]) -> tuple[bytes, SegmentIndex | None]:
        """A flush's object, and its segment's index when it is shaped as one: written as
        a `PMQLOG2` object and again as a segment, a large record's bytes cost twice."""
        if (
            len(records) == 1
            and len(records[0].payload) >= SHAPED_RECORD_BYTES
            and self.objects.links_cheaply
        ):
            return encode_shaped(token, records[0])
        return encode_log(token, records), None

    def shaped_source(self, seqs: array) -> tuple[str, SegmentIndex] | None:
        """For a run of one record from a shaped object: that object, to be linked as the
        run's segment, and the segment's index. None for any other run."""
        if len(seqs) != 1 or self.member is None:
            return None
        index = self.shaped.get(seqs[0])
        return None if index is None else (log_key(self.member, seqs[0]), index)

    def _store(self, member: str, seq: int, data: bytes, token: str) -> None:
        """Create log object `seq`, learning whether a failed try stored it after all."""
        key = log_key(member, seq)
        for attempt in range(FLUSH_ATTEMPTS):
            try:
                self.objects.create(key, data, verified_on_load=True)
                return
            except FileExistsError:
                if self._stored_token(key) == token:
                    return  # an earlier try of ours landed; only its answer was lost
                log.warning("member %s was fenced at %s: another member took over", member, key)
                self._give_up(member)
                raise Fenced("another process serves these streams now; retry") from None
            except StorageUnavailable as error:
                if attempt + 1 == FLUSH_ATTEMPTS:
                    log.warning("member %s gives up: %s may or may not be stored", member, key)
                    self._give_up(member)
                    raise StorageUnavailable(FLUSHED_OR_NOT) from error
                gevent.sleep(0.05 * 2**attempt)

    def _stored_token(self, key: str) -> str | None:
        try:
            return decode_log(self.objects.read(key))[0]
        except (FileNotFoundError, ValueError):
            return None

    def give_up(self) -> None:
        """Stop writing: storage says another member has this member's streams now."""
        if self.member is not None:
            self._give_up(self.member)

    def _give_up(self, member: str) -> None:
        """Stop writing as `member`: whoever serves its streams next replays its log."""
        if self.member != member:
            return
        self.member = None
        waiting, self.waiting = self.waiting, deque()
        for flush in waiting:
            flush.done.set_exception(Fenced("this process serves no streams now; retry"))
        for fenced in self.on_fenced:
            fenced()

    def is_fenced(self) -> bool:
        """Whether another member has fenced our log since our last flush (one request).

        A member that let its lease lapse asks before serving again, so that a fence
        is found before a client's append would be."""
        if self.member is None:
            return True
        if not self.objects.exists(log_key(self.member, self.seq + 1)):
            return False
        self._give_up(self.member)
        return True

    # -- what rewrites free --------------------------------------------------------

    def release(self, seqs: Iterable[int]) -> None:
        """Records of these objects are rewritten (or their stream deleted): objects left
        with none are deleted, in the background."""
        for seq in seqs:
            left = self.unreleased.get(seq)
            if left is not None:
                self.unreleased[seq] = left - 1
                if left == 1:
                    self.emptied.add(seq)
                    self.shaped.pop(seq, None)
        # Only the emptied: a rewrite round over many streams releases once per stream,
        # and looking through every object each time grew with streams times objects.
        if not self._collecting and any(seq < self.seq for seq in self.emptied):
            self._collecting = True
            gevent.spawn(self._collect)

    def _collect(self) -> None:
        """Delete the emptied objects but the latest: a fence must find the number to take."""
        try:
            member = self.member
            done = [seq for seq in self.emptied if seq < self.seq]
            if member is None or not done:
                return
            try:
                self.objects.delete_many([log_key(member, seq) for seq in done])
            except StorageUnavailable as error:  # the next release tries again
                log.warning("could not delete %d log objects: %s", len(done), error)
                return
            for seq in done:
                self.unreleased.pop(seq, None)
                self.emptied.discard(seq)
        finally:
            self._collecting = False

    def drop_everything(self) -> None:
        """On a clean stop, once every record is rewritten: the whole log goes."""
        member = self.member
        if member is None or any(left > 0 for left in self.unreleased.values()):
            return
        self.objects.delete_many([log_key(member, seq) for seq in self.unreleased])
        self.unreleased, self.emptied = {}, set()


def fence(objects: ObjectStore, member: str) -> int:
    """Take the next number of `member`'s log, so that it can store nothing more; the
    number taken: every object below it is the whole of what it stored."""
    for _ in range(FENCE_ATTEMPTS):
        seqs = _numbers(objects, member)
        seq = max(seqs, default=0) + 1
        try:
            objects.create(log_key(member, seq), FENCE)
            return seq
        except FileExistsError:  # it flushed meanwhile: it is not dead after all, or was
            continue
    raise StorageUnavailable(f"member {member} keeps writing its log; is it alive?")


def read_log(objects: ObjectStore, member: str, below: int) -> tuple[list[int], list[Record]]:
    """What `member` stored below number `below` (its fence): the numbers of its log
    objects, and their records in order.

    Only a flush never acknowledged can be torn (the last one stored before a crash,
    whose sync did not return; a log object linked before its blocks reached the disk
    may read back with its header whole and zeros after it, localdisk.py): such an
    object fails its checksum and is skipped. Fences are not counted: they must stay
    while the member they fence may still try to write.
    """
    seqs, records = [], []
    for seq in sorted(s for s in _numbers(objects, member) if s < below):
        try:
            data = objects.read(log_key(member, seq))
        except FileNotFoundError:
            continue  # deleted by another replay, or by the member once rewritten
        if data.startswith(FENCE):
            continue
        seqs.append(seq)
        try:
            records += decode_log(data)[1]
        except (ValueError, struct.error) as error:
            log.warning("skipping torn log object %s: %s", log_key(member, seq), error)
    return seqs, records


def _numbers(objects: ObjectStore, member: str) -> list[int]:
    return [int(name) for name in objects.list(f"{LOG}/{member}") if name.isdigit()]
