"""Local disk as the store's backend (`LocalDisk`), and its durable create-only writes.

fsspec's local create-only write is check-then-write, not atomic, and fsspec never
fsyncs. So local disk writes a temporary file and `os.link`s it into place: the link
is the atomic create-only step, and no reader ever sees a half-written object (nor,
for objects their loader verifies, a temporary name: on Linux their file has none
until it is linked, see `_publish`). Data and link are durable before the create
returns.

For most objects the data is made durable before the link publishes it, two ways:
- `create_durably`, one object at a time: fsync the file, link, fsync the directory.
  Any POSIX system.
- `BatchedCreates`, on Linux: creates that arrive together write all their temporary
  files, share one syncfs(2), link, and share a second. Linux documents syncfs as
  giving the guarantees of an fsync of every file on the filesystem. Appends to
  different streams cannot share a segment, but this way their segments share the
  syncs: every fsync writes its inode and flushes the device cache on its own, and
  with 1,000 streams taking appends at once those fsyncs, with the thread switches
  around them, were most of an append's cost (bench/README.md, "The store's figures").
  A syncfs also writes whatever else is dirty on that filesystem, so a data directory
  that shares its filesystem with heavy writers waits for their data too.

An object its loader verifies whole (a segment: length and checksums, dropped as torn
when they fail) may skip the sync before its link: written, linked, then one syncfs
makes data and link durable together, half the syncs of a live append. Until that
syncfs returns, a crash may leave the linked file torn; it was never acknowledged,
and no other process serves it before `sync_published` has made it durable.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import gevent
from gevent.event import AsyncResult

import dirwatch
from dirwatch import Cancel, OnCreate
from objectstore import ObjectStore, run_here, run_in_threadpool

_LIBC = ctypes.CDLL(None, use_errno=True)
_SYNCFS = getattr(_LIBC, "syncfs", None)  # Linux only
CAN_SYNC_FILESYSTEM = _SYNCFS is not None
# Linux makes a file without a name (O_TMPFILE) and links it later through /proc.
_LINKAT = getattr(_LIBC, "linkat", None)
CAN_LINK_UNNAMED = (
    hasattr(os, "O_TMPFILE") and _LINKAT is not None and os.path.isdir("/proc/self/fd")
)
AT_FDCWD = -100
AT_SYMLINK_FOLLOW = 0x400
# What opening an unnamed file fails with where a named temporary file must be made:
# the filesystem or kernel has none (EOPNOTSUPP, EISDIR), or the directory was removed
# after its lookup, which ext4 answers with EPERM where a named create says ENOENT.
NAMED_FILE_INSTEAD = (errno.EOPNOTSUPP, errno.EISDIR, errno.EPERM)
# What link(2) fails with where the two names cannot share a file: another filesystem
# under the root, or one without hard links.
COPY_INSTEAD = (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP)

# A process idle this long, using less than this share of a core meanwhile, has no
# one queued for its event loop: see BatchedCreates.
IDLE_SECONDS = 0.002
BUSY_FRACTION = 0.5

Outcome = OSError | None  # one per object of a batch: None when it was created


class Create(NamedTuple):
    """One object to create; `verified_on_load` as the module's docstring says."""

    path: str
    data: bytes
    verified_on_load: bool = False


def create_durably(path: str, data: bytes) -> None:
    """Create one object durably with fsyncs; `FileExistsError` if `path` exists."""
    temporary, descriptor = _write_temporary(path, data, fsync=True)
    os.close(descriptor)
    _link_into_place(temporary, path)
    fsync_directory(os.path.dirname(path))


def publish_then_sync(path: str, data: bytes) -> None:
    """Create one object its loader verifies: write, link, then one syncfs for both."""
    descriptor = _publish(path, data)
    try:
        _sync_filesystems([descriptor])
    finally:
        os.close(descriptor)


def link_file(source: str, path: str) -> None:
    """Name the file at `source` again at `path`; `FileExistsError` if taken. The new
    name is durable once its directory is synced (`LocalDisk.link`). Where the two
    cannot share a file, a durable copy."""
    directory = os.path.dirname(path)
    make_durable_directories(directory)
    try:
        os.link(source, path)
    except OSError as error:
        if error.errno not in COPY_INSTEAD:
            raise
        create_durably(path, _read(source, 0, None))


