"""The byte layout of one segment: an immutable object holding a batch of appends.

A segment carries the data of one group commit together with the stream state after
that batch (closed flag, Stream-Seq, idempotent producers). Data and state land in one
create-only object, so after a crash they can never disagree, and loading a stream
only needs its last segment.

    b"PMQ1" | header length (u32) | header CRC-32 (u32) | header JSON | payload

The header names the offsets the segment covers and where each append and each JSON
message ends, as little-endian u32 positions relative to the segment's start, in
base64: four bytes a message whatever its shape, decoded without a Python object per
message. Segments written before 2026-12-06 list absolute ends as JSON numbers; both
are read. The payload is the appended bytes (for JSON streams each message is stored
serialised and followed by a comma, so a read is a byte copy plus brackets).

A stream may have had thousands of producers, so a segment does not carry the whole
producer table: only the entries changed since the table's last snapshot, an object of
its own that the header names (`producer_snapshot`; none: the segment carries every
entry). The store writes a new snapshot when the changes outgrow
PRODUCER_CHANGES_BYTES (storage.py).
"""

from __future__ import annotations

import base64
import bisect
import itertools
import operator
import struct
import sys
import time
import zlib
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson

MAGIC = b"PMQ1"
PREFIX = struct.Struct(">4sII")
HEADER_PROBE_BYTES = 64 * 1024
POSITION_TYPE = "I"  # u32: a segment holds less than 4 GiB
POSITION_SIZE = array(POSITION_TYPE).itemsize  # 4, as stored
# A segment a commit, a rewrite or a replay writes holds at most this much data (or one
# append, one record, if larger): well inside its u32 positions.
MAX_SEGMENT_BYTES = 64 * 1024 * 1024
LITTLE_ENDIAN = sys.byteorder == "little"

# A producer's entry: its epoch, its last sequence number, and when it last appended
# (seconds since the epoch), by which idle producers expire.
ProducerEntry = tuple[int, int, int]


class CorruptSegment(Exception):
    """A segment whose prefix or header checksum does not verify."""


@dataclass
class StreamState:
    """What a write must be validated against; copied, changed, then committed.

    `producers` is the whole table, except in a state just decoded from a header that
    names a `producer_snapshot`: then it holds only the entries changed since that
    snapshot, until the store merges the snapshot in. `producers_changed` names the
    entries a segment written from this state carries.
    """

    tail: int = 0
    closed: bool = False
    producers: dict[str, ProducerEntry] = field(default_factory=dict)
    closer: tuple[str, int, int] | None = None
    stream_seq: str | None = None
    producer_snapshot: str | None = None
    producers_changed: set[str] = field(default_factory=set)

    def copy(self) -> StreamState:
        return StreamState(
            self.tail,
            self.closed,
            dict(self.producers),
            self.closer,
            self.stream_seq,
            self.producer_snapshot,
            set(self.producers_changed),
        )

    def changed_producers(self) -> dict[str, ProducerEntry]:
        return {key: self.producers[key] for key in self.producers_changed}


def count_within(sizes: Iterable[int], most: int) -> int:
    """How many of the first items, of these sizes, fit in `most` bytes together; one at
    least, if there is one."""
    total = count = 0
    for size in sizes:
        total += size
        if total > most and count:
            break
        count += 1
    return count


def positions(values: list[int] | None = None) -> array:
    """An empty (or filled) array of relative positions, as SegmentIndex holds them."""
    return array(POSITION_TYPE, values or ())


def _swapped_positions_bytes(values: array) -> bytes:
    swapped = array(POSITION_TYPE, values)
    swapped.byteswap()
    return swapped.tobytes()


# Positions as stored: little-endian u32s. Where the machine's order is that already,
# the array's own method, with no call of ours around it: every commit stores two.
positions_bytes: Callable[[array], bytes] = (
    array.tobytes if LITTLE_ENDIAN else _swapped_positions_bytes
)


