"""The few storage verbs the stream store needs, and what all its backends share.

Every object the store writes is created exactly once and never rewritten, so the
only write primitive that must be exact is "create if absent". A backend is a class
per kind of storage, each over its own primitives: `LocalDisk` (localdisk.py: a file
linked into place, synced) and `Bucket` (buckets.py: any other fsspec filesystem, S3
and the like, a conditional PUT). `storage.open_objects` picks one for a URL.

Backend errors become Python built-ins here: `FileNotFoundError` for a missing
object, `FileExistsError` when a create-only write loses, `StorageUnavailable` for
anything else the backend raises.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from dirwatch import Cancel, OnCreate

T = TypeVar("T")
V = TypeVar("V")

READ_CHUNK_BYTES = 256 * 1024
THREADPOOL_SIZE = 64  # concurrent blocking storage calls per worker


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


def run_here(function: Callable[..., T], *args: object, **kwargs: object) -> T:
    return function(*args, **kwargs)


def read_or_create(objects: ObjectStore, key: str, make: Callable[[], bytes]) -> bytes:
    """Read an object that is made once (a key): the first writer wins, all read its bytes."""
    try:
        return objects.read(key)
    except FileNotFoundError:
        pass
    data = make()
    try:
        objects.create(key, data)
    except FileExistsError:
        return objects.read(key)
    return data


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


class ObjectStore(ABC):
    """Create-only objects under one root, named by '/'-separated relative keys.

    The store never lets a key leave the root: it builds every key from names it made
    itself. Each backend runs its blocking calls through `call`: in this thread, or in
    gevent's pool when the call would block the event loop for long.
    """

    root: str
    is_local: bool  # local disk: stats are cheap and files can be watched
    links_cheaply = False  # `link` names the stored bytes again rather than copying them

    def __init__(self, call: Callable[..., object]) -> None:
        self._call = call

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

    @abstractmethod
    def create(self, key: str, data: bytes, *, verified_on_load: bool = False) -> None:
        """Write a new object; `FileExistsError` if the key already exists.

        When this returns the object is durable. `verified_on_load` says its loader
        checks it whole and drops it when torn, which lets local disk publish it before
        its data is synced (localdisk.py); readers take it in through `make_durable`.
        """

    def link(self, source: str, key: str) -> None:
        """Create `key` holding what `source` holds (`FileExistsError` if it exists),
        durable once `make_durable(key)` returns. Only where `links_cheaply`: elsewhere
        it would cost what a create does, and nothing calls it."""
        raise NotImplementedError

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; durable on local disk when this returns."""

    @abstractmethod
    def delete_many(self, keys: list[str]) -> None:
        """Remove several objects; missing ones are not an error."""

    def delete_tree(self, prefix: str) -> None:
        """Remove every object under `prefix`; missing objects are not an error."""
        try:
            self._guarded(self._remove_tree, self.path(prefix))
        except FileNotFoundError:
            pass

    @abstractmethod
    def _remove_tree(self, path: str) -> None: ...

    @abstractmethod
    def touch(self, key: str) -> None:
        """Record "used now" on a marker object (sliding TTL), creating it if needed."""

    # -- reads ----------------------------------------------------------------------

    @abstractmethod
    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of an object; `FileNotFoundError` if it does not exist."""

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

    @abstractmethod
    def modified(self, key: str) -> float | None:
        """Modification time in seconds since the epoch, or None if absent."""

    @abstractmethod
    def identity(self, key: str) -> object | None:
        """A token that changes whenever the object at `key` is replaced; None if absent."""

    def exists(self, key: str) -> bool:
        return self.identity(key) is not None

    @abstractmethod
    def may_exist(self, key: str) -> bool:
        """False only when `key` surely does not exist; never a request to storage."""

    @abstractmethod
    def make_durable(self, key: str) -> None:
        """Make sure an object that exists survives a crash of this machine (see create)."""

    @abstractmethod
    def make_directory(self, prefix: str) -> None:
        """The directory for objects under `prefix`, before the first one, where there
        are directories (so it can be watched)."""

    def watch_creates(self, prefix: str, on_create: OnCreate) -> Cancel | None:
        """Call `on_create(name)` when any process adds an object directly under `prefix`;
        None where no watch can be added: the caller polls. The result stops the watch."""
        return None

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names directly under `prefix` (no recursion); empty if there are none."""

    def list_after(self, prefix: str, after: str) -> list[str]:
        """Names directly under `prefix` that sort after `after`, in order."""
        return sorted(name for name in self.list(prefix) if name > after)

    @abstractmethod
    def list_tree(self, prefix: str) -> list[str]:
        """Every object under `prefix`, at any depth, as keys relative to it."""