def create_many(objects: list[Create]) -> list[Outcome]:
    """Create each object durably, all sharing the syncs of their filesystems.

    Each object fails or succeeds alone: one that exists already gets its
    `FileExistsError` while the others are created. A lone object that needs its data
    synced before its link takes the fsyncs instead: they write only its file and
    directory, where a syncfs would also write everything else dirty on the filesystem.
    """
    if len(objects) == 1:
        lone = objects[0]
        try:
            if lone.verified_on_load:
                publish_then_sync(lone.path, lone.data)
            else:
                create_durably(lone.path, lone.data)
        except OSError as error:
            return [error]
        return [None]
    # syncfs takes any descriptor on the filesystem. One of a temporary file this batch
    # wrote stays valid until closed; a directory's path would not: another stream's
    # delete may remove it mid-batch, and every create in the batch would fail with it.
    filesystems: dict[int, int] = {}  # device → an open descriptor on it
    try:
        return _create_sharing_syncs(objects, filesystems)
    finally:
        for descriptor in filesystems.values():
            os.close(descriptor)


def _create_sharing_syncs(objects: list[Create], filesystems: dict[int, int]) -> list[Outcome]:
    """Objects the loader verifies are linked as soon as written; the others once the
    first syncfs has made their data durable. A second syncfs makes all the links."""
    outcomes: list[Outcome] = [None] * len(objects)
    written: list[int] = []
    unlinked: list[tuple[int, str, str]] = []  # (number, temporary path, path)
    for number, (path, data, verified_on_load) in enumerate(objects):
        try:
            if verified_on_load:
                descriptor = _publish(path, data)
            else:
                temporary, descriptor = _write_temporary(path, data, fsync=False)
                unlinked.append((number, temporary, path))
        except OSError as error:
            outcomes[number] = error
            continue
        written.append(number)
        device = os.fstat(descriptor).st_dev
        if device in filesystems:
            os.close(descriptor)
        else:
            filesystems[device] = descriptor
    try:
        if unlinked:
            _sync_filesystems(filesystems.values())  # their data, before a link publishes it
    except OSError as error:
        for _, temporary, _ in unlinked:
            _remove_quietly(temporary)
        for number in written:
            outcomes[number] = error
        return outcomes
    for number, temporary, path in unlinked:
        try:
            _link_into_place(temporary, path)
        except OSError as error:
            outcomes[number] = error
    try:
        _sync_filesystems(filesystems.values())  # the links (and, for verified objects, data)
    except OSError as error:
        for number in written:
            outcomes[number] = outcomes[number] or error
    return outcomes


class BatchedCreates:
    """Group commit for the filesystem: one batch of creates in flight at a time.

    Creates that arrive while a batch is being written form the next one, so the
    number of syncs follows the disk's speed, not the number of creates. The first
    create to find no batch in flight writes one itself: handing it to another
    greenlet would add a turn of the event loop to every lone create. Only creates that
    had to wait are written by a greenlet of their own.

    The blocking work runs through `run_blocking` (the thread pool), off the event
    loop: requests are read and answered while the disk syncs, and the creates they
    bring form the next batch. Only a batch that finds the process idle runs on the
    caller's thread: no batch finished for `idle_seconds`, and the process used
    less than half of a core since the last one. Then nothing is queued to use the
    sync's time, and the trip to the pool and back is a sixth of a lone create's
    latency. The event loop stands still for that create; requests that come
    meanwhile then find the disk busy and use the pool. Always inline, no create could
    join another's batch, and appends over many streams ran at a quarter of the rate.
    """

    def __init__(
        self, run_blocking: Callable[..., Any], idle_seconds: float = IDLE_SECONDS
    ) -> None:
        self.run_blocking = run_blocking
        self.idle_seconds = idle_seconds
        self.waiting: list[tuple[Create, AsyncResult]] = []
        self.writing = False
        self.finished_at = -math.inf  # when the last batch's syncs returned (time.monotonic)
        self.cpu_at_finish = 0.0  # the process's CPU time then (time.process_time)

    def create(self, path: str, data: bytes, *, verified_on_load: bool = False) -> None:
        """Create one object durably; `FileExistsError` if `path` exists."""
        done = AsyncResult()
        self.waiting.append((Create(path, data, verified_on_load), done))
        if not self.writing:
            self.writing = True
            self._write_and_hand_on()
        done.get()

    def _write_and_hand_on(self) -> None:
        try:
            self._write_batch()
        finally:
            if self.waiting:
                gevent.spawn(self._write_and_hand_on)
            else:
                self.writing = False

    def _write_batch(self) -> None:
        batch, self.waiting = self.waiting, []
        objects = [create for create, _ in batch]
        try:
            if self._idle():
                outcomes = create_many(objects)
            else:
                outcomes = self.run_blocking(create_many, objects)
        except Exception as error:  # not an OSError of one object: fail them all
            outcomes = [error] * len(batch)
        except BaseException:  # the writing greenlet was killed: its batch must not hang
            interrupted = OSError("a batch of creates was interrupted; its objects may exist")
            for _, done in batch:
                done.set_exception(interrupted)
            raise
        finally:
            self.finished_at, self.cpu_at_finish = time.monotonic(), time.process_time()
        for (_, done), outcome in zip(batch, outcomes, strict=True):
            if outcome is None:
                done.set(None)
            else:
                done.set_exception(outcome)

    def _idle(self) -> bool:
        since = time.monotonic() - self.finished_at
        if since < self.idle_seconds:
            return False
        return time.process_time() - self.cpu_at_finish < BUSY_FRACTION * since


