"""The few storage verbs the stream store needs, over any fsspec filesystem.

Every object the store writes is created exactly once and never rewritten, so the
only write primitive that must be exact is "create if absent". fsspec offers it
(`pipe_file(mode="create")`) but on local disk it is check-then-write, not atomic,
and fsspec never fsyncs, so local disk has its own (localdisk.py). Remote
filesystems (S3) use the conditional PUT that fsspec sends, and run in gevent's
thread pool because s3fs's synchronous calls fail on a gevent-patched thread (see
shared/storage-facts.md).

Backend errors become Python built-ins here: `FileNotFoundError` for a missing
object, `FileExistsError` when a create-only write loses, `StorageUnavailable` for
anything else the backend raises.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

import dirwatch
import localdisk
from dirwatch import Cancel, OnCreate

T = TypeVar("T")
V = TypeVar("V")

READ_CHUNK_BYTES = 256 * 1024


# Fail over to a 503 within seconds when the endpoint is down, instead of botocore's
# default minute of retries; explicit s3fs options (FSSPEC_S3_*) still take precedence.
THREADPOOL_SIZE = 64  # concurrent blocking storage calls per worker
S3_RETRIES = 2
S3_DEFAULTS: dict[str, object] = {
    "config_kwargs": {
        "connect_timeout": 2,
        "read_timeout": 15,
        "retries": {"max_attempts": 2, "mode": "standard"},
    },
}


class StorageUnavailable(Exception):
    """The backend failed in a way a retry may cure (network, 5xx, disk error)."""


def run_in_threadpool(function: Callable[..., T], *args: object, **kwargs: object) -> T:
    """Run a blocking backend call off the gevent hub's thread.

    The exception travels back as a value: gevent's pool would print a traceback for
    every expected FileNotFoundError.
    """
    import gevent

    def capture() -> tuple[bool, object]:
        try:
            return True, function(*args, **kwargs)
        except BaseException as error:  # re-raised in the calling greenlet below
            return False, error

    pool = gevent.get_hub().threadpool
    pool.maxsize = max(pool.maxsize, THREADPOOL_SIZE)
    succeeded, outcome = pool.apply(capture)
    if succeeded:
        return outcome  # type: ignore[return-value]
    raise outcome  # type: ignore[misc]


def _run_here(function: Callable[..., T], *args: object, **kwargs: object) -> T:
    return function(*args, **kwargs)


class ObjectCache(Generic[V]):
    """Recently written or read immutable objects, least recently used out first.

    Segments never change once written, so a cached copy is always right. Live
    readers of a stream all want the segment that was just written: with the cache,
    one write feeds any number of them without a storage request, and data already
    read stays readable while the object store is down. What it holds is bounded in
    bytes: each value's `len`, or the size its `put` names (a segment's index).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self._objects: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()

    def get(self, key: Hashable) -> V | None:
        entry = self._objects.get(key)
        if entry is None:
            return None
        self._objects.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, value: V, size: int | None = None) -> None:
        size = len(value) if size is None else size  # type: ignore[arg-type]
        if size > self.capacity_bytes // 8 or key in self._objects:
            return
        self._objects[key] = (value, size)
        self.size_bytes += size
        while self.size_bytes > self.capacity_bytes:
            _, (_, evicted) = self._objects.popitem(last=False)
            self.size_bytes -= evicted


