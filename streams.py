"""The stream store's nouns: what its callers send and get back, and what it keeps.

Errors (each one protocol outcome), requests and results, the store's settings, a
stream's configuration (its meta.json), the names a stream's objects have on storage,
the handle of one open stream and the cache of handles. Only this module changes a
handle's fields; the store's parts (pieces.py, commits.py, reads.py, waits.py,
lifecycle.py, compaction.py, retention.py) call its methods. Nothing here does I/O but
`read_config`.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING
from urllib.parse import quote

import gevent
import orjson
from gevent.event import AsyncResult
from gevent.lock import Semaphore

from objectstore import ObjectStore
from segments import StreamState
from wakeups import Wakeups

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    from runs import Run

OFFSET_DIGITS = 20
MAX_KEY_LENGTH = 200
STREAM_KEYS_REMEMBERED = 1024  # a request line caps a path at 8 KiB: 8 MiB at most
HASHED_PREFIX = "%h"  # a stream key that no percent-encoded path can be (`stream_key`)
LEGACY_HASHED_PREFIX = "~"
# Forks of forks load recursively; a chain deeper than this is refused (400 at create).
MAX_FORK_DEPTH = 32
# Idempotent producers (commits.py); the HTTP layer refuses longer ids and Stream-Seq
# values with 400.
MAX_PRODUCER_ID_BYTES = 256
MAX_STREAM_SEQ_BYTES = 256
PRODUCER_ENTRY_BYTES = MAX_PRODUCER_ID_BYTES + 64  # an upper bound, encoded or in memory
# What a stream handle holds besides its producers: fields, and per piece its start.
LOGGED = "logged:"  # held pieces' names: never an object's (rewrites.py)
HANDLE_BYTES = 2048
PIECE_BYTES = 100
NO_TAIL = -1  # what an If-Match that names no offset is compared as: no tail is this


# -- errors: each maps to one protocol outcome --------------------------------------


class StoreError(Exception):
    """Base of the outcomes the HTTP layer turns into status codes."""


class StreamNotFound(StoreError):
    pass


class StreamGone(StoreError):
    """Soft-deleted (forks still read it) or expired while forks live."""


class StreamConflict(StoreError):
    """The request is valid but disagrees with the stream (config, content type, Stream-Seq)."""


class StreamMoved(StoreError):
    """Another process serves the stream now (members.py): ask again, and be sent there."""


class InvalidRequest(StoreError):
    pass


class OffsetTrimmed(StoreError):
    """The offset is before the earliest data retention kept (410, with where to resume)."""

    def __init__(self, earliest: int) -> None:
        super().__init__("offset is before the earliest retained data")
        self.earliest = earliest


class StreamClosed(StoreError):
    def __init__(self, tail: int) -> None:
        super().__init__("stream is closed")
        self.tail = tail


class PreconditionFailed(StoreError):
    """An If-Match that names another tail than the stream's (412, with where it is)."""

    def __init__(self, tail: int, closed: bool) -> None:
        super().__init__("the stream's tail is not the offset If-Match names")
        self.tail = tail
        self.closed = closed


class ProducerFenced(StoreError):
    def __init__(self, current_epoch: int) -> None:
        super().__init__("stale producer epoch")
        self.current_epoch = current_epoch


class ProducerGap(StoreError):
    def __init__(self, expected: int, received: int) -> None:
        super().__init__("producer sequence gap")
        self.expected = expected
        self.received = received