def _write_temporary(path: str, data: bytes, *, fsync: bool) -> tuple[str, int]:
    """A new temporary file beside `path` holding `data`: its path, and a descriptor of
    it still open (the caller closes it)."""
    directory = os.path.dirname(path)
    make_durable_directories(directory)
    temporary = f"{directory}/.tmp-{uuid.uuid4().hex}"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(descriptor, data)
        if fsync:
            os.fsync(descriptor)
        return temporary, descriptor
    except OSError:
        os.close(descriptor)
        _remove_quietly(temporary)
        raise


def _publish(path: str, data: bytes) -> int:
    """Write an object its loader verifies and link it at `path`, nothing synced yet;
    returns a descriptor of its file, still open (the caller closes it).

    Where the filesystem allows, the file is made without a name and linked once
    written: no temporary name is created and removed, and the sync has less to write
    (the figures: bench/README.md). A crash leaves no temporary file behind. Elsewhere
    a named temporary file; and where the directory was just removed (a stream deleted
    under its append), the named file's create answers as it always did:
    FileNotFoundError, which the store turns into a 404.
    """
    if CAN_LINK_UNNAMED:
        directory = os.path.dirname(path)
        make_durable_directories(directory)
        try:
            descriptor = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o644)
        except OSError as error:
            if error.errno not in NAMED_FILE_INSTEAD:
                raise
        else:
            try:
                write_all(descriptor, data)
                _link_unnamed(descriptor, path)
            except BaseException:
                os.close(descriptor)
                raise
            return descriptor
    temporary, descriptor = _write_temporary(path, data, fsync=False)
    try:
        _link_into_place(temporary, path)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _link_unnamed(descriptor: int, path: str) -> None:
    """Give the unnamed file open as `descriptor` its name; `FileExistsError` if taken.

    os.link cannot: it calls link(2), which does not follow /proc's link to the file."""
    source = f"/proc/self/fd/{descriptor}".encode()
    if _LINKAT(AT_FDCWD, source, AT_FDCWD, os.fsencode(path), AT_SYMLINK_FOLLOW) != 0:
        raise _last_error(path)


def _link_into_place(temporary: str, path: str) -> None:
    try:
        os.link(temporary, path)  # the link, not the write, publishes the object
    finally:
        os.unlink(temporary)


def _sync_filesystems(descriptors: Iterable[int]) -> None:
    for descriptor in descriptors:
        _sync_filesystem(descriptor)


def _sync_filesystem(descriptor: int) -> None:
    if _SYNCFS(descriptor) != 0:
        raise _last_error()


def _last_error(path: str | None = None) -> OSError:
    """The error of the libc call that just failed, as os would raise it (an
    OSError subclass by errno: FileExistsError, FileNotFoundError, ...)."""
    number = ctypes.get_errno()
    return OSError(number, os.strerror(number), path)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]


def make_durable_directories(directory: str) -> None:
    """Create missing directories and fsync each parent so the new entries survive a crash."""
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(directory)
    make_durable_directories(parent)
    try:
        os.mkdir(directory)
    except FileExistsError:
        return
    fsync_directory(parent)


def sync_published(directory: str) -> None:
    """Make durable an object another process published in `directory`, before serving it.

    Its data may not be on disk yet (`publish_then_sync`): a syncfs writes it and the
    link. Without syncfs every create synced its data before the link, and syncing the
    directory is enough.
    """
    _sync_through(directory, _sync_filesystem if CAN_SYNC_FILESYSTEM else os.fsync)


