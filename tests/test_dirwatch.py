"""dirwatch.py on this machine's kernel: real inotify watches, files made as PicoMQ makes them.

Each test waits for an event with a deadline; a watch that never calls back fails it.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import gevent
import pytest
from conftest import NEEDS_INOTIFY
from gevent.event import Event

import dirwatch
from dirwatch import IN_CREATE, IN_IGNORED, IN_Q_OVERFLOW, DirectoryWatcher, parse_events

pytestmark = NEEDS_INOTIFY

EVENT_TIMEOUT_SECONDS = 10.0


class Heard:
    """Collects the names a watch calls back with; `wait_for` a name with a deadline."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.changed = Event()

    def __call__(self, name: str) -> None:
        self.names.append(name)
        self.changed.set()

    def wait_for(self, name: str) -> None:
        with gevent.Timeout(EVENT_TIMEOUT_SECONDS, AssertionError(f"no event for {name}")):
            while name not in self.names:
                self.changed.clear()
                self.changed.wait()


def link_in_another_thread(directory: Path, name: str) -> None:
    """A temporary file linked into place, as localdisk does, from a thread (as a worker's pool)."""

    def link() -> None:
        temporary = directory / f".tmp-{name}"
        temporary.write_bytes(b"segment")
        os.link(temporary, directory / name)
        temporary.unlink()

    thread = threading.Thread(target=link)
    thread.start()
    thread.join()


def test_a_file_linked_into_a_watched_directory_is_heard_with_its_name(tmp_path: Path) -> None:
    heard = Heard()
    cancel = dirwatch.watcher.watch_creates(str(tmp_path), heard)
    assert cancel is not None
    link_in_another_thread(tmp_path, "00000000000000000042")
    heard.wait_for("00000000000000000042")
    assert heard.names[0] == ".tmp-00000000000000000042"  # the temporary file comes first
    cancel()


def test_two_watches_on_one_directory_each_hear_until_cancelled(tmp_path: Path) -> None:
    """inotify gives one descriptor per directory: cancelling one watch keeps the other."""
    watcher, first, second = dirwatch.watcher, Heard(), Heard()
    cancel_first = watcher.watch_creates(str(tmp_path), first)
    cancel_second = watcher.watch_creates(str(tmp_path), second)
    assert cancel_first is not None and cancel_second is not None
    link_in_another_thread(tmp_path, "a")
    first.wait_for("a")
    second.wait_for("a")
    cancel_first()
    cancel_first()  # a second cancel is harmless
    link_in_another_thread(tmp_path, "b")
    second.wait_for("b")
    assert "b" not in first.names
    cancel_second()


def test_a_watched_directory_removed_tells_its_watch_to_look(tmp_path: Path) -> None:
    """A stream deleted by another process takes its segment directory with it: the
    watch's readers are told to look (and find it deleted), and the watch is gone."""
    directory = tmp_path / "seg"
    directory.mkdir()
    heard = Heard()
    cancel = dirwatch.watcher.watch_creates(str(directory), heard)
    assert cancel is not None
    directory.rmdir()
    heard.wait_for("")
    cancel()  # harmless once the directory went


def test_no_watch_on_a_directory_that_does_not_exist(tmp_path: Path) -> None:
    assert dirwatch.watcher.watch_creates(str(tmp_path / "missing"), Heard()) is None


def test_a_watch_that_cannot_be_added_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Any reason but a missing directory (the watch limit, say) is worth a warning."""
    a_file = tmp_path / "not-a-directory"
    a_file.write_bytes(b"")
    watcher = DirectoryWatcher()
    with caplog.at_level("WARNING", logger="picomq.dirwatch"):
        assert watcher.watch_creates(str(a_file), Heard()) is None
        assert watcher.watch_creates(str(a_file), Heard()) is None
    assert len(caplog.records) == 1 and "polling" in caplog.records[0].getMessage()


def test_events_parse_with_their_padded_names() -> None:
    def event(watch: int, mask: int, name: bytes) -> bytes:
        padded = name.ljust((len(name) // 16 + 1) * 16, b"\0") if name else b""
        return struct.pack("iIII", watch, mask, 0, len(padded)) + padded

    data = event(3, IN_CREATE, b"seg-1") + event(-1, IN_Q_OVERFLOW, b"") + event(3, IN_IGNORED, b"")
    assert parse_events(data) == [
        (3, IN_CREATE, "seg-1"),
        (-1, IN_Q_OVERFLOW, ""),
        (3, IN_IGNORED, ""),
    ]


def test_after_lost_events_every_watch_is_told_to_look() -> None:
    watcher, first, second = DirectoryWatcher(), Heard(), Heard()  # no descriptor: fed by hand
    watcher._callbacks = {1: {object(): first}, 2: {object(): second}}
    watcher._dispatch(-1, IN_Q_OVERFLOW, "")
    assert (first.names, second.names) == ([""], [""])