def positions_of(data: bytes) -> array:
    """Positions from what `positions_bytes` stored."""
    values = positions()
    values.frombytes(data)
    if not LITTLE_ENDIAN:
        values.byteswap()
    return values


def extend_shifted(ends: array, more: array, shift: int) -> None:
    """Add `more` ends, each moved by `shift`, in one C-level pass."""
    if shift:
        ends.extend(map(operator.add, more, itertools.repeat(shift)))
    else:
        ends.extend(more)


@dataclass(frozen=True)
class SegmentIndex:
    """Where a segment's data sits and where its appends and messages end.

    Ends are kept relative to `start` in u32 arrays: 4 bytes a message in memory, and
    `nbytes` tells a cache what an index costs.
    """

    start: int
    end: int
    payload_position: int
    append_ends: array
    message_ends: array
    payload_crc: int | None = None
    written_at: float = 0.0
    token: str = ""

    @property
    def nbytes(self) -> int:
        """Roughly what this index holds in memory."""
        sizes = self.append_ends.itemsize * (len(self.append_ends) + len(self.message_ends))
        return 200 + len(self.token) + sizes

    def ends(self, messages: bool) -> array:
        """Where its JSON messages end, or (`messages` False) its appends: the units a
        read starts and ends at."""
        return self.message_ends if messages else self.append_ends

    def is_end(self, offset: int, messages: bool) -> bool:
        ends = self.ends(messages)
        position = bisect.bisect_left(ends, offset - self.start)
        return position < len(ends) and ends[position] == offset - self.start

    def last_end(self, low: int, high: int, messages: bool) -> int | None:
        """The last end in (low, high], if any."""
        ends = self.ends(messages)
        position = bisect.bisect_right(ends, high - self.start) - 1
        if position >= 0 and ends[position] > low - self.start:
            return self.start + ends[position]
        return None

    def first_end(self, low: int, messages: bool) -> int | None:
        """The first end after `low`, if any."""
        ends = self.ends(messages)
        position = bisect.bisect_right(ends, low - self.start)
        return self.start + ends[position] if position < len(ends) else None

    def ends_in(self, low: int, high: int, messages: bool) -> list[int]:
        """The ends in (low, high], in order."""
        ends, start = self.ends(messages), self.start
        first = bisect.bisect_right(ends, low - start)
        last = bisect.bisect_right(ends, high - start)
        return [start + end for end in ends[first:last]]

    def start_around(self, offset: int, messages: bool) -> int:
        """Where the message (or append) holding the byte at `offset` starts."""
        ends = self.ends(messages)
        position = bisect.bisect_right(ends, offset - self.start)
        return self.start + (ends[position - 1] if position else 0)

    def append_around(self, offset: int) -> tuple[int, int]:
        """The append holding the byte at `offset`: (its start, its end)."""
        start = self.start_around(offset, messages=False)
        return start, self.first_end(offset, messages=False) or self.end


def encode_segment(
    start: int,
    payload: bytes,
    append_ends: array,
    message_ends: array,
    state: StreamState,
    written_at: float | None = None,
    token: str = "",
    extra: dict[str, object] | None = None,
) -> tuple[bytes, SegmentIndex]:
    """The segment's bytes, and its index: the writer need not parse what it just wrote.

    `append_ends` and `message_ends` are relative to `start`. `written_at` (default:
    now) dates the newest data in it, for age-based retention. `token` is unique to one
    write attempt: when an object store stores a segment but the answer is lost, the
    retried create fails, and the token tells our own segment from another writer's.
    `extra` adds header fields a reader of segments ignores (log.py's shaped objects).
    """
    payload_crc = zlib.crc32(payload)
    written_at = time.time() if written_at is None else written_at
    fields = {
        "start": start,
        "end": state.tail,
        "append_ends": _encode_positions(append_ends),
        "message_ends": _encode_positions(message_ends),
        "closed": state.closed,
        "producers": state.changed_producers(),
        "producer_snapshot": state.producer_snapshot,
        "closer": state.closer,
        "stream_seq": state.stream_seq,
        "payload_crc": payload_crc,
        "written_at": written_at,
        "token": token,
    }
    header = orjson.dumps(fields | extra if extra else fields)
    index = SegmentIndex(
        start=start,
        end=state.tail,
        payload_position=PREFIX.size + len(header),
        append_ends=append_ends,
        message_ends=message_ends,
        payload_crc=payload_crc,
        written_at=written_at,
        token=token,
    )
    return PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header + payload, index


