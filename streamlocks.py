"""Turns between the processes of one machine that append to the same stream.

Create-only segments keep several writers of one stream correct, not fair. The process
that has just committed plans its next batch at the true tail at once; one that lost a
create must first read what the winner wrote, and by then the winner has written again.
Two gunicorn workers on one hot stream starved each other: appends waited a second at
the 99th percentile on local disk, and on S3 some answered 503 after losing for
CONTENTION_LIMIT_SECONDS; taking turns ended both (bench/README.md, "The store's
figures").

So each commit holds its stream's lock. A process waiting for it is woken by the kernel
when it is released, before the holder is back with its next batch, and the processes
alternate. The locks are open file description locks (`F_OFD_SETLKW`, Linux 3.15) on
one byte each of a single file per storage root, at an offset hashed from the stream's
key: no file per stream, and a lock goes with its descriptor, also when its process
dies. Writers on other machines are not covered: they still take turns only by losing
creates, which keeps them correct.

Whoever can open the file can hold a lock in it, and a held lock stops the stream's
commits. So the file is where only PicoMQ's user can write (the data directory itself,
or a private directory of this machine for object stores), is never opened through a
symbolic link, and is used only if it is a file of ours that no one else may open.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from gevent.threadpool import ThreadPool

log = logging.getLogger("picomq.streamlocks")

# Threads a process may have blocked in lock waits; later waits queue for one. Apart
# from the storage calls' pool: waits filling that pool in two workers at once could
# each block the commits the other waits for.
WAITING_THREADS = 16
FLOCK_FORMAT = "hhqqi4x"  # struct flock: type, whence, start, length, pid (0 for OFD locks)
UNAVAILABLE = "writers on this machine will not take turns on %s: %s"
LOCAL_LOCK_FILE = ".writers.lock"  # hidden: a listing of the data directory skips it
OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class StreamLocks:
    """One lock per stream, shared by every process on this machine with the same root."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._waiting: ThreadPool | None = None  # made by the first wait: after the fork

    @classmethod
    def for_storage(cls, root: str, is_local: bool) -> StreamLocks | None:
        """Locks in the data directory on local disk; for an object store, in this
        user's private directory (`private_directory`), named by a hash of the root.

        None, with a warning, where that file cannot be made or is not safe to use: the
        server still starts, its writers racing as nodes do.
        """
        try:
            if is_local:
                path = os.path.join(root, LOCAL_LOCK_FILE)
            else:
                digest = hashlib.sha256(root.encode()).hexdigest()[:16]
                path = os.path.join(private_directory(), f"writers-{digest}.lock")
            locks = cls(path)
            descriptor = locks._open()
            try:  # a filesystem that cannot lock says so now, not at every commit
                fcntl.fcntl(descriptor, fcntl.F_OFD_GETLK, lock_request(root))
            finally:
                os.close(descriptor)
        except OSError as error:
            log.warning(UNAVAILABLE, root, error)
            return None
        return locks

    @contextmanager
    def held(self, key: str) -> Iterator[bool]:
        """Hold `key`'s lock for the block; it gets True if another process held it first.

        A lock that cannot be had for any reason but another holder is skipped with a
        warning: the creates, not the lock, keep the stream correct.
        """
        try:
            descriptor, waited = self._acquire(key)
        except OSError as error:
            log.warning(UNAVAILABLE, key, error)
            descriptor, waited = None, False
        try:
            yield waited
        finally:
            if descriptor is not None:
                os.close(descriptor)  # releases the lock

    def _open(self) -> int:
        """The lock file, made 0600 if missing; OSError if the path is a symbolic link
        (ELOOP) or the file is not ours alone."""
        descriptor = os.open(self.path, OPEN_FLAGS, 0o600)
        try:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode) or not is_private(status):
                raise PermissionError(f"{self.path} is not a file that only this user may open")
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor

    def _acquire(self, key: str) -> tuple[int, bool]:
        """A descriptor that holds `key`'s lock, and whether we waited for it."""
        descriptor = self._open()
        request = lock_request(key)
        try:
            fcntl.fcntl(descriptor, fcntl.F_OFD_SETLK, request)
            return descriptor, False
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(descriptor)
                raise
        except BaseException:
            os.close(descriptor)
            raise
        self._wait(descriptor, request)
        return descriptor, True

    def _wait(self, descriptor: int, request: bytes) -> None:
        """Block a thread, not the event loop, until the holder lets go; the descriptor
        is closed here if the wait fails."""
        if self._waiting is None:
            self._waiting = ThreadPool(WAITING_THREADS)
        try:
            waiting = self._waiting.spawn(wait_for_lock, descriptor, request)
        except BaseException:
            os.close(descriptor)
            raise
        try:
            error = waiting.get()
        except BaseException:
            # Killed while the thread waits: the descriptor must outlive the thread's
            # call (its number could be reused meanwhile); closing it then lets go.
            waiting.rawlink(lambda _: os.close(descriptor))
            raise
        if error is not None:
            os.close(descriptor)
            raise error


def private_directory() -> str:
    """`picomq-<uid>` in the temporary directory, made 0700 if missing.

    The temporary directory is shared: another user may have made that directory
    first, or put a symbolic link there. OSError unless it is a directory (not a link)
    of this user that no one else may enter.
    """
    path = os.path.join(tempfile.gettempdir(), f"picomq-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    status = os.lstat(path)
    if not stat.S_ISDIR(status.st_mode) or not is_private(status):
        raise PermissionError(f"{path} is not a directory that only this user may use")
    return path


def is_private(status: os.stat_result) -> bool:
    """Owned by this process's user, with no permission for anyone else."""
    return status.st_uid == os.geteuid() and status.st_mode & 0o077 == 0


def lock_request(key: str) -> bytes:
    """A write lock on the one byte of `key`: 62 bits of hash, so collisions are moot."""
    offset = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest()) >> 2
    return struct.pack(FLOCK_FORMAT, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)


def wait_for_lock(descriptor: int, request: bytes) -> OSError | None:
    """Runs in a thread; the error comes back as a value, not as a printed traceback."""
    try:
        fcntl.fcntl(descriptor, fcntl.F_OFD_SETLKW, request)
    except OSError as error:
        return error
    return None
