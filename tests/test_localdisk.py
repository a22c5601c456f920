"""Durable creates on local disk: batches share their syncs, objects fail one by one.

Creates run on a real directory through gevent's real thread pool; a wrapper around
the pool only counts the batches. A crash between the syncs cannot be staged here;
test_durability kills real servers mid-load on the same code.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import pytest
from conftest import NEEDS_INOTIFY

import dirwatch
import localdisk
from objectstore import run_in_threadpool
from storage import open_objects

pytestmark = pytest.mark.skipif(
    not localdisk.CAN_SYNC_FILESYSTEM, reason="batched creates need Linux's syncfs"
)

CREATORS = 40


def counting(run: Callable[..., Any], batches: list[int]) -> Callable[..., Any]:
    def run_and_count(function: Callable[..., Any], objects: list[localdisk.Create]) -> Any:
        batches.append(len(objects))
        return run(function, objects)

    return run_and_count


def leftovers(root: Path) -> list[Path]:
    return [path for path in root.rglob(".tmp-*")]


def test_concurrent_creates_share_batches(tmp_path: Path) -> None:
    batches: list[int] = []
    creates = localdisk.BatchedCreates(counting(run_in_threadpool, batches), idle_seconds=60)
    creates.create(f"{tmp_path}/before", b"")  # on this thread; the process is busy from now
    paths = [f"{tmp_path}/stream{number}/segment" for number in range(CREATORS)]
    greenlets = [
        gevent.spawn(creates.create, path, f"object {number}".encode())
        for number, path in enumerate(paths)
    ]
    gevent.joinall(greenlets, timeout=30, raise_error=True)
    assert all(greenlet.successful() for greenlet in greenlets)
    assert [Path(path).read_bytes() for path in paths] == [
        f"object {number}".encode() for number in range(CREATORS)
    ]
    assert sum(batches) == CREATORS
    assert len(batches) < CREATORS / 4, f"creates were not batched: {batches}"
    assert not leftovers(tmp_path)


def test_an_existing_object_fails_alone(tmp_path: Path) -> None:
    existing = tmp_path / "a" / "taken"
    existing.parent.mkdir()
    existing.write_bytes(b"first")
    objects = [
        localdisk.Create(f"{tmp_path}/a/new", b"new in a"),
        localdisk.Create(str(existing), b"second"),
        localdisk.Create(f"{tmp_path}/b/new", b"new in b"),
    ]
    outcomes = localdisk.create_many(objects)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], FileExistsError)
    assert existing.read_bytes() == b"first"
    assert (tmp_path / "a" / "new").read_bytes() == b"new in a"
    assert (tmp_path / "b" / "new").read_bytes() == b"new in b"
    assert not leftovers(tmp_path)


def test_an_object_whose_directory_cannot_exist_fails_alone(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"not a directory")
    outcomes = localdisk.create_many(
        [
            localdisk.Create(f"{tmp_path}/file/inside/object", b"lost"),
            localdisk.Create(f"{tmp_path}/ok/object", b"kept"),
        ]
    )
    assert isinstance(outcomes[0], NotADirectoryError)
    assert outcomes[1] is None
    assert (tmp_path / "ok" / "object").read_bytes() == b"kept"
    assert not leftovers(tmp_path)


def test_a_directory_deleted_mid_batch_fails_only_its_own_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream deleted while a batch writes its segment: the other streams' segments in
    the batch are still created (the batch's syncs once needed the first directory)."""
    write_temporary = localdisk._write_temporary
    doomed = tmp_path / "deleted-stream" / "seg"

    def deleting_the_first_directory(path: str, data: bytes, *, fsync: bool) -> tuple[str, int]:
        if not path.startswith(str(doomed)):
            shutil.rmtree(doomed.parent)  # after the first object's temporary was written
        return write_temporary(path, data, fsync=fsync)

    monkeypatch.setattr(localdisk, "_write_temporary", deleting_the_first_directory)
    outcomes = localdisk.create_many(
        [
            localdisk.Create(f"{doomed}/segment", b"lost"),
            localdisk.Create(f"{tmp_path}/live-stream/seg/segment", b"kept"),
        ]
    )
    assert isinstance(outcomes[0], FileNotFoundError)
    assert outcomes[1] is None
    assert (tmp_path / "live-stream" / "seg" / "segment").read_bytes() == b"kept"
    assert not leftovers(tmp_path)


def test_creates_waiting_behind_a_killed_writer_are_still_written(tmp_path: Path) -> None:
    """The greenlet writing a batch is a request's; if it dies, the next batch goes on."""

    def slow(function: Callable[..., Any], objects: list[localdisk.Create]) -> Any:
        gevent.sleep(0.2)
        return run_in_threadpool(function, objects)

    creates = localdisk.BatchedCreates(slow)
    writer = gevent.spawn(creates.create, f"{tmp_path}/first", b"1")
    gevent.sleep(0.05)  # the first create's batch is in flight
    waiting = gevent.spawn(creates.create, f"{tmp_path}/second", b"2")
    gevent.sleep(0.05)
    writer.kill(block=True)
    waiting.join(timeout=10)
    assert waiting.successful(), f"the waiting create did not finish: {waiting.exception}"
    assert (tmp_path / "second").read_bytes() == b"2"
    assert not creates.writing


