"""The member's log, called directly: commits through it, rewrites, replays and fences.

Each store stands for one member of a cluster on the test's root (local disk, and a
fresh bucket on moto), serving every stream alone, as a gunicorn worker that owns their
partitions does. A second store is a second member: it knows only what storage says.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator

import fsspec
import gevent
import orjson
import pytest
from conftest import read_all

import log
import runs
from log import LENGTH, MAGIC_BEFORE, Fenced, Record, decode_log, log_key
from objectstore import ObjectStore, StorageUnavailable
from segments import MAGIC as SEGMENT_MAGIC
from segments import encode_segment
from storage import StreamStore, open_objects
from streams import AppendRequest, CreateRequest, Payload, Producer, StoreSettings

TEXT = "text/plain"
JSON = "application/json"

MakeMember = Callable[..., StreamStore]


@pytest.fixture
def make_member(storage_url: str) -> Iterator[MakeMember]:
    made: list[StreamStore] = []

    def make(member: str, objects: ObjectStore | None = None) -> StreamStore:
        fsspec.AbstractFileSystem.clear_instance_cache()
        for implementation in fsspec.registry.values():
            implementation.clear_instance_cache()
        store = StreamStore(objects or open_objects(storage_url), StoreSettings())
        store.serves_alone = lambda path: True
        store.log.begin(member)
        made.append(store)
        return store

    yield make
    for store in made:  # no rewrite of this test's stores runs into the next test
        if store.rewrites.worker is not None:
            store.rewrites.worker.kill()


def append(store: StreamStore, path: str, data: bytes, seq: int | None = None) -> None:
    producer = Producer("p", 0, seq) if seq is not None else None
    store.append(path, AppendRequest(TEXT, Payload(data), producer=producer))


def names(objects: ObjectStore, prefix: str) -> list[str]:
    return sorted(objects.list(prefix))


def test_commits_are_read_from_memory_until_rewritten_into_segments(
    make_member: MakeMember,
) -> None:
    store = make_member("m1")
    store.create("s", CreateRequest(TEXT))
    for number in range(3):
        append(store, "s", b"%d;" % number)
    prefix = store._open("s").prefix
    assert names(store.objects, f"{prefix}/seg") == []
    assert len(names(store.objects, "log/m1")) == 3
    assert read_all(store, "s") == b"0;1;2;"

    assert store.rewrites.rewrite_all(10)
    assert len(names(store.objects, f"{prefix}/seg")) == 1  # three commits, one segment
    assert read_all(store, "s") == b"0;1;2;"
    assert read_all(make_member("other"), "s") == b"0;1;2;"
    store.log._collect()
    assert names(store.objects, "log/m1") == ["000000000003"]  # the latest stays: the fence


def test_a_member_holds_its_commits_once_in_memory(make_member: MakeMember) -> None:
    """What a member holds for its rewrites is what PICOMQ_LOG_HELD_BYTES bounds: a
    held run keeps its last record for the state it carries, not a second copy of a
    large one's data."""
    store = make_member("m1")
    paths, size = [f"big/{number}" for number in range(32)], 256 * 1024
    for path in paths:
        store.create(path, CreateRequest(TEXT))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for path in paths:
            append(store, path, os.urandom(size))
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.rewrites.held_bytes >= len(paths) * size
    assert taken < 1.5 * len(paths) * size


def test_a_rewrite_keeps_where_each_append_and_message_ends(make_member: MakeMember) -> None:
    store = make_member("m1")
    store.create("j", CreateRequest("application/json"))
    for number in range(3):  # three records of one append, two messages each
        messages = [b"%d" % number, b"[%d]" % number]
        store.append("j", AppendRequest("application/json", Payload.from_messages(messages)))
    assert store.rewrites.rewrite_all(10)

    stream = store._open("j")
    index, _ = store.pieces.read_piece(stream.segment_key(0), whole=True)
    # Stored as "0,[0],1,[1],2,[2],": each message ends after its comma.
    assert list(index.append_ends) == [6, 12, 18]
    assert list(index.message_ends) == [2, 6, 8, 12, 14, 18]
    assert read_all(store, "j", offset=8) == b"[[1],2,[2]]"