# -- requests and results ----------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """Bytes to append; for JSON streams, already split into serialised messages."""

    data: bytes
    message_lengths: tuple[int, ...] = ()  # JSON: each message's, without its comma

    @staticmethod
    def from_messages(messages: Sequence[Buffer], array: bytes | None = None) -> Payload:
        """Each message followed by a comma; batches of 1,000 pass here, so no Python loop.

        Messages may be any buffer (bytes, or views of a request body), never copied twice.
        Lengths, not ends: where a message ends is known once the commit places the
        payload, and working it out there alone makes one pass over 1,000 integers, not two.
        When `array` (the JSON text the messages came from) holds them with nothing
        between but commas, as JSON encoders write, its inside is the payload already:
        one copy instead of a join that visits every message.
        """
        lengths = tuple(map(len, messages))
        if array is not None and messages:
            first, last = array.index(b"[") + 1, array.rindex(b"]")
            if sum(lengths) + len(lengths) - 1 == last - first:
                return Payload(b"".join((memoryview(array)[first:last], b",")), lengths)
        data = b",".join([*messages, b""]) if messages else b""
        return Payload(data, lengths)


@dataclass(frozen=True)
class Producer:
    id: str
    epoch: int
    seq: int


@dataclass(frozen=True)
class CreateRequest:
    content_type: str
    ttl: int | None = None
    expires_at: datetime | None = None
    closed: bool = False
    payload: Payload | None = None
    fork_source: str | None = None
    fork_offset: int | None = None
    fork_sub_offset: int = 0
    retention_age: int | None = None
    retention_bytes: int | None = None


@dataclass(frozen=True)
class AppendRequest:
    content_type: str | None
    payload: Payload | None
    close: bool = False
    producer: Producer | None = None
    stream_seq: str | None = None
    # If-Match: append only if the tail is still here when the batch commits (commits.py);
    # NO_TAIL matches no tail.
    if_match: int | None = None


@dataclass(frozen=True)
class StreamInfo:
    path: str
    incarnation: str
    content_type: str
    tail: int
    closed: bool
    ttl: int | None
    expires_at: str | None
    earliest: int = 0
    retention_age: int | None = None
    retention_bytes: int | None = None

    def at(self, tail: int, closed: bool, earliest: int) -> StreamInfo:
        """This info with another tail, as each commit and each append's answer needs:
        a copy of the fields, three changed (`dataclasses.replace` walks the fields and
        runs the frozen `__init__`, several times slower). The fields' dict is copied
        whole, which clones its table, and then given to the new info: updating an empty
        one grows it as it fills."""
        fields = self.__dict__.copy()
        fields["tail"], fields["closed"], fields["earliest"] = tail, closed, earliest
        info = object.__new__(StreamInfo)
        object.__setattr__(info, "__dict__", fields)  # frozen: no plain assignment
        return info


@dataclass(frozen=True)
class AppendResult:
    info: StreamInfo
    duplicate: bool = False
    producer: Producer | None = None


# A piece of a read's body: a view where it shares the bytes of a cached segment.
Chunk = bytes | memoryview


@dataclass(frozen=True)
class ReadResult:
    """A range [start, end) of a stream; `chunks` yields the body lazily (JSON: an array)."""

    info: StreamInfo
    start: int
    end: int
    chunks: Iterator[Chunk]
    up_to_date: bool


@dataclass(frozen=True)
class StoreSettings:
    max_read_bytes: int = 4 * 1024 * 1024
    poll_interval: float = 0.05
    watched_poll_interval: float = 1.0  # while a watch says when other processes add segments
    recheck_interval: float = 0.0
    linger_fraction: float = 0.0  # wait this share of the last write before the next batch
    cached_streams: int = 10_000
    cache_bytes: int = 64 * 1024 * 1024
    index_cache_bytes: int = 32 * 1024 * 1024  # segment indexes (their message ends)
    handle_cache_bytes: int = 32 * 1024 * 1024  # stream handles (pieces, producer tables)
    compact_after: int = 64
    compact_max_segments: int = 1024
    # A pack holds at most this much data; a segment of a sixteenth of it or more is
    # left as it is: copying it would cost far more than the one request it saves.
    compact_max_bytes: int = 4 * 1024 * 1024
    index_max_age: float = 60.0
    sweep_interval: float = 0.0  # seconds between sweeps for expired streams; 0: none
    retention_age: int | None = None
    retention_bytes: int | None = None
    # The member's log (log.py) and its rewrites into segments (rewrites.py).
    log_linger: float = 0.0  # how long a flush that finds the log idle waits for others
    rewrite_seconds: float = 30.0  # a stream's records are rewritten once this old...
    rewrite_bytes: int = 4 * 1024 * 1024  # ...or this large,
    held_bytes: int = 256 * 1024 * 1024  # and all at once past this much held in all

    @property
    def delete_grace(self) -> float:
        """How long compacted or trimmed objects outlive the index entries naming them."""
        return 10 * self.index_max_age


