"""The byte layout of one segment: an immutable object holding a batch of appends.

A segment carries the data of one group commit together with the complete stream
state after that batch (closed flag, idempotent-producer epochs and sequences,
Stream-Seq). Data and state land in one create-only object, so after a crash they
can never disagree, and loading a stream only needs its last segment.

    b"PMQ1" | header length (u32) | header CRC-32 (u32) | header JSON | payload

The header names the offsets the segment covers and where each append and each JSON
message ends; the payload is the appended bytes (for JSON streams each message is
stored serialised and followed by a comma, so a read is a byte copy plus brackets).
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass, field

import orjson

MAGIC = b"PMQ1"
PREFIX = struct.Struct(">4sII")
HEADER_PROBE_BYTES = 64 * 1024


class CorruptSegment(Exception):
    """A segment whose prefix or header checksum does not verify."""


@dataclass
class StreamState:
    """What a write must be validated against; copied, changed, then committed."""

    tail: int = 0
    closed: bool = False
    producers: dict[str, tuple[int, int]] = field(default_factory=dict)
    closer: tuple[str, int, int] | None = None
    stream_seq: str | None = None

    def copy(self) -> StreamState:
        return StreamState(
            self.tail, self.closed, dict(self.producers), self.closer, self.stream_seq
        )


@dataclass(frozen=True)
class SegmentIndex:
    """Where a segment's data sits and where its appends and messages end."""

    start: int
    end: int
    payload_position: int
    append_ends: tuple[int, ...]
    message_ends: tuple[int, ...]
    payload_crc: int | None = None
    written_at: float = 0.0
    token: str = ""


def encode_segment(
    start: int,
    payload: bytes,
    append_ends: list[int],
    message_ends: list[int],
    state: StreamState,
    written_at: float | None = None,
    token: str = "",
) -> tuple[bytes, SegmentIndex]:
    """The segment's bytes, and its index: the writer need not parse what it just wrote.

    `written_at` (default: now) dates the newest data in it, for age-based retention.
    `token` is unique to one write attempt: when an object store stores a segment but
    the answer is lost, the retried create fails, and the token tells our own segment
    from another writer's.
    """
    payload_crc = zlib.crc32(payload)
    written_at = time.time() if written_at is None else written_at
    header = orjson.dumps(
        {
            "start": start,
            "end": state.tail,
            "appends": append_ends,
            "messages": message_ends,
            "closed": state.closed,
            "producers": state.producers,
            "closer": state.closer,
            "stream_seq": state.stream_seq,
            "payload_crc": payload_crc,
            "written_at": written_at,
            "token": token,
        }
    )
    index = SegmentIndex(
        start=start,
        end=state.tail,
        payload_position=PREFIX.size + len(header),
        append_ends=tuple(append_ends),
        message_ends=tuple(message_ends),
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
    index = SegmentIndex(
        start=fields["start"],
        end=fields["end"],
        payload_position=PREFIX.size + length,
        append_ends=tuple(fields["appends"]),
        message_ends=tuple(fields["messages"]),
        payload_crc=fields.get("payload_crc"),
        written_at=fields.get("written_at", 0.0),
        token=fields.get("token", ""),
    )
    closer = fields["closer"]
    state = StreamState(
        tail=fields["end"],
        closed=fields["closed"],
        producers={key: (value[0], value[1]) for key, value in fields["producers"].items()},
        closer=(closer[0], closer[1], closer[2]) if closer else None,
        stream_seq=fields["stream_seq"],
    )
    return index, state


def verify_payload(data: bytes, index: SegmentIndex) -> None:
    """Check a whole segment: as long as its header says, and its payload checksum."""
    payload = data[index.payload_position :]
    if len(payload) != index.end - index.start:
        raise CorruptSegment("segment payload is shorter or longer than its header says")
    if index.payload_crc is not None and zlib.crc32(payload) != index.payload_crc:
        raise CorruptSegment("segment payload checksum mismatch")
