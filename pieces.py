"""A stream's pieces on storage: which segments and packs hold its data, their indexes,
and the stream's state, read from the last one.

A piece is a segment (one group commit) or a pack (compaction.py: a run of segments
copied into one object); a trim marker (retention.py) hides the pieces below it. A
handle's list of pieces is built from a listing when the stream is opened, and again
once `index_max_age` old; between listings, `refresh` and `catch_up` pick up the
segments other processes wrote after the tail, one name at a time, since the next
segment is always named by the tail. Indexes (where each append and message ends) are
read once and kept in a cache bounded in bytes; a piece read whole (the tail's, which
readers want next) is kept in the object cache too.
"""

from __future__ import annotations

import bisect
import logging
import time

import gevent

from objectstore import ObjectCache, ObjectStore, StorageUnavailable
from runs import Run
from segments import (
    HEADER_PROBE_BYTES,
    CorruptSegment,
    SegmentIndex,
    StreamState,
    decode_header,
    decode_producer_table,
    header_length,
    verify_payload,
)
from streams import StoreSettings, Stream, StreamNotFound, highest_offset, segment_name

log = logging.getLogger("picomq.storage")


class Pieces:
    """Reads of the pieces of streams, shared by every part of the store."""

    def __init__(self, objects: ObjectStore, settings: StoreSettings) -> None:
        self.objects = objects
        self.settings = settings
        self.cache: ObjectCache[bytes] = ObjectCache(settings.cache_bytes)
        self.indexes: ObjectCache[SegmentIndex] = ObjectCache(settings.index_cache_bytes)
        # Runs of the member's log not yet in their streams' segments, by their
        # `Stream.logged_key`: never evicted, let go once rewritten (rewrites.py).
        self._held: dict[str, Run] = {}

    def hold(self, key: str, run: Run) -> None:
        self._held[key] = run

    def held(self, key: str) -> Run | None:
        return self._held.get(key)

    def let_go(self, keys: list[str]) -> None:
        for key in keys:
            self._held.pop(key, None)

    def index(self, stream: Stream) -> None:
        """List a stream's segments and packs and read its state from the last one.

        Built aside and swapped in at once: listing yields to other greenlets (S3), and
        readers must never see a half-built index or a tail older than one they saw.
        """
        starts, keys, covered, earliest = self._list(stream)
        state = StreamState(tail=stream.base)
        while starts:
            key = keys.get(starts[-1]) or stream.segment_key(starts[-1])
            try:
                _, state = self.read_piece(key, whole=True)
                break
            except CorruptSegment as error:
                self.drop_torn(key, error)
            except FileNotFoundError as error:
                # Listed, then gone: the stream was deleted meanwhile, or another
                # process dropped this piece as torn and the one before is the last.
                self.raise_if_deleted(stream, error)
            keys.pop(starts.pop(), None)
        while not state.closed:  # segments written while we listed
            key = stream.segment_key(state.tail)
            try:
                index, newer = self.read_piece(key, whole=True)
            except FileNotFoundError:
                break
            except CorruptSegment as error:
                self.drop_torn(key, error)
                break
            starts.append(index.start)
            state = newer
        state = self.whole_state(stream, state)
        if stream.state.tail > state.tail:  # our own writer got further meanwhile
            starts += [start for start in stream.starts if start >= state.tail]
            state = stream.state
        stream.adopt_index(starts, keys, state, earliest)
        if covered:
            self.delete_later(covered)

    def _list(self, stream: Stream) -> tuple[list[int], dict[int, str], list[str], int]:
        """Starts of the pieces in use, pack keys by start, unused keys, earliest offset.

        A pack replaces the segments it covers. Packs that two nodes made over each
        other may overlap: the first one listed is used, and a later one only for
        what it holds past the first (the segments there may be gone, replaced by
        it); one wholly inside is not used. Nor are pieces wholly below the earliest
        offset (retention). Pieces used may therefore overlap: a read finds the one
        with the last start at or before its offset, which holds it.
        """
        # Segments before packs: a pack listed here was written before its originals were
        # deleted, and one written after the segment listing found its originals in it.
        names = self.objects.list(f"{stream.prefix}/seg")
        segment_starts = sorted(int(name) for name in names if name.isdigit())
        packs = sorted(
            (int(start), int(end))
            for start, _, end in (
                name.partition("-") for name in self.objects.list(f"{stream.prefix}/pack")
            )
            if start.isdigit() and end.isdigit()
        )
        trims = self.objects.list(f"{stream.prefix}/trim")
        inherited = stream.config.fork.earliest if stream.config.fork else 0
        earliest = highest_offset(trims, default=inherited)
        starts, keys, unused, covered_to = [], {}, [], -1
        # At one start, a pack (the longest piece) comes before the segment it replaced.
        pieces = sorted(
            [(start, -end, True) for start, end in packs]
            + [(start, -start, False) for start in segment_starts],
            key=lambda piece: (piece[0], piece[1], not piece[2]),
        )
        for start, negative_end, is_pack in pieces:
            end = -negative_end
            key = stream.pack_key(start, end) if is_pack else stream.segment_key(start)
            # A trim cuts at a piece start, but another node may have packed across it.
            trimmed = end <= earliest if is_pack else start < earliest
            covered = end <= covered_to if is_pack else start < covered_to
            if covered or trimmed:
                if not is_pack or trimmed:
                    unused.append(key)
                continue
            starts.append(start)
            if is_pack:
                keys[start] = key
                covered_to = end
        return starts, keys, unused, earliest

    def raise_if_deleted(self, stream: Stream, error: Exception) -> None:
        """StreamNotFound if `error` (a piece missing, or missing from a listing) came from
        another process deleting the stream after we opened it."""
        if self.deleted_elsewhere(stream):
            raise StreamNotFound(f"stream {stream.config.path} was deleted") from error

    def deleted_elsewhere(self, stream: Stream) -> bool:
        """Whether the stream's meta.json is no longer the one this handle loaded."""
        return self.objects.identity(stream.meta_key) != stream.identity

    def read_segment(
        self, stream: Stream, start: int, *, whole: bool = False
    ) -> tuple[SegmentIndex, StreamState]:
        """Header (and state, as `decode_header` gives it) of the piece at `start`."""
        return self.read_piece(stream.piece_key(start), whole=whole)

    def read_piece(self, key: str, *, whole: bool = False) -> tuple[SegmentIndex, StreamState]:
        """Header (and state) of a segment or pack; `whole` also checks its payload.

        The last segment of a stream is read whole: it is the one a crash could have
        torn, its state is the stream's, and readers will want its bytes next. Read
        from storage, it may be another process's, just linked: made durable before
        anything in it is served.
        """
        run = self._held.get(key)
        if run is not None:  # not cached: the run grows, and its index with it
            return run.index(), run.state()
        data = self.cache.get(key)
        if data is None:
            data = (
                self.objects.read(key) if whole else self.objects.read(key, 0, HEADER_PROBE_BYTES)
            )
            if whole:
                self.objects.make_durable(key)
        length = header_length(data)
        if length > len(data):
            data = self.objects.read(key, 0, length)
        index, state = decode_header(data)
        if whole:
            verify_payload(data, index)
            self.cache.put(key, data)
        self.indexes.put(key, index, index.nbytes)
        return index, state

    def whole_state(self, stream: Stream, state: StreamState) -> StreamState:
        """A state decoded from a header, its producer table made whole.

        A header that names a producer snapshot carries only the entries changed since
        it, all of them (they accumulate until the next snapshot), so they supersede any
        this handle knows: on the handle's own snapshot they merge onto its table
        without a request; on another, that snapshot is read.
        """
        snapshot = state.producer_snapshot
        if snapshot is None:
            return state
        if snapshot == stream.state.producer_snapshot:
            table = stream.state.producers
        else:
            table = decode_producer_table(self._read_cached(snapshot))
        state.producers = {**table, **state.producers}
        return state

    def _read_cached(self, key: str) -> bytes:
        data = self.cache.get(key)
        if data is None:
            data = self.objects.read(key)
            self.cache.put(key, data)
        return data

    def drop_torn(self, key: str, error: CorruptSegment) -> None:
        """A last segment that fails its checks was never acknowledged: remove it."""
        log.warning("dropping torn segment %s: %s", key, error)
        self.objects.delete_many([key])

    def delete_later(self, keys: list[str]) -> None:
        """Delete objects that left the index once no older index can still name them.

        A failed delete is only logged: the next listing finds the objects unused and
        schedules them again.
        """
        gevent.spawn_later(self.settings.delete_grace, self.delete_quietly, keys)

    def delete_quietly(self, keys: list[str]) -> None:
        try:
            self.objects.delete_many(keys)
        except StorageUnavailable as error:
            log.warning("could not delete %d compacted or trimmed objects: %s", len(keys), error)

    def segment(self, stream: Stream, start: int) -> SegmentIndex:
        """The index of the piece at `start`, read from storage only the first time.

        Compaction may swap a pack in at `start` while the read yields (S3): the index
        returned is always that of the piece `stream.piece_key(start)` names on return,
        so a caller never reads one object's bytes at another's positions.
        """
        while True:
            key = stream.piece_key(start)
            index = self.indexes.get(key) or self.read_segment(stream, start)[0]
            if stream.piece_key(start) == key:
                return index

    def refresh(self, stream: Stream, *, only_next: bool = False) -> bool:
        """Pick up segments other processes wrote after our tail (or the next); True if any.

        Other greenlets may move the handle's tail while a segment is read (reads yield
        on S3): a state read is adopted, and a segment that fails its checks dropped as
        torn, only while the tail is still where the read began, so the handle never
        goes back to an older state and no segment another read verified is dropped.
        """
        found, started = False, time.monotonic()
        while not stream.state.closed:
            position = stream.state.tail
            if not self.objects.may_exist(stream.segment_key(position)):
                break
            try:
                index, state = self.read_segment(stream, position, whole=True)
                state = self.whole_state(stream, state)
            except FileNotFoundError:
                break
            except CorruptSegment as error:
                if stream.state.tail == position:  # else it was read whole meanwhile
                    self.drop_torn(stream.segment_key(position), error)
                break
            stream.add_start(index.start)
            if stream.state.tail == position:
                stream.state = state
            found = True
            if index.end == index.start or only_next:
                break
        stream.refreshed_at = started
        if found:
            stream.notify()
        return found

    def catch_up(self, stream: Stream) -> None:
        """After a lost race, adopt the state of the last segment written since our tail.

        Read one by one, the new segments cost a request each, and a process that keeps
        winning writes them as fast as the loser reads: in a two-worker test on moto the
        loser chased the tail for seconds, lost again, and answered 503. One listing
        names every segment after our tail (create-only writes at the tail make each of
        them part of the stream), and the last one holds the stream's state. The next
        try goes straight to the new tail; if the winner wrote again meanwhile, it
        loses and lists again.
        """
        tail = stream.state.tail
        names = self.objects.list_after(f"{stream.prefix}/seg", segment_name(tail))
        starts = [tail, *(int(name) for name in names if name.isdigit())]
        try:
            _, state = self.read_segment(stream, starts[-1], whole=True)
            state = self.whole_state(stream, state)
        except (FileNotFoundError, CorruptSegment):  # removed or torn: the careful way
            self.refresh(stream)
            return
        # Further on, or closed where we stand (another process's close is an empty
        # segment at our tail); else a reader's refresh got further meanwhile.
        if (state.tail, state.closed) > (stream.state.tail, stream.state.closed):
            for start in starts:
                stream.add_start(start)
            stream.state = state
            stream.notify()

    def refresh_if_reachable(self, stream: Stream) -> None:
        """Refresh, or go on with what this process knows while storage is down."""
        try:
            self.refresh(stream)
        except StorageUnavailable as error:
            log.warning("serving %s from memory: %s", stream.config.path, error)

    @staticmethod
    def tail_confirmed(stream: Stream, within: float) -> bool:
        return time.monotonic() - stream.refreshed_at < within

    def piece_holding(self, stream: Stream, offset: int) -> SegmentIndex | None:
        position = bisect.bisect_right(stream.starts, offset) - 1
        return self.segment(stream, stream.starts[position]) if position >= 0 else None