# -- stream configuration (meta.json) ----------------------------------------------


@dataclass(frozen=True)
class ForkOrigin:
    source: str
    source_incarnation: str
    requested_offset: int | None
    sub_offset: int
    point: int
    earliest: int = 0  # the source's retention had trimmed below this when forked


@dataclass(frozen=True)
class StreamConfig:
    path: str
    incarnation: str
    content_type: str
    ttl: int | None
    expires_at: str | None
    created_at: float
    fork: ForkOrigin | None
    retention_age: int | None = None
    retention_bytes: int | None = None

    def to_json(self) -> bytes:
        fields = dict(self.__dict__)
        fields["fork"] = self.fork.__dict__ if self.fork else None
        return orjson.dumps(fields)

    @staticmethod
    def from_json(data: bytes) -> StreamConfig:
        fields = orjson.loads(data)
        fork = fields.pop("fork")
        return StreamConfig(**fields, fork=ForkOrigin(**fork) if fork else None)


def is_json_type(content_type: str) -> bool:
    return media_type(content_type) == "application/json"


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


@functools.lru_cache(maxsize=STREAM_KEYS_REMEMBERED)
def stream_key(path: str) -> str:
    """One safe file name per stream path: percent-encoded, or hashed when too long.

    Percent-encoding writes only letters, digits, `-_.~` and `%` followed by two
    upper-case hex digits, so no path encodes to a name that starts with HASHED_PREFIX
    (`%` and a letter that is not hex): the two kinds cannot collide. Remembered: an
    append encodes its stream's name three times, and `quote` showed in its profile
    (bench/README.md, "The store's figures").
    """
    encoded = quote(path, safe="-_.")
    if len(encoded) <= MAX_KEY_LENGTH and encoded not in (".", ".."):
        return encoded
    return HASHED_PREFIX + hashlib.sha256(path.encode()).hexdigest()


def legacy_stream_key(path: str) -> str | None:
    """Where releases before 2026-12-06 kept a path too long to encode (None: not one).

    They named it `~<sha256>`, which the percent-encoding of the short path
    `~<sha256>` also gives: such a folder is the long path's only if its meta.json says
    so (`StreamStore._locate`).
    """
    key = stream_key(path)
    return LEGACY_HASHED_PREFIX + key[len(HASHED_PREFIX) :] if is_hashed_key(key) else None


def is_hashed_key(key: str) -> bool:
    return key.startswith(HASHED_PREFIX)


def segment_name(position: int) -> str:
    return f"{position:0{OFFSET_DIGITS}d}"


# -- the in-memory handle of one stream -------------------------------------------


@dataclass(eq=False)
class Pending:
    """An append waiting for its batch's commit (commits.py)."""

    request: AppendRequest
    result: AsyncResult = field(default_factory=AsyncResult)