def test_a_run_of_one_message_appends_keeps_where_each_ends(make_member: MakeMember) -> None:
    """Records of one append and one message join a run their own way (`Run.add`)."""
    store = make_member("m1")
    store.create("j", CreateRequest("application/json"))
    for messages in ([b"0"], [b"1", b"[1]"], [b"2"], [b"3"]):
        store.append("j", AppendRequest("application/json", Payload.from_messages(messages)))
    # Held as "0,1,[1],2,3,": one run, each message ending after its comma.
    assert [run.start for run in store._open("j").runs] == [0]
    assert read_all(store, "j", offset=8) == b"[2,3]"
    assert store.rewrites.rewrite_all(10)

    index, _ = store.pieces.read_piece(store._open("j").segment_key(0), whole=True)
    assert list(index.append_ends) == [2, 8, 10, 12]
    assert list(index.message_ends) == [2, 4, 8, 10, 12]
    assert read_all(store, "j", offset=10) == b"[3]"


def test_a_held_run_is_read_as_it_grows(make_member: MakeMember) -> None:
    store = make_member("m1")
    store.create("j", CreateRequest("application/json"))

    def read_once(offset: int | None = None) -> bytes:
        return b"".join(store.read("j", offset).chunks)

    store.append("j", AppendRequest("application/json", Payload.from_messages([b"1"])))
    assert read_once() == b"[1]"  # the run's index, as it stood then
    store.append("j", AppendRequest("application/json", Payload.from_messages([b"2", b"3"])))
    assert [run.start for run in store._open("j").runs] == [0]  # one run, grown
    assert read_once() == b"[1,2,3]"
    assert read_once(offset=4) == b"[3]"  # where each message of the second record ends


def test_a_read_begun_before_a_rewrite_ends_after_it(make_member: MakeMember) -> None:
    store = make_member("m1")
    store.create("s", CreateRequest(TEXT))
    append(store, "s", b"0;")
    assert store.rewrites.rewrite_all(10)  # a segment at 0
    append(store, "s", b"1;")  # held, in a run at 2
    result = store.read("s", 0)  # the segment's bytes now, the run's as the answer is sent
    assert store.rewrites.rewrite_all(10)
    assert b"".join(result.chunks) == b"0;1;"


def test_a_run_is_closed_at_its_segment_bound(
    make_member: MakeMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runs, "MAX_SEGMENT_BYTES", 4)
    store = make_member("m1")
    store.create("s", CreateRequest(TEXT))
    for number in range(5):
        append(store, "s", b"%d;" % number)
    assert [run.end - run.start for run in store._open("s").runs] == [4, 4, 2]
    assert read_all(store, "s", offset=6) == b"3;4;"
    assert store.rewrites.rewrite_all(10)
    prefix = store._open("s").prefix
    assert len(names(store.objects, f"{prefix}/seg")) == 3  # 2 + 2 + 1 records
    assert read_all(make_member("other"), "s") == b"0;1;2;3;4;"


def test_commits_made_while_a_run_is_rewritten_start_the_next_run(
    make_member: MakeMember,
) -> None:
    store = make_member("m1")
    store.create("s", CreateRequest(TEXT))
    append(store, "s", b"0;")
    append(store, "s", b"1;")
    stream = store._open("s")
    create = store.objects.create

    def create_while_appending(key: str, data: bytes, **options: bool) -> None:
        if "/seg/" in key:  # the rewrite's segment: a commit comes while it is stored
            gevent.spawn(append, store, "s", b"2;").get()
        create(key, data, **options)

    store.objects.create = create_while_appending  # type: ignore[method-assign]
    store.rewrites.rewrite(stream)
    store.objects.create = create  # type: ignore[method-assign]

    assert store.pieces.read_piece(stream.segment_key(0))[0].end == 4
    assert [(run.start, run.end) for run in stream.runs] == [(4, 6)]
    assert read_all(store, "s") == b"0;1;2;"
    assert store.rewrites.rewrite_all(10)
    assert read_all(make_member("other"), "s") == b"0;1;2;"