def test_only_a_create_that_finds_the_process_idle_skips_the_thread_pool(tmp_path: Path) -> None:
    """The trip to the pool and back is saved only where no one could use the event loop
    meanwhile: not right after another batch, nor after the process was busy."""
    idle_seconds = 0.05
    batches: list[int] = []
    creates = localdisk.BatchedCreates(counting(run_in_threadpool, batches), idle_seconds)
    creates.create(f"{tmp_path}/first", b"1")  # nothing before it: on this thread
    creates.create(f"{tmp_path}/right-after", b"2")
    assert batches == [1]
    time.sleep(2 * idle_seconds)
    creates.create(f"{tmp_path}/after-a-pause", b"3")
    assert batches == [1]
    wall, cpu = time.monotonic(), time.process_time()
    while time.process_time() - cpu < 2 * idle_seconds:
        pass  # the process busy, as under load
    if time.process_time() - cpu < localdisk.BUSY_FRACTION * (time.monotonic() - wall):
        pytest.skip("this machine gave the test process too little of a core to be busy")
    creates.create(f"{tmp_path}/after-busy", b"4")
    assert batches == [1, 1]
    names = ["first", "right-after", "after-a-pause", "after-busy"]
    assert [(tmp_path / name).read_bytes() for name in names] == [b"1", b"2", b"3", b"4"]


def test_object_store_creates_are_create_only(tmp_path: Path) -> None:
    store = open_objects(str(tmp_path))
    store.create("stream/segment", b"first")
    with pytest.raises(FileExistsError):
        store.create("stream/segment", b"second")
    assert store.read("stream/segment") == b"first"
    assert os.listdir(tmp_path / "stream") == ["segment"]


def test_a_link_names_the_same_file_create_only(tmp_path: Path) -> None:
    store = open_objects(str(tmp_path))
    store.create("log/1", b"logged")
    store.link("log/1", "stream/seg/1")
    assert os.stat(tmp_path / "stream/seg/1").st_ino == os.stat(tmp_path / "log/1").st_ino
    store.create("log/2", b"other")
    with pytest.raises(FileExistsError):
        store.link("log/2", "stream/seg/1")
    assert store.read("stream/seg/1") == b"logged"


def test_a_link_across_filesystems_is_a_copy(tmp_path: Path) -> None:
    """A data root whose stream folders are mounted elsewhere (here tmpfs) cannot link."""
    shared_memory = Path("/dev/shm")
    if not shared_memory.is_dir() or shared_memory.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a second filesystem at /dev/shm")
    elsewhere = shared_memory / f"picomq-test-{os.getpid()}-{tmp_path.name}"
    elsewhere.mkdir()
    try:
        (tmp_path / "stream").symlink_to(elsewhere)
        store = open_objects(str(tmp_path))
        store.create("log/1", b"logged")
        store.link("log/1", "stream/seg/1")
        assert store.read("stream/seg/1") == b"logged"
        assert os.stat(tmp_path / "stream/seg/1").st_dev != os.stat(tmp_path / "log/1").st_dev
    finally:
        shutil.rmtree(elsewhere)


def record_syncs(monkeypatch: pytest.MonkeyPatch, paths: list[str]) -> list[list[bool]]:
    """For each syncfs call made, which of `paths` were linked into place at that moment."""
    sync, syncs = localdisk._sync_filesystems, []

    def recording(descriptors: Any) -> None:
        syncs.append([os.path.exists(path) for path in paths])
        sync(descriptors)

    monkeypatch.setattr(localdisk, "_sync_filesystems", recording)
    return syncs


@pytest.mark.parametrize("verified", [(True,), (True, True, True), (True, False, True)])
def test_data_is_synced_before_its_link_unless_the_loader_verifies_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verified: tuple[bool, ...]
) -> None:
    """Publishing data a crash may tear is safe only where loading checks it whole."""
    paths = [f"{tmp_path}/stream{number}/segment" for number in range(len(verified))]
    syncs = record_syncs(monkeypatch, paths)
    objects = [
        localdisk.Create(path, path.encode(), checked)
        for path, checked in zip(paths, verified, strict=True)
    ]
    assert localdisk.create_many(objects) == [None] * len(objects)
    linked = [True] * len(paths)
    if all(verified):
        assert syncs == [linked]  # one sync, after the links, for data and links alike
    else:
        assert syncs == [list(verified), linked]  # the unverified wait for the first
    assert [Path(path).read_bytes() for path in paths] == [path.encode() for path in paths]
    assert not leftovers(tmp_path)


