"""Hear at once when any process adds a file to a local directory (Linux inotify).

A reader waiting at a stream's tail on local disk learns of other processes' appends by
looking for the next segment. Looking every 50 ms woke a reader on another gunicorn
worker tens of milliseconds late, and kept a worker a third busy with 1,000 waiting
long-polls while nothing was appended (bench/README.md, "The store's figures"). An inotify
watch on the stream's segment directory says when to look instead, and costs nothing
while nothing happens.

An event is only a reason to look: the caller still reads storage, which stays the
only truth, and still looks now and then without one. inotify sees changes made by
this machine's kernel only, not by other machines sharing a network filesystem.
Watches are limited per user (fs.inotify.max_user_watches); when one cannot be added
`watch_creates` returns None and the caller polls as it would without inotify.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
from collections.abc import Callable

import gevent
from gevent.socket import wait_read

log = logging.getLogger("picomq.dirwatch")

_LIBC = ctypes.CDLL(None, use_errno=True)
_CAN_WATCH = hasattr(_LIBC, "inotify_init1")  # Linux only

IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000  # the watch is gone: removed, or its directory deleted
IN_ONLYDIR = 0x01000000
EVENT_HEADER = struct.Struct("iIII")  # watch descriptor, mask, cookie, length of the name
READ_BYTES = 64 * 1024

OnCreate = Callable[[str], None]  # called with the new entry's name ("" after an overflow)
Cancel = Callable[[], None]


class DirectoryWatcher:
    """One inotify descriptor per process, read by one greenlet; callbacks per directory.

    Callbacks run in that greenlet and must not block: they should only wake someone.
    """

    def __init__(self) -> None:
        self._opened = False
        self._descriptor: int | None = None
        self._callbacks: dict[int, dict[object, OnCreate]] = {}  # watch descriptor → callbacks
        self._warned = False

    def watch_creates(self, directory: str, on_create: OnCreate) -> Cancel | None:
        """Call `on_create(name)` for each entry created in (or moved into) `directory`.

        Returns the call that stops it, or None when no watch could be added (not Linux,
        no such directory, the watch limit reached).
        """
        descriptor = self._open()
        if descriptor is None:
            return None
        watch = _LIBC.inotify_add_watch(
            descriptor, os.fsencode(directory), IN_CREATE | IN_MOVED_TO | IN_ONLYDIR
        )
        if watch < 0:
            error = ctypes.get_errno()
            if error != errno.ENOENT and not self._warned:  # e.g. ENOSPC: the watch limit
                self._warned = True
                log.warning("no inotify watch on %s (%s): polling", directory, os.strerror(error))
            return None
        token = object()
        self._callbacks.setdefault(watch, {})[token] = on_create

        def cancel() -> None:
            callbacks = self._callbacks.get(watch)
            if callbacks is None or callbacks.pop(token, None) is None or callbacks:
                return  # the directory went away, cancelled already, or others still watch
            del self._callbacks[watch]
            _LIBC.inotify_rm_watch(descriptor, watch)

        return cancel

    def _open(self) -> int | None:
        """The descriptor, opened on first use: in a gunicorn worker, never in the master."""
        if self._opened:
            return self._descriptor
        self._opened = True
        if not _CAN_WATCH:
            return None
        descriptor = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if descriptor < 0:
            log.warning("inotify unavailable: %s", os.strerror(ctypes.get_errno()))
            return None
        self._descriptor = descriptor
        gevent.spawn(self._read_events, descriptor)
        return descriptor

    def _read_events(self, descriptor: int) -> None:
        while True:
            wait_read(descriptor)
            try:
                data = os.read(descriptor, READ_BYTES)
            except BlockingIOError:
                continue
            for watch, mask, name in parse_events(data):
                self._dispatch(watch, mask, name)

    def _dispatch(self, watch: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:  # events were lost: everyone looks
            targets = [cb for callbacks in self._callbacks.values() for cb in callbacks.values()]
            name = ""
        elif mask & IN_IGNORED:  # the directory is gone (or the watch cancelled): look
            targets = list(self._callbacks.pop(watch, {}).values())
            name = ""
        else:
            targets = list(self._callbacks.get(watch, {}).values())
        for on_create in targets:
            try:
                on_create(name)
            except Exception:
                log.exception("a directory watch callback failed")


def parse_events(data: bytes) -> list[tuple[int, int, str]]:
    """(watch descriptor, mask, name) of each `struct inotify_event` in `data`."""
    events, position = [], 0
    while position + EVENT_HEADER.size <= len(data):
        watch, mask, _, length = EVENT_HEADER.unpack_from(data, position)
        position += EVENT_HEADER.size
        name = data[position : position + length].rstrip(b"\0")
        position += length
        events.append((watch, mask, os.fsdecode(name)))
    return events


watcher = DirectoryWatcher()