@dataclass(eq=False, slots=True)
class Stream:
    """The live handle of one open stream in this process.

    One per stream at a time (Handles): its writer, its waiters and its index live
    here. Fields change through its methods; the store's parts read them. Slotted:
    its forty fields read as attributes of a dict cost more, and a commit over many
    streams reads a dozen of them on a handle not touched for a while.
    """

    config: StreamConfig
    key: str  # its folder under streams/ (`stream_key`, or `legacy_stream_key`)
    identity: object
    state: StreamState
    base: int
    source: Stream | None
    starts: list[int] = field(default_factory=list)
    # Pieces not at their segment's name: packs, and runs of the log held in memory.
    keys: dict[int, str] = field(default_factory=dict)
    # Runs of records in the member's log not yet rewritten into segments (runs.py),
    # in order, and their bytes.
    runs: list[Run] = field(default_factory=list)
    logged_bytes: int = 0
    rewriting: Semaphore = field(default_factory=Semaphore)  # one rewrite at a time
    indexed_at: float = 0.0
    unpacked: int = 0
    housekeeping: bool = False  # compaction or retention is at work (one at a time)
    earliest: int = 0
    trim_timer: gevent.Greenlet | None = None
    write_seconds: float = 0.0  # how long the last segment write took
    wakeups: Wakeups = field(default_factory=Wakeups)
    pending: list[Pending] = field(default_factory=list)
    writing: bool = False
    creating: int | None = None  # the start of the segment our writer is creating
    waiters: int = 0
    polling: bool = False
    last_access: float = 0.0
    touched_at: float = 0.0
    checked_at: float = 0.0
    refreshed_at: float = 0.0  # when the tail was last known to be the true one
    last_info: StreamInfo | None = None
    gone: bool = False
    erased: bool = False  # deleted through this handle: its waiters must not wait on
    depth: int = 0  # how many forks lie between it and a stream that is no fork
    counted_bytes: int = 0  # its footprint when the handle cache last counted it
    alone: bool = False  # this process alone serves it: no other process changes it
    moved: bool = False  # another process serves it now: this handle serves no more
    prefix: str = field(init=False)  # its folder: streams/<key>/<incarnation>

    def __post_init__(self) -> None:
        self.prefix = f"streams/{self.key}/{self.config.incarnation}"

    @property
    def meta_key(self) -> str:
        return meta_key(self.key)

    @property
    def is_json(self) -> bool:
        return is_json_type(self.config.content_type)

    def segment_key(self, position: int) -> str:
        return f"{self.prefix}/seg/{segment_name(position)}"

    def pack_key(self, start: int, end: int) -> str:
        return f"{self.prefix}/pack/{segment_name(start)}-{segment_name(end)}"

    def trim_key(self, earliest: int) -> str:
        return f"{self.prefix}/trim/{segment_name(earliest)}"

    def logged_key(self, start: int) -> str:
        """The name a record of the log is held under in memory until it is rewritten."""
        return f"{LOGGED}{self.prefix}/{segment_name(start)}"

    def piece_key(self, start: int) -> str:
        """The object holding the data at `start`: a pack once compacted, else the segment."""
        return self.keys.get(start) or self.segment_key(start)

    def footprint(self) -> int:
        """About the bytes this handle holds: it grows with its pieces and producers."""
        pieces = len(self.starts) + len(self.keys)
        producers = len(self.state.producers)
        return HANDLE_BYTES + PIECE_BYTES * pieces + PRODUCER_ENTRY_BYTES * producers

    def add_start(self, start: int) -> None:
        """Index a segment once, whether our writer or a refresh saw it first."""
        position = bisect.bisect_left(self.starts, start)
        if position == len(self.starts) or self.starts[position] != start:
            self.starts.insert(position, start)
            self.unpacked += 1

    def info(self) -> StreamInfo:
        """Built once per change: every live reader of the stream asks after every event."""
        info, state = self.last_info, self.state
        if (
            info is not None
            and info.tail == state.tail
            and info.closed == state.closed
            and info.earliest == self.earliest
        ):
            return info
        if info is not None:  # the rest comes from the config, the same for the handle's life
            self.last_info = info.at(state.tail, state.closed, self.earliest)
            return self.last_info
        config = self.config
        self.last_info = StreamInfo(
            path=config.path,
            incarnation=config.incarnation,
            content_type=config.content_type,
            tail=state.tail,
            closed=state.closed,
            ttl=config.ttl,
            expires_at=config.expires_at,
            earliest=self.earliest,
            retention_age=config.retention_age,
            retention_bytes=config.retention_bytes,
        )
        return self.last_info

    def notify(self) -> None:
        """Wake every live reader."""
        self.wakeups.notify()

    def raise_if_retired(self) -> None:
        """What a handle deleted (410 while forks read it, else 404), or one whose stream
        another process serves now, answers from now on."""
        if self.moved:
            raise StreamMoved(f"stream {self.config.path} is served elsewhere now; retry")
        if self.gone:
            raise StreamGone(f"stream {self.config.path} was deleted")
        if self.erased:
            raise StreamNotFound(f"stream {self.config.path} was deleted")

    def soft_delete(self) -> None:
        """Deleted while forks read it: 410 from now on, and its waiters end."""
        self.gone = True
        self.notify()

    def inherit_trim(self, earliest: int) -> None:
        """A fork being created starts no lower than its source has trimmed meanwhile."""
        origin = self.config.fork
        assert origin is not None
        self.config = replace(self.config, fork=replace(origin, earliest=earliest))

    def move_away(self) -> None:
        """Another process serves the stream from now on: its waiters end (a retry
        reaches the new server)."""
        self.moved = True
        self.notify()

    def end_waits(self) -> None:
        """Wake a deleted stream's waiters for good: no data will come to this handle."""
        self.erased = True
        self.notify()

    def add_run(self, run: Run, key: str) -> None:
        """Records of the log begin at `run.start`: a piece held in memory at `key`."""
        self.runs.append(run)
        self.keys[run.start] = key
        position = bisect.bisect_left(self.starts, run.start)
        if position == len(self.starts) or self.starts[position] != run.start:
            self.starts.insert(position, run.start)

    def logged_since(self) -> float:
        """When the oldest record not yet rewritten was logged (time.monotonic)."""
        return self.runs[0].since if self.runs else float("inf")

    def holds(self, start: int) -> bool:
        """Whether the piece at `start` is held in memory, not yet a segment."""
        return bool(self.runs) and start >= self.runs[0].start

    def adopt_rewrite(self, run: Run) -> None:
        """The first run is a segment now, at its start: swap it in."""
        self.runs.remove(run)
        self.keys.pop(run.start, None)
        self.logged_bytes -= run.nbytes
        self.unpacked += 1

    def drop_runs(self) -> list[Run]:
        """The stream is deleted or served elsewhere now: forget its runs (the log keeps
        their records until they are replayed or released)."""
        runs, self.runs, self.logged_bytes = self.runs, [], 0
        for run in runs:
            self.keys.pop(run.start, None)
        return runs

    def adopt_index(
        self, starts: list[int], keys: dict[int, str], state: StreamState, earliest: int
    ) -> None:
        """A listing's pieces and the state of the last, swapped in at once (pieces.py).
        Records held in memory stay: no listing shows them."""
        self.unpacked = len(starts) - len(keys)
        for run in self.runs:
            keys[run.start] = self.logged_key(run.start)
            if not starts or starts[-1] < run.start:
                starts.append(run.start)
        self.starts, self.keys = starts, keys
        self.state, self.earliest = state, earliest
        self.indexed_at = time.monotonic()

    # -- housekeeping: compaction.py and retention.py, one at a time

    def begin_housekeeping(self) -> bool:
        """Take the stream's housekeeping turn; False if compaction or retention has it."""
        if self.housekeeping:
            return False
        self.housekeeping = True
        return True

    def end_housekeeping(self) -> None:
        self.housekeeping = False

    def nothing_to_pack(self) -> None:
        """No run worth packing: look again after `compact_after` more segments."""
        self.unpacked = 0

    def adopt_pack(self, run: list[int], pack: str) -> None:
        """Swap a pack in for the run of segments it covers, by value: the index may have
        been listed again while the pack was written."""
        replaced = set(run[1:])
        self.starts = [start for start in self.starts if start not in replaced]
        self.add_start(run[0])
        self.keys[run[0]] = pack
        self.unpacked = len(self.starts) - len(self.keys)

    def trim_later(self, delay: float, trim: Callable[[], None]) -> None:
        """Run retention's `trim` in `delay` seconds, unless a run is due already."""
        if self.trim_timer is None:
            self.trim_timer = gevent.spawn_later(delay, self._run_trim, trim)

    def _run_trim(self, trim: Callable[[], None]) -> None:
        self.trim_timer = None
        trim()

    def trim(self, earliest: int) -> list[str]:
        """Make `earliest` the first offset kept; the keys of the pieces it drops."""
        dropped = [self.piece_key(start) for start in self.starts if start < earliest]
        self.starts = [start for start in self.starts if start >= earliest]
        self.earliest = earliest
        return dropped