class ObjectStore:
    """Create-only objects under one root of an fsspec filesystem.

    Keys are '/'-separated relative names; the store never lets a key leave the root
    because the stream store builds every key from encoded names it made itself.
    """

    def __init__(self, url: str) -> None:
        options = {}
        if url.startswith(("s3://", "s3a://")):
            options = {**S3_DEFAULTS, **fsspec.config.conf.get("s3", {})}
        filesystem, root = fsspec.core.url_to_fs(url, **options)
        if options:
            filesystem.retries = S3_RETRIES  # s3fs's own retry loop, on top of botocore's
        self.filesystem = filesystem
        self.is_local = isinstance(filesystem, LocalFileSystem)
        self.root = root.rstrip("/")
        if self.is_local:
            self.root = os.path.abspath(self.root)
            os.makedirs(self.root, exist_ok=True)
        self._call: Callable[..., object] = _run_here if self.is_local else run_in_threadpool
        self._batched_creates = (
            localdisk.BatchedCreates(run_in_threadpool)
            if self.is_local and localdisk.CAN_SYNC_FILESYSTEM
            else None
        )

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _guarded(self, function: Callable[..., T], *args: object, **kwargs: object) -> T:
        try:
            return self._call(function, *args, **kwargs)  # type: ignore[return-value]
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as error:
            raise StorageUnavailable(str(error)) from error
        except Exception as error:  # the backend's own exception types (botocore, aiohttp)
            raise StorageUnavailable(f"{type(error).__name__}: {error}") from error

    # -- writes ---------------------------------------------------------------------

    def create(self, key: str, data: bytes, *, verified_on_load: bool = False) -> None:
        """Write a new object; `FileExistsError` if the key already exists.

        When this returns the object is durable: synced with its directory on local
        disk (fsyncs, or a batch's syncfs calls), acknowledged by the object store
        otherwise. `verified_on_load` says its loader checks it whole and drops it
        when torn: on local disk it may then be published before its data is synced
        (localdisk.py), and readers take it in through `make_durable`.
        """
        if self._batched_creates is not None:
            self._guarded(
                self._batched_creates.create,
                self.path(key),
                data,
                verified_on_load=verified_on_load,
            )
        elif self.is_local:
            # fsync blocks for a while: off the event loop, writes to many streams overlap.
            self._guarded(run_in_threadpool, localdisk.create_durably, self.path(key), data)
        else:
            self._guarded(self.filesystem.pipe_file, self.path(key), data, mode="create")

    def delete_tree(self, prefix: str) -> None:
        """Remove every object under `prefix`; missing objects are not an error."""
        try:
            self._guarded(self.filesystem.rm, self.path(prefix), recursive=True)
        except FileNotFoundError:
            pass

    def delete(self, key: str) -> None:
        """Remove one object; durable on local disk when this returns."""
        if self.is_local:
            self._guarded(_unlink_durably, self.path(key))
        else:
            self._guarded(self.filesystem.rm_file, self.path(key))

    def delete_many(self, keys: list[str]) -> None:
        """Remove several objects (batched on S3); missing ones are not an error."""
        if self.is_local:
            for key in keys:
                try:
                    os.unlink(self.path(key))
                except FileNotFoundError:
                    pass
            return
        try:
            self._guarded(self.filesystem.rm, [self.path(key) for key in keys])
        except FileNotFoundError:
            pass

    def touch(self, key: str) -> None:
        """Record "used now" on a marker object (sliding TTL), creating it if needed."""
        if self.is_local:
            self._guarded(_touch_local, self.path(key))
        else:
            self._guarded(self.filesystem.pipe_file, self.path(key), b"")

    # -- reads ----------------------------------------------------------------------

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of an object; `FileNotFoundError` if it does not exist."""
        if self.is_local:
            return self._guarded(_read_local, self.path(key), start, end)
        return self._guarded(_read_remote, self.filesystem, self.path(key), start, end)

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        """Stream `length` bytes from `start` in bounded chunks (memory stays flat)."""
        position, remaining = start, length
        while remaining > 0:
            size = min(READ_CHUNK_BYTES, remaining)
            chunk = self.read(key, position, position + size)
            if not chunk:
                raise StorageUnavailable(f"object {key} is shorter than its index says")
            yield chunk
            position += len(chunk)
            remaining -= len(chunk)

    def modified(self, key: str) -> float | None:
        """Modification time in seconds since the epoch, or None if absent."""
        if self.is_local:
            try:
                return os.stat(self.path(key)).st_mtime
            except FileNotFoundError:
                return None
        head = self._head(key)
        modified = head and (head.get("LastModified") or head.get("mtime"))
        return modified.timestamp() if hasattr(modified, "timestamp") else modified

    def identity(self, key: str) -> object | None:
        """A token that changes whenever the object at `key` is replaced; None if absent."""
        if self.is_local:
            try:
                status = os.stat(self.path(key))
            except FileNotFoundError:
                return None
            return (status.st_ino, status.st_mtime_ns)
        head = self._head(key)
        return head and (head.get("ETag") or head.get("mtime"))

    def _head(self, key: str) -> dict[str, object] | None:
        """One HEAD on S3 (s3fs's info() adds a LIST when the object is missing)."""
        filesystem = self.filesystem
        try:
            if hasattr(filesystem, "call_s3"):
                bucket, path, _ = filesystem.split_path(self.path(key))
                return self._guarded(filesystem.call_s3, "head_object", Bucket=bucket, Key=path)
            return self._guarded(filesystem.info, self.path(key), refresh=True)
        except FileNotFoundError:
            return None

    def may_exist(self, key: str) -> bool:
        """False only when `key` surely does not exist; never a request to storage.

        On local disk a stat: a stream with a waiting reader looks for its next segment
        twenty times a second, and with a failing measured read for each look, 1,000
        waiting long-polls kept the worker 85 % busy (35 % with the stat). Elsewhere
        True: the read that follows is the check, one request either way.
        """
        if not self.is_local:
            return True
        try:
            os.stat(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:  # a failing disk: the read that follows meets it and reports it
            pass
        return True

    def make_durable(self, key: str) -> None:
        """Make sure an object that exists survives a crash of this machine.

        On local disk another process may have linked it into place but not yet synced
        it (localdisk.py syncs after the link): a reader that served it then could see
        it taken back by a crash, and its offsets reused. Elsewhere an object is
        durable once it exists.
        """
        if self.is_local:
            directory = os.path.dirname(self.path(key))
            self._guarded(run_in_threadpool, localdisk.sync_published, directory)

    def make_directory(self, prefix: str) -> None:
        """On local disk, the directory for objects under `prefix`, before the first one.

        A directory can be watched (`watch_creates`) only once it exists. Object stores
        have no directories: nothing to do there.
        """
        if self.is_local:
            self._guarded(run_in_threadpool, localdisk.make_durable_directories, self.path(prefix))

    def watch_creates(self, prefix: str, on_create: OnCreate) -> Cancel | None:
        """Call `on_create(name)` when any process adds an object directly under `prefix`.

        Local disk only (see dirwatch.py): None elsewhere, or when no watch could be
        added; the caller then polls. The returned call stops the watch.
        """
        if not self.is_local:
            return None
        return dirwatch.watcher.watch_creates(self.path(prefix), on_create)

    def exists(self, key: str) -> bool:
        if self.is_local:
            return os.path.exists(self.path(key))
        return self.identity(key) is not None

    def list(self, prefix: str) -> list[str]:
        """Names directly under `prefix` (no recursion); empty if there are none."""
        if self.is_local:
            try:
                return [name for name in os.listdir(self.path(prefix)) if not name.startswith(".")]
            except (FileNotFoundError, NotADirectoryError):
                return []
        try:
            entries = self._guarded(
                self.filesystem.ls, self.path(prefix), detail=False, refresh=True
            )
        except FileNotFoundError:
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def list_after(self, prefix: str, after: str) -> list[str]:
        """Names directly under `prefix` that sort after `after`, in order.

        On S3 the listing starts there (StartAfter): its cost does not grow with the
        names before it.
        """
        filesystem = self.filesystem
        if not hasattr(filesystem, "call_s3"):
            return sorted(name for name in self.list(prefix) if name > after)
        bucket, folder, _ = filesystem.split_path(self.path(prefix))
        request = {"Bucket": bucket, "Prefix": f"{folder}/", "StartAfter": f"{folder}/{after}"}
        names: list[str] = []
        while True:
            page = self._guarded(filesystem.call_s3, "list_objects_v2", Delimiter="/", **request)
            names += [entry["Key"].rsplit("/", 1)[-1] for entry in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return names
            request["ContinuationToken"] = page["NextContinuationToken"]


def _read_local(path: str, start: int, end: int | None) -> bytes:
    with open(path, "rb") as file:
        file.seek(start)
        return file.read() if end is None else file.read(end - start)


def _read_remote(filesystem: object, path: str, start: int, end: int | None) -> bytes:
    """A ranged GET; a range past the end (416 on some S3s) reads what there is."""
    try:
        return filesystem.cat_file(path, start=start, end=end)
    except OSError as error:
        if "range" not in str(error).lower():
            raise
        return filesystem.cat_file(path)[start:end]


def _touch_local(path: str) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        localdisk.make_durable_directories(os.path.dirname(path))
        open(path, "ab").close()


def _unlink_durably(path: str) -> None:
    os.unlink(path)
    localdisk.fsync_directory(os.path.dirname(path))
