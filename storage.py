"""The stream store: durable append-only streams on any fsspec filesystem.

Layout (identical on local disk and S3; every object is written create-only and
never rewritten):

    <root>/streams/<key>/meta.json                  config and incarnation id (the commit
                                                    point of create; deleted to delete)
    <root>/streams/<key>/<incarnation>/seg/<pos>    segment whose first byte is at <pos>
    <root>/streams/<key>/<incarnation>/pack/<a>-<b> run of segments covering [a, b)
                                                    (compaction.py)
    <root>/streams/<key>/<incarnation>/producers/<pos>-<token>
                                                    a producer table the segments after
                                                    <pos> build on (commits.py)
    <root>/streams/<key>/<incarnation>/trim/<pos>   retention dropped the data before <pos>
                                                    (retention.py)
    <root>/streams/<key>/<incarnation>/touched      sliding-TTL access marker (mtime)
    <root>/streams/<key>/<incarnation>/...          deleting, gone, forks/, trimming/:
                                                    the markers of lifecycle.py
    <root>/log/<member>/<seq>                       a member's commits of many streams,
                                                    until rewritten into their segments
                                                    (log.py, rewrites.py)

<key> is the stream path percent-encoded into one name, or `%h` and its SHA-256 when
too long (streams.py), so no input can name a file outside the root or another path's
folder. Offsets are byte positions in the stream, and a segment's name is the offset
it starts at, so the next segment of a stream is always named by its tail: a writer
creates `seg/<tail>`, and the create-only write is the fence between processes and
nodes.

A stream that one member serves alone (members.py) commits through the member's
log, and its records are rewritten into segments in the background: what the log
holds that the segments do not yet, the member holds in memory, and whoever serves
its streams after it replays its log first (`replay`).

This module opens streams (a handle per stream, checked against storage, which is the
only truth), creates them, and hands the rest to its parts, each over the stream's
pieces (pieces.py): appends to commits.py, reads to reads.py, live waits to waits.py,
deletes and forks' markers to lifecycle.py. After each commit it tells its listeners
(subscriptions) and starts the stream's housekeeping: compaction.py merges small
segments into packs, retention.py trims streams that keep data by age or size.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING
from urllib.parse import unquote

import fsspec
import gevent
from fsspec.implementations.local import LocalFileSystem
from gevent.event import AsyncResult

import compaction
import retention
from buckets import Bucket
from commits import Commits
from lifecycle import Lifecycle
from localdisk import LocalDisk
from log import Log, Record, fence, log_key, read_log
from objectstore import ObjectStore, StorageUnavailable
from pieces import Pieces
from reads import Reads
from rewrites import Rewrites
from runs import runs_of
from segments import StreamState
from streams import (
    LEGACY_HASHED_PREFIX,
    MAX_FORK_DEPTH,
    AppendRequest,
    AppendResult,
    CreateRequest,
    ForkOrigin,
    Handles,
    InvalidRequest,
    OffsetTrimmed,
    Payload,
    ReadResult,
    StoreError,
    StoreSettings,
    Stream,
    StreamConfig,
    StreamConflict,
    StreamGone,
    StreamInfo,
    StreamNotFound,
    is_hashed_key,
    legacy_stream_key,
    media_type,
    meta_key,
    read_config,
    stream_key,
)
from waits import Waits

if TYPE_CHECKING:
    from streamlocks import StreamLocks

log = logging.getLogger("picomq.storage")


def open_objects(url: str) -> ObjectStore:
    """The backend for a storage URL: a directory (a path, or file://) or a bucket."""
    if fsspec.utils.get_protocol(url) in LocalFileSystem.protocol:
        return LocalDisk(fsspec.core.url_to_fs(url)[1])
    return Bucket(url)


class StreamStore:
    """Create, append, read, wait, delete: the storage verbs the protocol needs.

    `segment`, `read_segment`, `publish_trim` and `delete_later` are public for the
    store's housekeeping (compaction.py, retention.py), not for the HTTP layer.
    """

    def __init__(
        self,
        objects: ObjectStore,
        settings: StoreSettings | None = None,
        writer_locks: StreamLocks | None = None,
    ) -> None:
        """`writer_locks` make the processes of one machine that write a stream take
        turns (streamlocks.py); without them a single process pays nothing for it."""
        self.objects = objects
        self.settings = settings or StoreSettings()
        self.pieces = Pieces(objects, self.settings)
        self.log = Log(objects, self.settings.log_linger)
        self.rewrites = Rewrites(self.pieces, self.log)
        self.commits = Commits(self.pieces, writer_locks, self._committed, self.rewrites)
        self.reads = Reads(self.pieces)
        self.waits = Waits(self.pieces)
        self._streams = Handles(self.settings.cached_streams, self.settings.handle_cache_bytes)
        self.lifecycle = Lifecycle(objects, self._streams, self._erased)
        self._building: dict[tuple[str, object], AsyncResult] = {}  # handles being loaded
        self.listeners: list[Callable[[StreamInfo], None]] = []
        self.commit_observers: list[Callable[[int], None]] = []  # appends per group commit
        # Whether this process alone serves a path's stream (members.py): then what it
        # holds is the whole truth, and storage need not be asked what others did.
        self.serves_alone: Callable[[str], bool] = lambda path: False
        # Asks the member serving a path's stream to "settle" (rewrite what it holds,
        # before a fork) or "recheck" it (look at storage again, after an erase here).
        self.ask_owner: Callable[[str, str], None] = lambda path, action: None

    # -- opening, caching, expiry -----------------------------------------------------

    def _open(
        self,
        path: str,
        *,
        touch: bool = False,
        max_age: float = 0.0,
        incarnation: str | None = None,
    ) -> Stream:
        """The live handle of a stream, checked against storage (the only truth).

        `max_age` lets a caller accept a handle checked that long ago, when it would
        not learn of other processes' changes any sooner by checking now.
        `incarnation` is the stream a live read began on: if the path now names
        another (deleted and created again), the one it followed is gone, and its
        offsets say nothing about the new one's bytes.
        """
        stream = self._checked_handle(path, max_age)
        if incarnation is not None and stream.config.incarnation != incarnation:
            raise StreamNotFound(f"stream {path} was deleted")
        stream.raise_if_retired()
        if self._expired(stream):
            if self.lifecycle.retire(stream):
                raise StreamGone(f"stream {path} expired while forks still read it")
            raise StreamNotFound(f"stream {path} not found")
        if touch and stream.config.ttl is not None:
            self._touch(stream)
        return self._fresh(stream)

    def _checked_handle(self, path: str, max_age: float = 0.0) -> Stream:
        """The cached handle, re-validated against storage once per `recheck_interval`.

        On local disk the interval is 0 (a stat is cheap); on object stores a delete
        or re-create made through another node is seen within the interval.
        """
        stream = self._streams.get(path)
        now = time.monotonic()
        max_age = max(max_age, self.settings.recheck_interval)
        alone = self.serves_alone(path)
        if stream is not None and (alone or now - stream.checked_at < max_age):
            self._streams.move_to_end(path)
            stream.alone = alone
            return stream
        if stream is not None:
            stream.checked_at = now  # one check at a time: concurrent requests use the cache
        try:
            fresh = self._current_handle(path)
            fresh.gone = fresh.gone or self.objects.exists(f"{fresh.prefix}/gone")
        except StorageUnavailable:
            if stream is None:
                raise
            return stream  # storage is down: what we already know still serves reads
        fresh.checked_at, fresh.alone = now, alone
        return fresh

    def _touch(self, stream: Stream) -> None:
        """Renew a sliding TTL; the marker object is rewritten at most once per interval."""
        now = time.time()
        stream.last_access = now
        interval = min(self.settings.recheck_interval, stream.config.ttl / 4)
        if now - stream.touched_at >= interval:
            stream.touched_at = now
            self.objects.touch(f"{stream.prefix}/touched")

    def _current_handle(self, path: str) -> Stream:
        key, identity = self._locate(path)
        if identity is None:
            self._streams.discard(path)
            raise StreamNotFound(f"stream {path} not found")
        stream = self._streams.get(path)
        if stream is not None and stream.identity == identity:
            self._streams.move_to_end(path)
            return stream
        return self._load(path, key, identity)

    def _locate(self, path: str) -> tuple[str, object | None]:
        """The folder that holds `path`'s stream, and its meta.json's identity (None: none).

        A long path written by an older release lives under its legacy key, looked up
        only when the current key holds nothing: one more stat or HEAD for those alone.
        """
        key = stream_key(path)
        identity = self.objects.identity(meta_key(key))
        legacy = legacy_stream_key(path) if identity is None else None
        if legacy is not None:
            legacy_identity = self.objects.identity(meta_key(legacy))
            if legacy_identity is not None:
                return legacy, legacy_identity
        return key, identity

    def _load(self, path: str, key: str, identity: object, depth: int = 0) -> Stream:
        """Build a stream's handle from storage; concurrent callers share one build.

        Listing and reading yield (S3). Without sharing, every request arriving while
        a handle is built would build its own, and the process would hold several
        handles of one stream: each with its own writer, contending with the others
        for the tail, and its own waiters, whom the others' commits never wake.
        `depth` counts the forks being loaded below this one (`MAX_FORK_DEPTH`).
        """
        building = self._building.get((path, identity))
        if building is not None:
            return building.get()
        building = self._building[path, identity] = AsyncResult()
        try:
            stream = self._build(path, key, identity, depth)
            building.set(stream)
            return stream
        except BaseException as error:  # the sharers see the builder's failure too
            building.set_exception(error)
            raise
        finally:
            del self._building[path, identity]

    def _build(self, path: str, key: str, identity: object, depth: int) -> Stream:
        config = read_config(self.objects, key)
        if config is None or config.path != path:
            # A folder another path's stream holds (an older release's hashed name, or a
            # filesystem that folds case) is no stream of this path.
            raise StreamNotFound(f"stream {path} not found")
        source, base = None, 0
        if config.fork:
            if depth >= MAX_FORK_DEPTH:
                raise StreamConflict(f"stream {path} is forked more than {MAX_FORK_DEPTH} deep")
            source = self._source_handle(path, key, identity, config.fork, depth)
            base = config.fork.point
        stream = Stream(config, key, identity, StreamState(tail=base), base, source)
        stream.depth = source.depth + 1 if source is not None else 0
        stream.last_access = config.created_at
        self._index(stream)
        self._streams.put(path, stream)
        return stream

    def _fresh(self, stream: Stream) -> Stream:
        """Re-list an index older than `index_max_age`: compaction may have moved its data.

        Compaction deletes a segment only `delete_grace` after packing it, far longer
        than an index may age, so no reader or writer ever uses a deleted segment. A
        stream this process serves alone changes only here: its index is never stale.
        """
        if not stream.alone and time.monotonic() - stream.indexed_at > self.settings.index_max_age:
            self._index(stream)
        return stream

    def _source_handle(
        self, path: str, key: str, identity: object, fork: ForkOrigin, depth: int
    ) -> Stream:
        """The source of the fork at `path` (in folder `key`, its meta.json `identity`), by
        incarnation: soft-deleted and expired sources still serve.

        A source goes only after its forks. Without it, either the fork was deleted
        since its meta.json was read, freeing the source (which may have been created
        again since), or storage lost the source.
        """
        stream = self._streams.get(fork.source)
        if stream is not None and stream.config.incarnation == fork.source_incarnation:
            return self._fresh(stream)
        source_key, source_identity = self._locate(fork.source)
        try:
            stream = self._load(fork.source, source_key, source_identity, depth + 1)
        except StreamNotFound:
            stream = None
        if stream is not None and stream.config.incarnation == fork.source_incarnation:
            return stream
        if self.objects.identity(meta_key(key)) != identity:
            raise StreamNotFound(f"stream {path} was deleted")
        raise StorageUnavailable(f"fork source {fork.source} is missing from storage")

    def forget_streams(self, changed: Callable[[str], bool], *, moved: bool) -> None:
        """Drop the handles of streams that changed hands: ones this process has begun to
        serve (loaded before, they may be stale: the next request loads them anew) or,
        `moved`, ones another process serves now (their waiters end, and a retry
        reaches it)."""
        for path in [path for path in self._streams.paths() if changed(path)]:
            stream = self._streams.get(path)
            self._streams.discard(path)
            if stream is not None:
                self.rewrites.drop(stream, erased=False)  # the log keeps its records
                if moved:
                    stream.move_away()

    def held(self) -> list[StreamInfo]:
        """The streams whose handles this process holds, as it holds them: those it may
        have appended to lately (subscriptions.py asks, for a subscription it learned of
        late)."""
        handles = (self._streams.get(path) for path in self._streams.paths())
        return [stream.info() for stream in handles if stream is not None]

    def _index(self, stream: Stream) -> None:
        """List the stream's pieces; then retention looks at what it may drop."""
        self.pieces.index(stream)
        self._schedule_trim(stream)

    def _schedule_trim(self, stream: Stream) -> None:
        retention.schedule_trim(
            self.pieces, self.lifecycle.publish_trim, self.rewrites.rewrite, stream
        )

    def _expired(self, stream: Stream) -> bool:
        config, now = stream.config, time.time()
        if (
            config.expires_at is not None
            and now >= datetime.fromisoformat(config.expires_at).timestamp()
        ):
            return True
        if config.ttl is None:
            return False
        if now < stream.last_access + config.ttl:
            return False
        # Our own record says expired; another process may have used it since.
        touched = self.objects.modified(f"{stream.prefix}/touched") or 0.0
        stream.last_access = max(stream.last_access, touched)
        return now >= stream.last_access + config.ttl

    # -- create --------------------------------------------------------------------------

    def create(self, path: str, request: CreateRequest) -> tuple[bool, StreamInfo]:
        """Create a stream, or confirm an identical one: returns (created, info)."""
        existing = self._existing_for_create(path)
        fork, source, request = self._resolve_fork(request)
        config = StreamConfig(
            path=path,
            incarnation=uuid.uuid4().hex[:16],
            content_type=request.content_type,
            ttl=request.ttl,
            expires_at=request.expires_at.isoformat() if request.expires_at else None,
            created_at=time.time(),
            fork=fork,
            retention_age=_either(request.retention_age, self.settings.retention_age),
            retention_bytes=_either(request.retention_bytes, self.settings.retention_bytes),
        )
        if existing is not None:
            return False, self._confirm(existing, config, request)
        tail = fork.point if fork else 0
        stream = Stream(config, stream_key(path), None, StreamState(tail=tail), 0, None)
        if request.payload is not None and request.payload.data or request.closed:
            self.commits.write_first(stream, request.payload or Payload(b""), request.closed)
        else:  # where readers can watch for the first segment (local disk)
            self.objects.make_directory(f"{stream.prefix}/seg")
        if source is not None:
            self.lifecycle.mark_source(source, stream)  # may raise the fork's earliest offset
        try:
            self.objects.create(stream.meta_key, stream.config.to_json())
        except FileExistsError:
            if self.lifecycle.created_by(stream.key, config.incarnation):
                return True, self._announced_info(path, stream)  # only the answer was lost
            self.lifecycle.abandon(stream, source)
            winner = self._existing_for_create(path)
            if winner is not None:
                return False, self._confirm(winner, config, request)
            if self._held_by_another_path(stream.key, path):
                raise StreamConflict(f"the storage name of {path} is another stream's") from None
            return self.create(path, request)  # another request deleted it already
        if source is None:
            self._adopt_created(path, stream)
        return True, self._announced_info(path, stream)

    def _adopt_created(self, path: str, stream: Stream) -> None:
        """Keep the handle a create built, when this process serves the stream alone and
        holds no other handle of it: what the create wrote is the whole stream, and
        reading it back cost eight more requests on S3 (five listings, the segment,
        meta.json, the gone marker). Its meta.json's identity is read: a request that
        looked the stream up meanwhile compares it (`_current_handle`), and a handle
        without it would be built again beside this one."""
        if not self.serves_alone(path):
            return
        identity = self.objects.identity(stream.meta_key)
        if identity is None or self._streams.get(path) is not None:
            return
        if any(building == path for building, _ in self._building):
            return
        stream.identity = identity
        stream.alone = True
        stream.last_access = stream.config.created_at
        stream.checked_at = stream.indexed_at = stream.refreshed_at = time.monotonic()
        self._streams.put(path, stream)

    def _held_by_another_path(self, key: str, path: str) -> bool:
        """Whether folder `key` holds a meta.json that is not a stream of `path`: an
        older release's hashed name equal to this short path, or a case-folding disk."""
        config = read_config(self.objects, key)
        return config.path != path if config is not None else self.objects.exists(meta_key(key))

    def _announced_info(self, path: str, created: Stream) -> StreamInfo:
        """The info of a stream just created, announced to listeners while it exists.

        Other requests may have deleted it (soft-deleted, if they forked it, or
        created another) already: it was created all the same, and the answer says
        what was created.
        """
        try:
            current = self._open(path)
        except (StreamNotFound, StreamGone):
            return created.info()
        if current.config.incarnation != created.config.incarnation:
            return created.info()
        info = current.info()
        self._announce(info)
        return info

    def _existing_for_create(self, path: str) -> Stream | None:
        try:
            return self._open(path)
        except StreamNotFound:
            return None
        except StreamGone as error:
            raise StreamConflict(
                f"stream {path} was deleted and cannot be re-created yet"
            ) from error

    def _confirm(
        self, existing: Stream, wanted: StreamConfig, request: CreateRequest
    ) -> StreamInfo:
        """An idempotent re-create matches every setting, closure included, or is a 409."""
        have = existing.config
        same = (
            media_type(have.content_type) == media_type(wanted.content_type)
            and have.ttl == wanted.ttl
            and have.expires_at == wanted.expires_at
            and have.retention_age == wanted.retention_age
            and have.retention_bytes == wanted.retention_bytes
            and existing.state.closed == request.closed
            and _fork_request(have.fork) == _fork_request(wanted.fork)
        )
        if not same:
            raise StreamConflict(f"stream {have.path} exists with a different configuration")
        return existing.info()

    def _resolve_fork(
        self, request: CreateRequest
    ) -> tuple[ForkOrigin | None, Stream | None, CreateRequest]:
        """Validate fork headers against the source; forks inherit its type and expiry."""
        if request.fork_source is None:
            return None, None, request
        try:
            source = self._open(request.fork_source)
        except StreamNotFound as error:
            raise StreamNotFound(f"fork source {request.fork_source} not found") from error
        except StreamGone as error:
            raise StreamConflict(f"fork source {request.fork_source} was deleted") from error
        if source.depth >= MAX_FORK_DEPTH:
            raise InvalidRequest(f"forks of forks go at most {MAX_FORK_DEPTH} deep")
        self._settle(source)
        offset = source.state.tail if request.fork_offset is None else request.fork_offset
        if offset > source.state.tail:
            raise InvalidRequest("Stream-Fork-Offset is beyond the source's tail")
        if offset < source.earliest:
            raise OffsetTrimmed(source.earliest)
        if source.is_json and not self.reads.is_boundary(source, offset):
            # A fork cut inside a message would be invalid JSON for good once appended to.
            raise InvalidRequest("Stream-Fork-Offset is inside a JSON message")
        point = self.reads.sub_offset_point(source, offset, request.fork_sub_offset)
        if request.content_type and media_type(request.content_type) != media_type(
            source.config.content_type
        ):
            raise StreamConflict("fork content type differs from its source")
        inherited = request
        if request.ttl is None and request.expires_at is None:
            expires = source.config.expires_at
            inherited = replace(
                request,
                ttl=source.config.ttl,
                expires_at=datetime.fromisoformat(expires) if expires else None,
            )
        inherited = replace(inherited, content_type=source.config.content_type)
        origin = ForkOrigin(
            source=source.config.path,
            source_incarnation=source.config.incarnation,
            requested_offset=request.fork_offset,
            sub_offset=request.fork_sub_offset,
            point=point,
            earliest=source.earliest,
        )
        return origin, source, inherited

    def _settle(self, source: Stream) -> None:
        """Have the source's data in its own segments, where a fork reads it: rewrite
        what this process holds of it, or ask the member that serves it to."""
        if source.alone:
            self.rewrites.rewrite(source)
            return
        self.ask_owner(source.config.path, "settle")
        self.pieces.refresh(source)

    def settle(self, path: str) -> None:
        """Rewrite what this process holds of `path`'s stream into its segments now."""
        self.rewrites.rewrite(self._open(path))

    def recheck(self, path: str) -> None:
        """Another member erased `path`'s stream, which this process serves (the last
        fork of a soft-deleted source went there): drop the handle if its meta.json is
        gone, so the next request finds the stream gone too."""
        stream = self._streams.get(path)
        if stream is None or self.lifecycle.created_by(stream.key, stream.config.incarnation):
            return
        self._streams.discard(path)
        self._erased(stream)
        stream.end_waits()

    def _erased(self, stream: Stream) -> None:
        """After an erase: held records go; a member serving the stream is told."""
        self.rewrites.drop(stream, erased=True)
        if not stream.alone:
            try:
                self.ask_owner(stream.config.path, "recheck")
            except StorageUnavailable as error:  # it answers from what it holds until restart
                log.warning(
                    "could not tell %s's server it was erased: %s", stream.config.path, error
                )

    # -- append ----------------------------------------------------------------------------

    def append(self, path: str, request: AppendRequest) -> AppendResult:
        """Append once durable (commits.py); the stream's sliding TTL is renewed."""
        return self.commits.append(self._open(path, touch=True), request)

    def _committed(self, stream: Stream, appends: int, new_piece: bool) -> None:
        """After each commit: listeners, observers, the handle cache's count, housekeeping.

        The handle's footprint and compaction's count of unpacked pieces change only
        with a new piece or producer: over many streams nearly every commit is one
        append joining its stream's run, and counting anew after each was a measurable
        part of its cost (bench/README.md, "The store's figures"). A look that found
        housekeeping busy is made again with the stream's next piece, at the latest the
        first commit after its run is rewritten. Retention looks after every commit:
        bytes beyond its limit come with any append. Whether the stream has a retention
        setting is read from its info, just built, rather than from its config, which
        over many streams is no longer in the processor's caches."""
        info = stream.info()
        self._announce(info)
        for observe in self.commit_observers:
            observe(appends)
        if new_piece:
            self._streams.recount(stream)
            compaction.maybe_compact(self.pieces, stream)
        if retention.retains(info):
            self._schedule_trim(stream)

    def _announce(self, info: StreamInfo) -> None:
        """Tell listeners (subscriptions) that a stream was created or grew in this process."""
        for listener in self.listeners:
            try:
                listener(info)
            except Exception:
                log.exception("stream listener failed for %s", info.path)

    # -- head, read, wait -----------------------------------------------------------

    def head(self, path: str) -> StreamInfo:
        stream = self._open(path)
        if not stream.alone:
            self.pieces.refresh_if_reachable(stream)
        return stream.info()

    def touch(self, path: str) -> StreamInfo:
        """Renew a sliding TTL (reads that return no data still count as use)."""
        stream = self._open(path, touch=True)
        if not stream.alone:
            self.pieces.refresh(stream)
        return stream.info()

    def read(
        self,
        path: str,
        offset: int | None,
        max_bytes: int | None = None,
        *,
        incarnation: str | None = None,
        after_wait: bool = False,
    ) -> ReadResult:
        """Up to `max_bytes` from `offset` (None: the start), as `Reads.read` says.

        `incarnation`: read only from that incarnation of the stream (see `_open`).
        `after_wait`: the read fetches what a `wait` just announced, and takes the
        stream as fresh as the wait did (a handle checked, or a tail confirmed, within
        `poll_interval`): a live event after this process's own append then costs no
        storage request.
        """
        freshness = self.settings.poll_interval if after_wait else 0.0
        stream = self._open(path, touch=True, max_age=freshness, incarnation=incarnation)
        return self.reads.read(stream, offset, max_bytes or self.settings.max_read_bytes, freshness)

    def wait(
        self, path: str, offset: int, timeout: float, *, incarnation: str | None = None
    ) -> StreamInfo:
        """Return once the stream has data past `offset`, is closed, or `timeout` passed
        (waits.py); `incarnation` as for `read`."""
        max_age = self.settings.poll_interval  # a waiter learns of news by polling anyway
        stream = self._open(path, touch=True, max_age=max_age, incarnation=incarnation)
        return self.waits.wait(stream, offset, timeout)

    # -- listing --------------------------------------------------------------------------

    def paths(self) -> Iterator[str]:
        """Every stream path on storage (deleted ones may linger: `head` what you use)."""
        for key in self.objects.list("streams"):
            if not (is_hashed_key(key) or key.startswith(LEGACY_HASHED_PREFIX)):
                yield unquote(key)
                continue
            config = read_config(self.objects, key)
            if config is not None:
                yield config.path

    def sweep(self) -> None:
        """Delete every expired stream, touched or not, free soft-deleted ones whose
        forks have all gone, and remove folders no stream uses (local disk).

        Opening a stream is what deletes it once expired, so a stream nobody opens again
        would keep its data for ever. Opening each one (opening never renews a TTL) is
        the sweep; streams that vanish meanwhile are fine. A soft-deleted stream is
        freed when its last fork goes, or here if that fork failed or was never
        created (a crash between its steps).
        """
        for key in self.objects.list("streams"):
            config = read_config(self.objects, key)
            try:
                if config is not None:
                    self._sweep_stream(config.path)
            except (StreamNotFound, StreamGone):
                pass
            except StoreError as error:  # one stream that cannot load never stops the sweep
                log.warning("sweep skipped %s: %s", config.path if config else key, error)
            self._remove_unused_folders(key, config)
            gevent.sleep(0)  # local reads block the loop: requests go first between streams

    def _sweep_stream(self, path: str) -> None:
        stream = self._checked_handle(path)
        if stream.gone and not self.lifecycle.has_forks(stream):
            self.lifecycle.erase(stream)
        else:
            self._open(path)

    def _remove_unused_folders(self, key: str, config: StreamConfig | None) -> None:
        """Remove incarnation folders of `key` that its meta.json does not name.

        What a writer that raced a delete, or a delete cut short, left behind: nothing
        reads them. A create writes its folder before its meta.json, so only folders
        unchanged for `delete_grace` go. Object stores have no folders with an age:
        there it does nothing (and lists nothing).
        """
        if not self.objects.is_local:
            return
        current = config.incarnation if config is not None else None
        for name in self.objects.list(f"streams/{key}"):
            folder = f"streams/{key}/{name}"
            if name in ("meta.json", current):
                continue
            modified = self.objects.modified(folder)
            if modified is not None and time.time() - modified > self.settings.delete_grace:
                log.info("removing %s: no stream uses it", folder)
                try:
                    self.objects.delete_tree(folder)
                except OSError as error:  # written to meanwhile: the next sweep tries again
                    log.warning("could not remove %s: %s", folder, error)

    # -- delete ---------------------------------------------------------------------------

    def delete(self, path: str) -> None:
        self.lifecycle.retire(self._open(path))

    # -- the log of a member gone ------------------------------------------------------------

    def _write_missing(self, stream: Stream, records: list[Record]) -> None:
        """Write the records past the stream's segments, as segments at its tail.
        `FileExistsError` if another replay wrote there first."""
        missing = [record for record in records if record.start >= stream.state.tail]
        if missing and missing[0].start != stream.state.tail:
            log.error("log records of %s start at %d, its segments end at %d",
                      stream.config.path, missing[0].start, stream.state.tail)  # fmt: skip
            return
        for run in runs_of(missing):
            data, _ = run.segment(os.urandom(16).hex())
            self.objects.create(stream.segment_key(run.start), data, verified_on_load=True)

    def close(self) -> None:
        """A clean stop: what the log holds is rewritten, and then the log goes. Whatever
        is not rewritten in time stays in the log, for the next member to replay."""
        if self.rewrites.rewrite_all(CLOSE_SECONDS):
            self.log.drop_everything()

    def replay(self, member: str, fenced: bool = True) -> None:
        """Make what `member` stored in its log part of its streams' own segments: done
        before this process serves any stream the member served.

        The log is fenced first (log.py): if the member is alive after all, it can
        store nothing more, and what it stored is all below the fence. A member whose
        process is known to be gone needs no fence (`fenced` False), which would stay
        behind. Then each stream's records not yet in its segments are rewritten, and
        the log objects go. Replays of one log may run at once and again: each writes
        at its stream's tail, create-only, and one already there moves the tail on.
        """
        below = fence(self.objects, member) if fenced else sys.maxsize
        seqs, records = read_log(self.objects, member, below)
        by_stream: dict[tuple[str, str], list[Record]] = {}
        for record in records:
            by_stream.setdefault((record.path, record.prefix), []).append(record)
        for (path, prefix), stream_records in by_stream.items():
            try:
                self._replay_stream(path, prefix, stream_records)
            except StorageUnavailable:
                raise  # the next claim replays again
            except StoreError as error:  # a stream that cannot load never stops the rest
                log.error("replay of %s skipped: %s", path, error)
            gevent.sleep(0)  # requests go first between streams
        self.objects.delete_many([log_key(member, seq) for seq in seqs])
        log.info("replayed %d records of %d streams from member %s", len(records),
                 len(by_stream), member)  # fmt: skip

    def _replay_stream(self, path: str, prefix: str, records: list[Record]) -> None:
        for _ in range(REPLAY_ATTEMPTS):
            try:
                stream = self._checked_handle(path)
            except StreamNotFound:
                return  # deleted since: its records go with it
            try:
                if stream.prefix != prefix:
                    return  # deleted and created again since
                self.pieces.index(stream)
                self._write_missing(stream, records)
                return
            except FileExistsError:
                continue  # another replay wrote at that tail: look again
            except FileNotFoundError:
                return
            finally:
                self._streams.discard(path, stream)  # served here next, it is loaded afresh
        raise StorageUnavailable(f"replaying {path}: its tail keeps moving; retry")


REPLAY_ATTEMPTS = 5
CLOSE_SECONDS = 10.0  # a stopping process rewrites what it holds for at most this long


def _either(value: int | None, default: int | None) -> int | None:
    return default if value is None else value


def _fork_request(fork: ForkOrigin | None) -> tuple[object, ...] | None:
    if fork is None:
        return None
    return (fork.source, fork.requested_offset, fork.sub_offset)