def test_a_dead_members_commits_are_replayed_once(make_member: MakeMember) -> None:
    first = make_member("m1")
    first.create("s", CreateRequest(TEXT))
    append(first, "s", b"a;")
    first.rewrites.rewrite_all(10)
    for number in range(3):
        append(first, "s", b"%d;" % number, seq=number)

    second = make_member("m2")
    second.replay("m1")
    second.replay("m1")  # twice, as two members taking partitions at once may
    assert read_all(second, "s") == b"a;0;1;2;"
    assert read_all(make_member("m3"), "s") == b"a;0;1;2;"
    # The producer state came with the data: a retry is a duplicate, the next is in order.
    append(second, "s", b"2;", seq=2)
    append(second, "s", b"3;", seq=3)
    assert read_all(second, "s") == b"a;0;1;2;3;"


def log_of_the_release_before(records: list[Record]) -> bytes:
    """A log object as the release before wrote it: each record a whole segment."""
    segments = [
        encode_segment(r.start, r.payload, r.append_ends, r.message_ends, r.state(),
                       written_at=r.written_at)[0]
        for r in records
    ]  # fmt: skip
    listed = [
        [r.path, r.prefix, r.start, len(data)] for r, data in zip(records, segments, strict=True)
    ]
    header = orjson.dumps({"token": "0" * 32, "records": listed})
    return b"".join([MAGIC_BEFORE, LENGTH.pack(len(header)), header, *segments])


def test_a_log_of_the_release_before_is_replayed(make_member: MakeMember) -> None:
    first = make_member("m1")
    first.create("j", CreateRequest("application/json"))
    for number in range(3):
        first.append("j", AppendRequest(
            "application/json", Payload.from_messages([b"%d" % number, b"[%d]" % number]),
            producer=Producer("p", 0, number),
        ))  # fmt: skip
    for name in names(first.objects, "log/m1"):
        key = f"log/m1/{name}"
        records = decode_log(first.objects.read(key))[1]
        first.objects.delete_many([key])
        first.objects.create(key, log_of_the_release_before(records))

    second = make_member("m2")
    second.replay("m1")
    assert read_all(second, "j") == b"[0,[0],1,[1],2,[2]]"
    # The producer state came with the data; message ends too: a read starts at each.
    second.append("j", AppendRequest(
        "application/json", Payload.from_messages([b"2"]), producer=Producer("p", 0, 2)
    ))  # fmt: skip
    assert read_all(second, "j") == b"[0,[0],1,[1],2,[2]]"
    assert read_all(second, "j", offset=2) == b"[[0],1,[1],2,[2]]"
    assert names(second.objects, "log/m1") == ["000000000004"]  # its fence: the rest went


def test_a_fenced_member_acknowledges_nothing_more(make_member: MakeMember) -> None:
    first = make_member("m1")
    given_up: list[bool] = []
    first.log.on_fenced.append(lambda: given_up.append(True))
    first.create("s", CreateRequest(TEXT))
    append(first, "s", b"before;")

    second = make_member("m2")
    second.replay("m1")  # believes m1 dead: fences its log, then replays it
    with pytest.raises(Fenced):
        append(first, "s", b"after;")
    assert given_up == [True]
    assert first.log.member is None
    append(second, "s", b"second;")
    assert read_all(second, "s") == b"before;second;"


def logged_records(store: StreamStore, member: str) -> list[Record]:
    """Every record of `member`'s log, in order."""
    return [
        record
        for name in names(store.objects, f"log/{member}")
        for record in decode_log(store.objects.read(log_key(member, int(name))))[1]
    ]