def test_a_lone_object_the_loader_does_not_verify_takes_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = f"{tmp_path}/stream/meta.json"
    syncs = record_syncs(monkeypatch, [path])
    assert localdisk.create_many([localdisk.Create(path, b"{}")]) == [None]
    assert syncs == []
    assert Path(path).read_bytes() == b"{}"


def names_created_by(directory: Path, creates: list[localdisk.Create]) -> list[str]:
    """Every name inotify hears made in `directory` while `creates` are made, as a batch
    and then one by one, the first once more (which fails: it exists)."""
    heard: list[str] = []
    cancel = dirwatch.watcher.watch_creates(str(directory), heard.append)
    assert cancel is not None, "no inotify watch could be added"
    try:
        assert localdisk.create_many(creates[:-1]) == [None] * (len(creates) - 1)
        assert localdisk.create_many(creates[-1:]) == [None]
        [again] = localdisk.create_many(creates[:1])
        assert isinstance(again, FileExistsError)
        gevent.sleep(0.1)  # the watch's greenlet reads what the kernel has queued
    finally:
        cancel()
    assert sorted(os.listdir(directory)) == [Path(create.path).name for create in creates]
    assert [Path(create.path).read_bytes() for create in creates] == [
        create.data for create in creates
    ]
    return sorted(heard)


@NEEDS_INOTIFY
@pytest.mark.skipif(not localdisk.CAN_LINK_UNNAMED, reason="no unnamed files on this system")
@pytest.mark.parametrize("verified", [True, False])
def test_only_objects_the_loader_verifies_are_written_without_a_temporary_name(
    tmp_path: Path, verified: bool
) -> None:
    """A segment's file has no name until it is linked as its own: inotify hears one
    create per segment. Data that must be synced before its link still goes through a
    named temporary file: an unnamed one would hold a descriptor per object till then."""
    directory = tmp_path / "seg"
    directory.mkdir()
    paths = [f"{directory}/{number:04d}" for number in range(4)]
    names = names_created_by(directory, [localdisk.Create(p, p.encode(), verified) for p in paths])
    finals = ["0000", "0001", "0002", "0003"]
    if verified:
        assert names == finals
    else:  # a temporary file each, and one for the create that failed
        assert all(name.startswith(".tmp-") for name in names[:5])
        assert names[5:] == finals


def test_without_unnamed_files_verified_objects_take_a_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(localdisk, "CAN_LINK_UNNAMED", False)
    directory = tmp_path / "seg"
    directory.mkdir()
    paths = [f"{directory}/{number:04d}" for number in range(3)]
    names = names_created_by(directory, [localdisk.Create(p, p.encode(), True) for p in paths])
    assert names[4:] == ["0000", "0001", "0002"]  # and a temporary file each, as above
    assert all(name.startswith(".tmp-") for name in names[:4])


def test_an_object_whose_directory_was_just_removed_is_not_found(tmp_path: Path) -> None:
    """A stream deleted under its append is a 404, never a 503: ext4 refuses an unnamed
    file in a removed directory with EPERM, where a named create says ENOENT. /proc's
    link to a removed directory stands in for a removal between lookup and create."""
    directory = tmp_path / "seg"
    directory.mkdir()
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        directory.rmdir()
        removed = f"/proc/self/fd/{descriptor}"
        with pytest.raises(FileNotFoundError):
            localdisk.publish_then_sync(f"{removed}/0000", b"lost")
        outcomes = localdisk.create_many(
            [
                localdisk.Create(f"{removed}/0001", b"lost", True),
                localdisk.Create(f"{tmp_path}/live/0001", b"kept", True),
            ]
        )
    finally:
        os.close(descriptor)
    assert isinstance(outcomes[0], FileNotFoundError)
    assert outcomes[1] is None
    assert (tmp_path / "live" / "0001").read_bytes() == b"kept"


def test_many_objects_are_deleted_while_other_greenlets_run(tmp_path: Path) -> None:
    """The unlinks go to the thread pool while a greenlet ticks on the hub. It waits a
    millisecond between ticks: one that only yielded kept the interpreter's lock but at
    its forced switches, and the pool's thread, which needs it after each unlink,
    crawled (721 s in one full run). 2,000 unlinks outlast a millisecond by far."""
    objects = open_objects(str(tmp_path))
    keys = [f"log/m/{number}" for number in range(2000)]
    (tmp_path / "log" / "m").mkdir(parents=True)
    for key in keys:
        (tmp_path / key).write_bytes(b"x")  # as a log's flushes leave them, without syncs
    turns = itertools.count()

    def take_turns() -> None:
        while True:
            next(turns)
            gevent.sleep(0.001)

    ticker = gevent.spawn(take_turns)
    gevent.sleep(0)
    before = next(turns)
    objects.delete_many([*keys, "log/m/never"])
    ran = next(turns) - before - 1
    ticker.kill()
    assert objects.list("log/m") == []
    assert ran > 0, "deleting held the hub: no other greenlet ran meanwhile"