class Handles:
    """The stream handles a process keeps, least recently used first, and their size.

    A handle's size changes as its stream grows (`Stream.footprint`): it is counted
    again after commits (`recount`), so the cache is bounded in bytes as well as in
    handles. Handles with waiters or a writer are never forgotten: another handle of
    the same stream would not see their commits; nor are handles holding records of
    the log not yet rewritten (rewrites.py): storage does not have them yet.
    """

    def __init__(self, most_handles: int, most_bytes: int) -> None:
        self._handles: OrderedDict[str, Stream] = OrderedDict()
        self.size_bytes = 0
        self.most_handles, self.most_bytes = most_handles, most_bytes

    def __len__(self) -> int:
        return len(self._handles)

    def __getitem__(self, path: str) -> Stream:
        return self._handles[path]

    def get(self, path: str) -> Stream | None:
        return self._handles.get(path)

    def move_to_end(self, path: str) -> None:
        self._handles.move_to_end(path)

    def paths(self) -> list[str]:
        return list(self._handles)

    def put(self, path: str, stream: Stream) -> None:
        """Keep `stream`'s handle, forgetting the oldest ones past the bounds."""
        self.discard(path)
        self._handles[path] = stream
        stream.counted_bytes = 0
        self._count(stream)
        self._shrink()

    def discard(self, path: str, stream: Stream | None = None) -> None:
        """Forget the handle of `path` (only if it is `stream`, when given)."""
        held = self._handles.get(path)
        if held is not None and (stream is None or held is stream):
            del self._handles[path]
            self.size_bytes -= held.counted_bytes

    def recount(self, stream: Stream) -> None:
        """After a commit: count `stream` anew, and forget the oldest handles if it
        grew the cache past its bytes."""
        if self._count(stream) > self.most_bytes:
            self._shrink()

    def _count(self, stream: Stream) -> int:
        """Count `stream`'s footprint anew, if it is held; the cache's size in bytes."""
        if self._handles.get(stream.config.path) is stream:
            footprint = stream.footprint()
            self.size_bytes += footprint - stream.counted_bytes
            stream.counted_bytes = footprint
        return self.size_bytes

    def _shrink(self) -> None:
        while len(self._handles) > self.most_handles or self.size_bytes > self.most_bytes:
            oldest_path, oldest = next(iter(self._handles.items()))
            if oldest.waiters or oldest.writing or oldest.runs:
                self._handles.move_to_end(oldest_path)
                return
            self.discard(oldest_path)


def meta_key(key: str) -> str:
    """The config of the stream kept in folder `key`: the commit point of its create."""
    return f"streams/{key}/meta.json"


def read_config(objects: ObjectStore, key: str) -> StreamConfig | None:
    """The config in `streams/<key>/meta.json`; None if absent or unreadable."""
    try:
        return StreamConfig.from_json(objects.read(meta_key(key)))
    except (FileNotFoundError, orjson.JSONDecodeError, TypeError, KeyError):
        return None


def highest_offset(names: list[str], *, default: int) -> int:
    """The highest offset among marker names (`trim/<offset>`, `trimming/<offset>`)."""
    return max((int(name) for name in names if name.isdigit()), default=default)