def test_a_lone_append_is_logged_and_answered_as_a_batch_of_one(
    make_member: MakeMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain append that finds its stream idle commits alone; what it logs, answers
    and leaves in the stream is what the batch's way gives the same appends."""
    store = make_member("m1")
    commits, lone, commit_lone = store.commits, store.commits._lone, store.commits._commit_lone
    taken: list[str] = []
    monkeypatch.setattr(
        commits,
        "_lone",
        lambda stream, request: stream.config.path == "a" and lone(stream, request),
    )
    monkeypatch.setattr(
        commits,
        "_commit_lone",
        lambda stream, request: taken.append(stream.config.path) or commit_lone(stream, request),
    )

    announced: list[int] = []
    store.listeners.append(lambda info: announced.append(info.tail))
    store.commit_observers.append(announced.append)  # each commit's count of appends

    def commit(path: str) -> tuple[object, ...]:
        store.create(path, CreateRequest(JSON))
        announced.clear()
        appends = [
            (Payload.from_messages([b"1"]), Producer("p", 0, 0)),  # the batch's way, always
            (Payload.from_messages([b"2"]), None),
            (Payload.from_messages([b"3", b"45"]), None),
        ]
        answers = [
            store.append(path, AppendRequest(JSON, payload, producer=producer))
            for payload, producer in appends
        ]
        state = store._open(path).state
        return (
            [(a.info.tail, a.info.closed, a.duplicate, a.producer) for a in answers],
            (state.tail, state.closed, without_times(state.producers), state.producer_snapshot),
            state.producers_changed,
            [
                record._replace(
                    path="",
                    prefix="",
                    written_at=0.0,
                    producers=without_times(dict(record.producers)),
                )
                for record in logged_records(store, "m1")
                if record.path == path
            ],
            read_all(store, path),
            list(announced),
        )

    assert commit("a") == commit("b")
    assert taken == ["a", "a"]
    carried = [without_times(dict(r.producers)) for r in logged_records(store, "m1")]
    assert carried[:3] == [(("p", (0, 0)),)] * 3  # a lone record carries the table's changes


def without_times(producers: dict[str, tuple[int, int, int]]) -> tuple[tuple[str, tuple], ...]:
    return tuple((key, entry[:2]) for key, entry in producers.items())


def test_appends_that_come_during_a_lone_commit_are_handed_on(
    make_member: MakeMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_member("m1")
    store.create("s", CreateRequest(TEXT))
    write = store.log.write
    failures = [StorageUnavailable("the disk is full")]

    def slow_write(record: Record) -> int:
        gevent.sleep(0.05)  # the others arrive while it is stored
        if failures:
            raise failures.pop()
        return write(record)

    monkeypatch.setattr(store.log, "write", slow_write)
    with pytest.raises(StorageUnavailable):
        append(store, "s", b"lost;")
    assert store._open("s").state.tail == 0 and not store._open("s").writing

    appenders = [gevent.spawn(append, store, "s", b"%d;" % n) for n in range(3)]
    gevent.joinall(appenders, raise_error=True)
    assert read_all(store, "s") == b"0;1;2;"
    assert [record.end for record in logged_records(store, "m1")] == [2, 6]  # one, then two
    assert not store._open("s").writing


def test_a_flush_holds_at_most_its_bound_or_one_record(
    make_member: MakeMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commits that come while a flush is stored gather into the next ones, each up to
    MAX_FLUSH_BYTES of payload or a single record larger than that; every commit is
    answered once its own object is stored."""
    monkeypatch.setattr(log, "MAX_FLUSH_BYTES", 5)
    store = make_member("m1")
    sizes = {"a": 4, "b": 2, "c": 1, "d": 9, "e": 2}  # in the order they append
    for path in sizes:
        store.create(path, CreateRequest(TEXT))
    appenders = [gevent.spawn(append, store, path, b"x" * size) for path, size in sizes.items()]
    gevent.joinall(appenders, raise_error=True)

    flushes = [
        decode_log(store.objects.read(log_key("m1", int(name))))[1]
        for name in names(store.objects, "log/m1")
    ]
    for records in flushes:
        assert sum(len(record.payload) for record in records) <= 5 or len(records) == 1
    assert max(map(len, flushes)) > 1  # commits did gather, so the bound was put to work
    assert sorted(record.path for records in flushes for record in records) == sorted(sizes)
    for path, size in sizes.items():
        assert read_all(store, path) == b"x" * size


def test_a_replay_cut_short_is_finished_by_the_next(
    make_member: MakeMember, storage_url: str
) -> None:
    first = make_member("m1")
    for path in ("a", "b", "c"):
        first.create(path, CreateRequest(TEXT))
        append(first, path, path.encode() + b"1;")
        append(first, path, path.encode() + b"2;")

    class FailingAfter(type(open_objects(storage_url))):  # type: ignore[misc]
        creates = 0

        def create(self, key: str, data: bytes, **options: object) -> None:
            if "/seg/" in key:
                FailingAfter.creates += 1
                if FailingAfter.creates > 1:
                    raise StorageUnavailable("the node died here")
            super().create(key, data, **options)

    failing = make_member("m2", FailingAfter(*_arguments(storage_url)))
    with pytest.raises(StorageUnavailable):
        failing.replay("m1")
    assert len(names(failing.objects, "log/m1")) > 0  # kept: not every record is in

    make_member("m3").replay("m1")
    reader = make_member("m4")
    for path in ("a", "b", "c"):
        assert read_all(reader, path) == path.encode() + b"1;" + path.encode() + b"2;"
    assert [name for name in names(reader.objects, "log/m1")] == ["000000000007", "000000000008"]


def _arguments(storage_url: str) -> tuple[str, ...]:
    """What `open_objects` gives its backend's class for `storage_url`."""
    objects = open_objects(storage_url)
    return (objects.root,) if objects.is_local else (storage_url,)


def test_a_deleted_streams_commits_are_not_replayed(make_member: MakeMember) -> None:
    first = make_member("m1")
    first.create("s", CreateRequest(TEXT))
    append(first, "s", b"old;")
    first.delete("s")
    first.create("s", CreateRequest(TEXT))
    append(first, "s", b"new;")
    second = make_member("m2")
    second.replay("m1")
    assert read_all(second, "s") == b"new;"


def test_the_log_object_a_fence_must_find_is_never_deleted(make_member: MakeMember) -> None:
    store = make_member("m1")
    store.create("s", CreateRequest(TEXT))
    append(store, "s", b"x;")
    store.rewrites.rewrite_all(10)
    store.log._collect()
    assert names(store.objects, "log/m1") == [log_key("m1", 1).rpartition("/")[2]]
    make_member("m2").replay("m1")  # fences at 2, above the one kept
    with pytest.raises(Fenced):
        append(store, "s", b"y;")


def test_a_large_record_is_logged_as_its_segment_and_linked_into_place(
    make_member: MakeMember,
) -> None:
    """On local disk a flush of one large record is shaped as that record's segment,
    and the rewrite names the same file in the stream's folder rather than writing its
    bytes again. On object stores it is logged as any flush."""
    store = make_member("m1")
    store.create("s", CreateRequest(TEXT))
    large = os.urandom(log.SHAPED_RECORD_BYTES)
    append(store, "s", b"small;")
    append(store, "s", large)
    append(store, "s", b"after;")
    first, shaped, after = (store.objects.read(log_key("m1", seq)) for seq in (1, 2, 3))
    links = store.objects.links_cheaply
    assert first.startswith(log.MAGIC) and after.startswith(log.MAGIC)
    assert shaped.startswith(SEGMENT_MAGIC if links else log.MAGIC)
    # Nothing joins a shaped record's run; elsewhere the three join.
    assert [len(run.seqs) for run in store._open("s").runs] == ([1, 1, 1] if links else [3])
    expected = b"small;" + large + b"after;"
    assert read_all(store, "s") == expected

    root = store.objects.root
    logged = os.stat(f"{root}/{log_key('m1', 2)}").st_ino if links else None
    assert store.rewrites.rewrite_all(10)
    prefix = store._open("s").prefix
    starts = [int(name) for name in names(store.objects, f"{prefix}/seg")]
    assert starts == ([0, 6, 6 + len(large)] if links else [0])
    if links:
        assert os.stat(f"{root}/{prefix}/seg/{6:020d}").st_ino == logged
    store.log._collect()
    assert read_all(store, "s") == expected
    assert read_all(make_member("other"), "s") == expected


def test_a_shaped_log_object_is_replayed(make_member: MakeMember) -> None:
    first = make_member("m1")
    first.create("s", CreateRequest(TEXT))
    large = os.urandom(log.SHAPED_RECORD_BYTES + 1)
    append(first, "s", large, seq=0)
    append(first, "s", b"1;", seq=1)

    second = make_member("m2")
    second.replay("m1")
    assert read_all(second, "s") == large + b"1;"
    append(second, "s", large, seq=0)  # the producer state came with the data: a duplicate
    append(second, "s", b"2;", seq=2)
    assert read_all(second, "s") == large + b"1;2;"


def test_a_log_object_goes_only_once_its_link_is_durable(
    make_member: MakeMember, storage_url: str
) -> None:
    """A link is durable once its folder is synced: the log object it names again must
    outlive that sync, or a crash could lose both names of an acknowledged append."""
    events: list[tuple[str, str]] = []

    class Recording(type(open_objects(storage_url))):  # type: ignore[misc]
        def make_durable(self, key: str) -> None:
            super().make_durable(key)
            events.append(("synced", key.rpartition("/seg/")[0]))

        def delete_many(self, keys: list[str]) -> None:
            events.extend(("deleted", key) for key in keys)
            super().delete_many(keys)

    store = make_member("m1", Recording(*_arguments(storage_url)))
    if not store.objects.links_cheaply:
        pytest.skip("object stores copy: nothing is linked")
    store.create("s", CreateRequest(TEXT))
    for _ in range(2):
        append(store, "s", os.urandom(log.SHAPED_RECORD_BYTES))
    append(store, "s", b"latest;")  # the log object a fence must find stays
    assert store.rewrites.rewrite_all(10)
    with gevent.Timeout(10):
        while len(names(store.objects, "log/m1")) > 1:  # the release's own collection
            gevent.sleep(0.01)
    prefix = store._open("s").prefix
    assert events == [
        ("synced", prefix),
        ("deleted", log_key("m1", 1)),
        ("deleted", log_key("m1", 2)),
    ]


def test_a_fenced_member_links_nothing_over_its_replayed_records(
    make_member: MakeMember,
) -> None:
    """The member that fenced this one replayed its log and deleted it: the shaped log
    object is gone, and the rewrite finds the other's segment in its place."""
    first = make_member("m1")
    first.create("s", CreateRequest(TEXT))
    large = os.urandom(log.SHAPED_RECORD_BYTES)
    append(first, "s", large)
    second = make_member("m2")
    second.replay("m1")

    assert not first.rewrites.rewrite_all(1)
    assert first.log.member is None  # it gave up its identity
    assert read_all(second, "s") == large


def test_a_record_linked_before_a_crash_is_replayed_once(make_member: MakeMember) -> None:
    """The latest log object stays after its rewrite (a fence must find its number): a
    replay then finds the shaped record's segment in place, the linked file itself."""
    first = make_member("m1")
    first.create("s", CreateRequest(TEXT))
    large = os.urandom(log.SHAPED_RECORD_BYTES)
    append(first, "s", large)
    assert first.rewrites.rewrite_all(10)
    assert names(first.objects, "log/m1") == [log_key("m1", 1).rpartition("/")[2]]

    second = make_member("m2")
    second.replay("m1")
    assert read_all(second, "s") == large
    append(second, "s", b"next;")
    assert read_all(second, "s") == large + b"next;"