def header_length(probe: bytes) -> int:
    """Total bytes of prefix plus header, from the first bytes of a segment."""
    if len(probe) < PREFIX.size:
        raise CorruptSegment("segment shorter than its prefix")
    magic, length, _ = PREFIX.unpack_from(probe)
    if magic != MAGIC:
        raise CorruptSegment("bad segment magic")
    return PREFIX.size + length


def decode_header(head: bytes) -> tuple[SegmentIndex, StreamState]:
    """Parse prefix and header (the bytes up to `header_length`)."""
    _, length, checksum = PREFIX.unpack_from(head)
    header = head[PREFIX.size : PREFIX.size + length]
    if len(header) != length or zlib.crc32(header) != checksum:
        raise CorruptSegment("segment header checksum mismatch")
    fields = orjson.loads(header)
    start, written_at = fields["start"], fields.get("written_at", 0.0)
    index = SegmentIndex(
        start=start,
        end=fields["end"],
        payload_position=PREFIX.size + length,
        append_ends=_decode_positions(fields, "append_ends", "appends", start),
        message_ends=_decode_positions(fields, "message_ends", "messages", start),
        payload_crc=fields.get("payload_crc"),
        written_at=written_at,
        token=fields.get("token", ""),
    )
    producers = producer_entries(fields["producers"], written_at)
    state = StreamState(
        tail=fields["end"],
        closed=fields["closed"],
        producers=producers,
        closer=closer_of(fields["closer"]),
        stream_seq=fields["stream_seq"],
        producer_snapshot=fields.get("producer_snapshot"),
        producers_changed=set(producers),
    )
    return index, state


def _encode_positions(values: array) -> str:
    return base64.b64encode(positions_bytes(values)).decode()


def _decode_positions(fields: dict, name: str, legacy_name: str, start: int) -> array:
    """Relative positions from `name`, or from a legacy header's absolute `legacy_name`."""
    if name not in fields:
        return positions([end - start for end in fields[legacy_name]])
    return positions_of(base64.b64decode(fields[name]))


def encode_producer_table(producers: dict[str, ProducerEntry]) -> bytes:
    """A producer snapshot's bytes (create-only, written whole before any segment names it)."""
    return orjson.dumps(producers)


def decode_producer_table(data: bytes) -> dict[str, ProducerEntry]:
    return producer_entries(orjson.loads(data))


def producer_entries(
    decoded: dict[str, list[int]], written_at: float = 0
) -> dict[str, ProducerEntry]:
    """Producer entries as JSON gave them back. Entries written before producers expired
    carry no time: they count from `written_at`, their segment's."""
    return {
        key: (value[0], value[1], value[2] if len(value) > 2 else int(written_at))
        for key, value in decoded.items()
    }


def closer_of(decoded: list | None) -> tuple[str, int, int] | None:
    """The closing producer (id, epoch, sequence), as JSON gave it back."""
    return (decoded[0], decoded[1], decoded[2]) if decoded else None


def verify_payload(data: bytes, index: SegmentIndex) -> None:
    """Check a whole segment: as long as its header says, and its payload checksum."""
    payload = data[index.payload_position :]
    if len(payload) != index.end - index.start:
        raise CorruptSegment("segment payload is shorter or longer than its header says")
    if index.payload_crc is not None and zlib.crc32(payload) != index.payload_crc:
        raise CorruptSegment("segment payload checksum mismatch")
