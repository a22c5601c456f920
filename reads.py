"""Reads: which bytes a read from an offset returns, and where it ends.

A read returns whole JSON messages (JSON streams) or whole appends (other types), at
least one, and no more than the read cap unless that one is larger; so every
Stream-Next-Offset PicoMQ gives out starts a message or an append. Offsets it never
gave out are read as the reference server reads them: from inside a message or an
append, from its start; from past the tail, nothing. A fork reads its source's bytes
below its fork point, through as many forks as it descends from. Small pieces come
whole through the object cache; large ones stream in bounded chunks.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from objectstore import StorageUnavailable
from pieces import Pieces
from runs import Run
from streams import Chunk, InvalidRequest, OffsetTrimmed, ReadResult, Stream

# Where a read's bytes are: an object's key, or a run held in memory; the position and
# length of the bytes in it, and its size.
Slice = tuple[str | Run, int, int, int]

# Up to this size the last chunk of a JSON read is copied to close the array in one
# chunk; past it, it is sent as a view, and "]" after it.
SMALL_CHUNK_BYTES = 64 * 1024


class Reads:
    """Reads of open streams, over their pieces."""

    def __init__(self, pieces: Pieces) -> None:
        self.pieces = pieces
        self.objects = pieces.objects
        self.cache = pieces.cache

    def read(self, stream: Stream, offset: int | None, most: int, freshness: float) -> ReadResult:
        """Up to `most` bytes from `offset` (None: the start), in whole JSON messages (or, in
        other streams, whole appends), one at least; more only if that one is larger.

        An offset inside a message (or append) reads from its start, and one past the
        tail reads nothing, up to date: the reference server's answers to offsets it did
        not give out, which the Yjs provider's server relies on.

        A tail confirmed within `freshness` seconds is taken as it is; else the read
        looks for other processes' segments first, so that it says up-to-date truly.
        """
        current = True
        reaches_tail = _read_start(stream, offset) + most >= stream.state.tail
        if reaches_tail and not stream.alone and not self.pieces.tail_confirmed(stream, freshness):
            try:
                self.pieces.refresh(stream)  # the answer may reach the tail: say up-to-date truly
            except StorageUnavailable:
                if _read_start(stream, offset) >= stream.state.tail:
                    raise
                current = False  # storage is down: serve what we know, claim nothing more
        try:
            # Again: retention may have trimmed meanwhile.
            start = self._unit_start(stream, min(_read_start(stream, offset), stream.state.tail))
            tail = stream.state.tail
            end, slices = self._plan_read(stream, start, min(tail, start + most))
            data = _first_taken_now(self._byte_chunks(slices))
        except FileNotFoundError as error:
            self.pieces.raise_if_deleted(stream, error)
            raise
        chunks = self._json_chunks(data) if stream.is_json else data
        return ReadResult(stream.info(), start, end, chunks, current and end == tail)

    def _plan_read(self, stream: Stream, start: int, limit: int) -> tuple[int, list[Slice]]:
        """Where a read from `start` up to `limit` ends, and the pieces' slices it takes.

        Reading the pieces' indexes here is where a stream that another process deleted
        since it was opened shows.
        """
        end = self._end_before(stream, start, limit)
        return end, self._slices(stream, start, end)

    def is_boundary(self, stream: Stream, offset: int) -> bool:
        """Whether `offset` starts a JSON message (JSON streams) or an append (others)."""
        if offset in (0, stream.state.tail, stream.base):
            return True
        if stream.source is not None and offset < stream.base:
            return self.is_boundary(stream.source, offset)
        index = self.pieces.piece_holding(stream, offset)
        return index is not None and (offset == index.start or index.is_end(offset, stream.is_json))

    def _unit_start(self, stream: Stream, offset: int) -> int:
        """Where the JSON message (or, in other streams, the append) holding the byte at
        `offset` starts: a read from inside one starts there, as the reference server's
        do, and as the Yjs provider's server expects of the offsets it makes up."""
        if offset in (0, stream.state.tail, stream.base):
            return offset
        if stream.source is not None and offset < stream.base:
            return self._unit_start(stream.source, offset)
        index = self.pieces.piece_holding(stream, offset)
        if index is None or not index.start <= offset < index.end:
            return offset  # the read's slices meet the gap and answer 503
        return index.start_around(offset, stream.is_json)

    def _end_before(self, stream: Stream, start: int, limit: int) -> int:
        """The last message (or append) end in (start, limit], or the first after `start`:
        a read ends on a whole message or append, and never returns nothing."""
        if limit <= start:
            return start
        if stream.source is not None and start < stream.base:
            if limit < stream.base:  # the fork point is an end: its source's data ends there
                return min(self._end_before(stream.source, start, limit), stream.base)
            own_end = self._own_end(stream, stream.base, limit, backward=True)
            return own_end if own_end > stream.base else stream.base
        found = self._own_end(stream, start, limit, backward=True)
        if found > start:
            return found
        return self._own_end(stream, start, stream.state.tail, backward=False)

    def _own_end(self, stream: Stream, start: int, limit: int, *, backward: bool) -> int:
        # Walk this list even if compaction puts a shorter one in place while an index is
        # read (S3): the pieces it names stay readable for the delete grace.
        starts, messages = stream.starts, stream.is_json
        first = bisect.bisect_right(starts, start) - 1
        last = bisect.bisect_left(starts, limit) - 1
        order = (
            range(last, max(first, 0) - 1, -1) if backward else range(max(first, 0), len(starts))
        )
        for position in order:
            index = self.pieces.segment(stream, starts[position])
            found = (
                index.last_end(start, limit, messages)
                if backward
                else index.first_end(start, messages)
            )
            if found is not None and found <= limit:
                return found
        return start

    def _slices(self, stream: Stream, start: int, end: int) -> list[Slice]:
        """The slices (`Slice`) of the pieces that hold [start, end). A run held in
        memory is named by itself, not its key: a rewrite may let go of it before the
        answer that reads it is sent."""
        pieces: list[Slice] = []
        if stream.source is not None and start < stream.base:
            pieces += self._slices(stream.source, start, min(end, stream.base))
            start = stream.base
        if start >= end:
            return pieces
        if end > stream.state.tail:
            self.pieces.refresh(stream)
        while start < end:
            # Found anew for each piece: reading an index may yield, and compaction may
            # replace `stream.starts` meanwhile; a position into the old list would skip.
            piece = bisect.bisect_right(stream.starts, start) - 1
            index = self.pieces.segment(stream, stream.starts[piece]) if piece >= 0 else None
            if index is None or not index.start <= start < index.end:
                stream.indexed_at = 0.0  # re-list before the next request
                gap = StorageUnavailable(f"index of {stream.config.path} has a gap at {start}")
                self.pieces.raise_if_deleted(stream, gap)  # listed while a delete removed pieces
                raise gap
            length = min(end, index.end) - start
            key = stream.piece_key(index.start)
            byte_position = index.payload_position + start - index.start
            size = index.payload_position + index.end - index.start
            pieces.append((self.pieces.held(key) or key, byte_position, length, size))
            start += length
        return pieces

    def _byte_chunks(self, slices: list[Slice]) -> Iterator[Chunk]:
        """Small objects come whole through the cache; large ones stream in chunks."""
        for piece, position, length, size in slices:
            if isinstance(piece, Run):
                yield piece.bytes_at(position, length)
                continue
            data = self.cache.get(piece)
            if data is None and size <= self.cache.capacity_bytes // 8:
                data = self.objects.read(piece)
                self.cache.put(piece, data)
            if data is None:
                yield from self.objects.iter_range(piece, position, length)
            else:  # a view, not a copy: a cached segment may be megabytes
                yield memoryview(data)[position : position + length]

    @staticmethod
    def _json_chunks(data: Iterator[Chunk]) -> Iterator[Chunk]:
        """Stored messages each end with ',': the array is '[' + bytes minus the last ',' + ']'."""
        yield b"["
        held: Chunk = b""
        for chunk in data:
            if held:
                yield held
            held = chunk
        if len(held) > SMALL_CHUNK_BYTES:  # the last chunk as a view: no copy of megabytes
            yield memoryview(held)[:-1]
            yield b"]"
        else:  # one chunk, one send, as the answer to a live read mostly is
            yield bytes(held[:-1]) + b"]"

    def sub_offset_point(self, stream: Stream, offset: int, sub_offset: int) -> int:
        """The fork point `sub_offset` bytes (or JSON messages) into the append at `offset`."""
        if sub_offset == 0:
            return offset
        append_end, message_ends = self._append_at(stream, offset)
        if stream.is_json:
            if sub_offset > len(message_ends):
                raise InvalidRequest("Stream-Fork-Sub-Offset is past the end of that append")
            return message_ends[sub_offset - 1]
        if offset + sub_offset > append_end:
            raise InvalidRequest("Stream-Fork-Sub-Offset is past the end of that append")
        return offset + sub_offset

    def _append_at(self, stream: Stream, offset: int) -> tuple[int, list[int]]:
        """End of the append that starts at `offset`, and its message ends (JSON)."""
        if stream.source is not None and offset < stream.base:
            end, messages = self._append_at(stream.source, offset)
            return min(end, stream.base), [m for m in messages if m <= stream.base]
        index = self.pieces.piece_holding(stream, offset)
        if index is None or offset >= stream.state.tail:
            raise InvalidRequest("Stream-Fork-Sub-Offset names data past the source's tail")
        start, end = index.append_around(offset)
        if start != offset:
            raise InvalidRequest("Stream-Fork-Offset is not the start of an append")
        return end, index.ends_in(offset, end, messages=True)


def _read_start(stream: Stream, offset: int | None) -> int:
    """Where a read from `offset` (None: the earliest retained) starts; 410 if trimmed."""
    start = stream.earliest if offset is None else offset
    if start < stream.earliest:
        raise OffsetTrimmed(stream.earliest)
    return start


def _first_taken_now(chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """`chunks`, the first one read before the answer starts.

    The rest is read as the answer is sent; if another process deletes the stream
    meanwhile, the answer is cut. Taking the first now makes a read of one piece, as
    most live reads are, either whole or a 404.
    """
    first = next(chunks, None)
    return chunks if first is None else itertools.chain((first,), chunks)