def fsync_directory(directory: str) -> None:
    _sync_through(directory, os.fsync)


def _sync_through(directory: str, sync: Callable[[int], None]) -> None:
    """Call `sync` on a descriptor of `directory`, opened for it alone."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        sync(descriptor)
    finally:
        os.close(descriptor)


class LocalDisk(ObjectStore):
    """Objects as files under a directory: created by a link, synced before answering.

    Calls run in this thread, as they are quick, except those that sync (off the event
    loop, so writes to many streams overlap). Files can be watched (dirwatch.py), and
    a stat is cheap enough to look before every read.
    """

    is_local = True
    links_cheaply = True

    def __init__(self, root: str) -> None:
        super().__init__(run_here)
        self.root = os.path.abspath(root.rstrip("/") or "/")
        os.makedirs(self.root, exist_ok=True)
        self._batched = BatchedCreates(run_in_threadpool) if CAN_SYNC_FILESYSTEM else None

    def create(self, key: str, data: bytes, *, verified_on_load: bool = False) -> None:
        """Durable when this returns: synced with its directory (fsyncs, or the syncfs
        calls of the batch it joined); see the module's docstring."""
        if self._batched is not None:
            self._guarded(
                self._batched.create, self.path(key), data, verified_on_load=verified_on_load
            )
        else:
            self._guarded(run_in_threadpool, create_durably, self.path(key), data)

    def link(self, source: str, key: str) -> None:
        """A hard link: the data is not written again, and the name waits for
        `make_durable`, so that the links of one folder share a sync."""
        self._guarded(link_file, self.path(source), self.path(key))

    def delete(self, key: str) -> None:
        self._guarded(_unlink_durably, self.path(key))

    def delete_many(self, keys: list[str]) -> None:
        """On the thread pool: a round of rewrites frees thousands of log objects at once,
        and unlinking them on the hub's thread held up every request of the worker
        (bench/README.md, "Rewrites over many streams")."""
        self._guarded(run_in_threadpool, _unlink_all, [self.path(key) for key in keys])

    def _remove_tree(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)

    def touch(self, key: str) -> None:
        self._guarded(_touch, self.path(key))

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self._guarded(_read, self.path(key), start, end)

    def modified(self, key: str) -> float | None:
        try:
            return os.stat(self.path(key)).st_mtime
        except FileNotFoundError:
            return None

    def identity(self, key: str) -> object | None:
        try:
            status = os.stat(self.path(key))
        except FileNotFoundError:
            return None
        return (status.st_ino, status.st_mtime_ns)

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def may_exist(self, key: str) -> bool:
        """A stat: a stream with a waiting reader looks for its next segment twenty times
        a second, and a failing read for each look cost far more than a stat."""
        try:
            os.stat(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:  # a failing disk: the read that follows meets it and reports it
            pass
        return True

    def make_durable(self, key: str) -> None:
        """Another process may have linked the file but not yet synced it (see
        `publish_then_sync`): a reader that served it could see it taken back by a
        crash, and its offsets reused."""
        directory = os.path.dirname(self.path(key))
        self._guarded(run_in_threadpool, sync_published, directory)

    def make_directory(self, prefix: str) -> None:
        """A directory can be watched (`watch_creates`) only once it exists."""
        self._guarded(run_in_threadpool, make_durable_directories, self.path(prefix))

    def watch_creates(self, prefix: str, on_create: OnCreate) -> Cancel | None:
        return dirwatch.watcher.watch_creates(self.path(prefix), on_create)

    def list_tree(self, prefix: str) -> list[str]:
        top = self.path(prefix)
        return [
            os.path.relpath(os.path.join(folder, name), top)
            for folder, _, names in os.walk(top)
            for name in names
            if not name.startswith(".")
        ]

    def list(self, prefix: str) -> list[str]:
        """Hidden names (temporary files, the writers' lock file) are no objects."""
        try:
            return [name for name in os.listdir(self.path(prefix)) if not name.startswith(".")]
        except (FileNotFoundError, NotADirectoryError):
            return []


def _read(path: str, start: int, end: int | None) -> bytes:
    with open(path, "rb") as file:
        file.seek(start)
        return file.read() if end is None else file.read(end - start)


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        make_durable_directories(os.path.dirname(path))
        open(path, "ab").close()


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _unlink_durably(path: str) -> None:
    os.unlink(path)
    fsync_directory(os.path.dirname(path))
