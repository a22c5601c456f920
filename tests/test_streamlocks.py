"""The per-stream locks that the processes of one machine share (streamlocks.py).

Another process holds a lock through the module itself, in a Python process of its own
that says when it holds the lock and lets go when told (or when killed). The waiting
side runs in a greenlet, as the store's writer does, so the event loop goes on.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import gevent
import pytest
from conftest import REPO_DIR

from streamlocks import StreamLocks

KEY = "streams/a/0000000000000000"
OTHER_KEY = "streams/b/0000000000000000"
DEADLINE_SECONDS = 10.0
# Long enough for a wait that should not end to end by mistake; never a measure of speed.
STILL_WAITING_SECONDS = 0.5

HOLDER = """
import sys
from streamlocks import StreamLocks

with StreamLocks(sys.argv[1]).held(sys.argv[2]) as waited:
    print("waited" if waited else "held", flush=True)
    sys.stdin.readline()
"""


class Holder:
    """A process that holds `key`'s lock until `let_go` or `kill`."""

    def __init__(self, path: Path, key: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), key],
            cwd=REPO_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def wait_until_held(self) -> str:
        """'held', or 'waited' if it had to wait for it; fails after the deadline."""
        reader = gevent.get_hub().threadpool.spawn(self.process.stdout.readline)
        line = reader.get(timeout=DEADLINE_SECONDS).strip()
        assert line in ("held", "waited"), f"the holder said {line!r}"
        return line

    def let_go(self) -> None:
        self.process.stdin.close()
        assert self.process.wait(timeout=DEADLINE_SECONDS) == 0
        self.process.stdout.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=DEADLINE_SECONDS)
        self.process.stdin.close()
        self.process.stdout.close()


StartHolder = Callable[..., Holder]


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "writers.lock"


@pytest.fixture
def start_holder(lock_path: Path) -> Iterator[StartHolder]:
    holders: list[Holder] = []

    def start(key: str = KEY) -> Holder:
        holder = Holder(lock_path, key)
        holders.append(holder)
        return holder

    yield start
    for holder in holders:
        if holder.process.poll() is None:
            holder.kill()


def take(locks: StreamLocks, key: str) -> gevent.Greenlet:
    """A greenlet that takes `key`'s lock, then lets go; its value says if it waited."""

    def hold() -> bool:
        with locks.held(key) as waited:
            return waited

    return gevent.spawn(hold)


def test_a_lock_held_elsewhere_is_taken_once_let_go(
    lock_path: Path, start_holder: StartHolder
) -> None:
    locks = StreamLocks(str(lock_path))
    holder = start_holder()
    assert holder.wait_until_held() == "held"

    waiting = take(locks, KEY)
    waiting.join(timeout=STILL_WAITING_SECONDS)
    assert not waiting.ready(), "took a lock another process held"
    with locks.held(OTHER_KEY) as waited:
        assert not waited, "another stream's lock was not free"

    holder.let_go()
    assert waiting.get(timeout=DEADLINE_SECONDS) is True


def test_a_lock_is_let_go_when_its_process_dies(lock_path: Path, start_holder: StartHolder) -> None:
    locks = StreamLocks(str(lock_path))
    holder = start_holder()
    holder.wait_until_held()
    waiting = take(locks, KEY)
    waiting.join(timeout=STILL_WAITING_SECONDS)
    assert not waiting.ready()

    holder.kill()
    assert waiting.get(timeout=DEADLINE_SECONDS) is True


def test_a_wait_given_up_leaves_the_lock_free(lock_path: Path, start_holder: StartHolder) -> None:
    """A writer killed while its thread waits (a stopping server): once the holder lets
    go, the thread takes the lock and must let go of it too."""
    locks = StreamLocks(str(lock_path))
    holder = start_holder()
    holder.wait_until_held()
    waiting = take(locks, KEY)
    waiting.join(timeout=STILL_WAITING_SECONDS)
    waiting.kill(timeout=DEADLINE_SECONDS)

    holder.let_go()
    next_holder = start_holder()
    assert next_holder.wait_until_held() in ("held", "waited")
    next_holder.let_go()
    with locks.held(KEY) as waited:
        assert not waited, "a lock stayed taken after its waiter was killed"


def test_a_lock_file_that_cannot_be_made_leaves_the_writers_racing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert StreamLocks.for_storage(str(tmp_path / "missing"), is_local=True) is None
    assert "will not take turns" in caplog.text


def test_on_local_disk_the_locks_are_a_private_hidden_file_of_the_data_directory(
    tmp_path: Path,
) -> None:
    locks = StreamLocks.for_storage(str(tmp_path), is_local=True)
    assert locks is not None and locks.path == str(tmp_path / ".writers.lock")
    assert stat.S_IMODE(os.stat(locks.path).st_mode) == 0o600


def test_for_an_object_store_the_locks_are_in_a_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    locks = StreamLocks.for_storage("bucket/prefix", is_local=False)
    assert locks is not None
    directory = tmp_path / f"picomq-{os.geteuid()}"
    assert Path(locks.path).parent == directory
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(locks.path).st_mode) == 0o600
    other = StreamLocks.for_storage("bucket/other", is_local=False)
    assert other is not None and other.path != locks.path


def test_a_symbolic_link_planted_at_the_lock_file_is_never_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "elsewhere"
    (tmp_path / ".writers.lock").symlink_to(target)
    assert StreamLocks.for_storage(str(tmp_path), is_local=True) is None
    assert not target.exists(), "the link was followed"
    locks = StreamLocks(str(tmp_path / ".writers.lock"))  # planted after the start
    with locks.held(KEY) as waited:
        assert not waited
    assert not target.exists() and "will not take turns" in caplog.text


@pytest.mark.parametrize(
    "plant",
    ["a link to a directory of ours", "a directory others may write", "a file"],
)
def test_a_private_directory_someone_made_first_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: str
) -> None:
    """In a shared temporary directory, another user may make ours first."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"picomq-{os.geteuid()}"
    if plant == "a link to a directory of ours":
        (tmp_path / "theirs").mkdir(mode=0o700)
        planted.symlink_to(tmp_path / "theirs")
    elif plant == "a directory others may write":
        planted.mkdir()
        planted.chmod(0o777)
    else:
        planted.write_bytes(b"")
    assert StreamLocks.for_storage("bucket/prefix", is_local=False) is None
    if plant == "a link to a directory of ours":
        assert not any((tmp_path / "theirs").iterdir()), "a lock file was made through it"


@pytest.mark.parametrize("owner", ["another user", "us, readable by others"])
def test_a_lock_file_another_user_could_open_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner: str
) -> None:
    """A process that can open the file can hold a lock in it, and stop the commits."""
    path = tmp_path / ".writers.lock"
    path.write_bytes(b"")
    path.chmod(0o600)
    if owner == "another user":  # as if: we are some other user than the file's owner
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)
    else:
        path.chmod(0o644)
    assert StreamLocks.for_storage(str(tmp_path), is_local=True) is None
