"""The stream store called directly (no Flask), one suite run on local disk and on S3 (moto).

Every test gets a fresh root: a temporary directory, or a fresh bucket on the session's
moto_server. `make_store` builds a `StreamStore` the way a node does, with its own
filesystem object and an empty cache, so a second store on the same root behaves like a
second node: it knows only what storage tells it. On S3 the object store runs its calls in
gevent's thread pool; called from pytest's main thread the hub simply runs while the
calling greenlet waits, so no monkey-patching is needed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import fsspec
import gevent
import orjson
import pytest
from conftest import NEEDS_INOTIFY, read_all
from gevent.event import Event

import commits
import compaction
import lifecycle
import localdisk
import storage
import streams
from objectstore import ObjectCache, StorageUnavailable
from reads import SMALL_CHUNK_BYTES
from segments import (
    MAGIC,
    PREFIX,
    CorruptSegment,
    StreamState,
    decode_header,
    encode_segment,
    positions,
)
from storage import StreamStore, open_objects
from streams import (
    AppendRequest,
    AppendResult,
    CreateRequest,
    InvalidRequest,
    OffsetTrimmed,
    Payload,
    PreconditionFailed,
    Producer,
    ProducerFenced,
    ProducerGap,
    StoreSettings,
    Stream,
    StreamClosed,
    StreamConflict,
    StreamGone,
    StreamInfo,
    StreamNotFound,
    stream_key,
)

TEXT = "text/plain"
JSON = "application/json"
# Live reads of another store's appends look for new segments this often.
POLL_INTERVAL = 0.05
WAIT_TIMEOUT_SECONDS = 10.0
JOIN_TIMEOUT_SECONDS = 60.0
ALTERNATING_ROUNDS = 12
WRITERS_PER_STORE = 6
APPENDS_PER_WRITER = 8
SEGMENTS_AHEAD = 20

Action = Callable[[], None]
MakeStore = Callable[[], StreamStore]


@pytest.fixture
def make_store(storage_url: str) -> MakeStore:
    """A new store on the test's root, like a node starting with an empty cache."""

    def make(**settings: object) -> StreamStore:
        """`settings` override the test's StoreSettings."""
        # fsspec reuses filesystem objects (and their listing caches) between equal URLs;
        # a node of its own gets a filesystem of its own.
        fsspec.AbstractFileSystem.clear_instance_cache()
        for implementation in fsspec.registry.values():
            implementation.clear_instance_cache()
        store_settings = StoreSettings(**{"poll_interval": POLL_INTERVAL, **settings})
        return StreamStore(open_objects(storage_url), store_settings)

    return make


# -- helpers -----------------------------------------------------------------------------


def append_text(store: StreamStore, path: str, data: bytes, **options: object) -> AppendResult:
    return store.append(path, AppendRequest(TEXT, Payload(data), **options))


def messages(*values: object) -> Payload:
    return Payload.from_messages([orjson.dumps(value) for value in values])


def append_json(store: StreamStore, path: str, *values: object, **options: object) -> AppendResult:
    return store.append(path, AppendRequest(JSON, messages(*values), **options))


def produce(store: StreamStore, path: str, data: bytes, epoch: int, seq: int) -> AppendResult:
    return append_text(store, path, data, producer=Producer("producer-1", epoch, seq))


# -- one store ---------------------------------------------------------------------------


def test_bytes_round_trip(make_store: MakeStore) -> None:
    store = make_store()
    created, info = store.create("a/b", CreateRequest(TEXT, payload=Payload(b"hello ")))
    assert (created, info.tail, info.closed, info.content_type) == (True, 6, False, TEXT)

    assert append_text(store, "a/b", b"world").info.tail == 11
    assert append_text(store, "a/b", b"!").info.tail == 12
    assert read_all(store, "a/b") == b"hello world!"
    assert read_all(store, "a/b", 6) == b"world!"
    assert read_all(store, "a/b", 12) == b""
    assert store.head("a/b").tail == 12
    # Offsets no read gave out, as the reference server answers them: from inside an
    # append, the whole append; past the tail, nothing, up to date at the tail.
    assert read_all(store, "a/b", 8) == b"world!"
    beyond = store.read("a/b", 13)
    assert (beyond.start, beyond.end, b"".join(beyond.chunks), beyond.up_to_date) == (
        12, 12, b"", True,
    )  # fmt: skip

    assert store.create("a/b", CreateRequest(TEXT)) == (False, store.head("a/b"))
    with pytest.raises(StreamConflict):
        store.create("a/b", CreateRequest(JSON))
    with pytest.raises(StreamConflict):
        store.append("a/b", AppendRequest(JSON, messages(1)))
    with pytest.raises(StreamNotFound):
        store.read("a/c", None)
    with pytest.raises(StreamNotFound):
        append_text(store, "a/c", b"x")


def test_an_info_at_another_tail_is_a_copy_that_leaves_the_first_as_it_was() -> None:
    first = StreamInfo("p", "i", JSON, 5, False, 60, None, 0, 30, 1000)
    moved = first.at(9, True, 2)
    assert moved == replace(first, tail=9, closed=True, earliest=2)
    assert first == StreamInfo("p", "i", JSON, 5, False, 60, None, 0, 30, 1000)
    assert moved.at(12, False, 2).tail == 12 and moved.tail == 9


def test_reads_are_cut_into_bounded_pieces_of_whole_appends(make_store: MakeStore) -> None:
    """So no read ends inside an append: an offset there would read from its start."""
    store = make_store()
    store.create("big", CreateRequest(TEXT))
    pieces = [bytes([65 + n]) * 1000 for n in range(10)]
    for piece in pieces:
        append_text(store, "big", piece)
    result = store.read("big", 1000, max_bytes=2500)
    assert (result.start, result.end) == (1000, 3000)
    assert b"".join(result.chunks) == b"".join(pieces)[1000:3000]
    result = store.read("big", 1500, max_bytes=500)  # inside an append; one at least
    assert (result.start, result.end) == (1000, 2000)
    append_text(store, "big", b"Z" * 5000)
    result = store.read("big", 10_000, max_bytes=2500)  # one append larger than the cap
    assert (result.start, result.end, b"".join(result.chunks)) == (10_000, 15_000, b"Z" * 5000)


def recorded_message_ends(storage_url: str, path: str) -> list[int]:
    """The message ends a stream's segments record, as another node would read them."""
    objects = open_objects(storage_url)
    stream = f"streams/{stream_key(path)}"
    [incarnation] = [name for name in objects.list(stream) if name != "meta.json"]
    segments = f"{stream}/{incarnation}/seg"
    indexes = (
        decode_header(objects.read(f"{segments}/{name}"))[0] for name in objects.list(segments)
    )
    return sorted(
        end for index in indexes for end in index.ends_in(index.start, index.end, messages=True)
    )


def test_json_messages_keep_their_boundaries(make_store: MakeStore, storage_url: str) -> None:
    store = make_store()
    store.create("events", CreateRequest(JSON))
    assert read_all(store, "events") == b"[]"
    append_json(store, "events", 1, "two", {"three": [3]})
    append_json(store, "events", None)
    everything = b'[1,"two",{"three":[3]},null]'
    assert read_all(store, "events") == everything
    assert orjson.loads(everything) == [1, "two", {"three": [3]}, None]
    assert recorded_message_ends(storage_url, "events") == [2, 8, 22, 27]  # once each

    # Offsets are byte positions; each message is stored with its separator.
    assert read_all(store, "events", 2) == b'["two",{"three":[3]},null]'
    assert read_all(store, "events", 8) == b'[{"three":[3]},null]'
    assert read_all(store, "events", 3) == b'["two",{"three":[3]},null]'  # inside "two"

    # A bounded read ends on a message boundary, but never returns nothing.
    result = store.read("events", 0, max_bytes=10)
    assert (b"".join(result.chunks), result.end) == (b'[1,"two"]', 8)
    result = store.read("events", 8, max_bytes=2)
    assert (b"".join(result.chunks), result.end) == (b'[{"three":[3]}]', 22)


def test_a_large_read_sends_the_cached_segment_s_bytes_uncopied(make_store: MakeStore) -> None:
    """Copies of megabytes per answer took a catch-up read of 50 MB from about 1,850 to
    1,080 MB/s (bench/README.md, "Figures behind the code"); a small read still closes
    its array in one chunk, one send."""
    store = make_store()
    store.create("big", CreateRequest(JSON))
    values = [f"message {n:06d}" for n in range(20_000)]
    append_json(store, "big", *values)
    chunks = list(store.read("big", 0).chunks)
    assert orjson.loads(b"".join(chunks)) == values
    large = [chunk for chunk in chunks if len(chunk) > SMALL_CHUNK_BYTES]
    assert large and all(isinstance(chunk, memoryview) for chunk in large)

    store.create("small", CreateRequest(JSON))
    append_json(store, "small", 1, 2)
    assert [bytes(chunk) for chunk in store.read("small", 0).chunks] == [b"[", b"1,2]"]


def test_a_segment_is_indexed_by_its_writer_as_its_readers_would(make_store: MakeStore) -> None:
    state = StreamState(tail=27, producers={"p": (1, 4, 1765000000)}, producers_changed={"p"})
    data, index = encode_segment(
        20, b"1,2,3,4", positions([7]), positions([2, 4, 7]), state, token="t"
    )
    assert (index, state) == decode_header(data)
    assert index.ends_in(20, 27, messages=True) == [22, 24, 27]


def test_a_segment_written_by_an_older_release_reads_as_it_did() -> None:
    """Absolute ends as JSON numbers, producers without a time of last use."""
    header = orjson.dumps(
        {
            "start": 20, "end": 27, "appends": [27], "messages": [22, 24, 27],
            "closed": False, "producers": {"p": [1, 4]}, "closer": None,
            "stream_seq": "7", "payload_crc": zlib.crc32(b"1,2,3,4"),
            "written_at": 1765000000.5, "token": "t",
        }
    )  # fmt: skip
    data = PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header + b"1,2,3,4"
    index, state = decode_header(data)
    assert index.ends_in(20, 27, messages=True) == [22, 24, 27]
    assert (index.append_around(22), index.start_around(23, messages=True)) == ((20, 27), 22)
    assert (state.producers, state.producer_snapshot, state.stream_seq) == (
        {"p": (1, 4, 1765000000)}, None, "7",
    )  # fmt: skip


def segment_per_message(make_store: MakeStore, *, messages: int, indexes_kept: int) -> StreamStore:
    """A JSON stream "events" holding 0, 1, … in one segment each, whose store keeps about
    `indexes_kept` segment indexes: a read must read the others' from storage."""
    # Each index is about 250 bytes; the cache holds none larger than an eighth of it.
    store = make_store(index_cache_bytes=250 * max(indexes_kept, 8))
    store.create("events", CreateRequest(JSON))
    for number in range(messages):
        append_json(store, "events", number)
    store.pieces.indexes = ObjectCache(store.pieces.indexes.capacity_bytes)  # as after a busy while
    return store


def test_json_boundaries_hold_once_old_segment_indexes_are_forgotten(
    make_store: MakeStore,
) -> None:
    store = segment_per_message(make_store, messages=30, indexes_kept=4)
    capacity = store.pieces.indexes.capacity_bytes
    assert read_all(store, "events") == b"[" + b",".join(b"%d" % n for n in range(30)) + b"]"
    assert read_all(store, "events", 2).startswith(b"[1,2,3,")
    assert read_all(store, "events", 1).startswith(b"[0,1,2,")  # inside the first message
    assert 0 < store.pieces.indexes.size_bytes <= capacity


def compact_when_reading(store: StreamStore, path: str, at: int) -> list[int]:
    """Pack the stream's pieces in the middle of the first index read of the piece at `at`.

    Returns a list that holds the number of pieces before packing once it happened.
    Reading an index yields on S3, and compaction may swap the pieces meanwhile.
    """
    handle, read_segment = store._streams[path], store.pieces.read_segment
    packed: list[int] = []

    def reading(stream: object, start: int, **options: bool) -> object:
        found = read_segment(stream, start, **options)
        if not packed and start == at:
            packed.append(len(handle.starts))
            store.pieces.read_segment = read_segment  # type: ignore[method-assign]
            compaction._compact(store.pieces, handle)
            store.pieces.read_segment = reading  # type: ignore[method-assign]
        return found

    store.pieces.read_segment = reading  # type: ignore[method-assign]
    return packed


@pytest.mark.parametrize("packed_at", [0, 2], ids=["the piece read", "a piece read before"])
def test_a_read_whole_while_compaction_packs_the_segments_it_reads(
    make_store: MakeStore, packed_at: int
) -> None:
    """Packed at the piece being read, its key names the pack once the index read returns;
    packed after a piece was read, the list of pieces the read walks changes under it.
    All but the last piece are packed.
    """
    store = segment_per_message(make_store, messages=12, indexes_kept=2)
    packed = compact_when_reading(store, "events", packed_at)
    assert read_all(store, "events") == b"[0,1,2,3,4,5,6,7,8,9,10,11]"
    assert packed and len(store._streams["events"].starts) < packed[0]


def test_a_read_ends_on_a_message_while_compaction_packs_the_pieces_it_looks_at(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Looking back for the last whole message within the limit reads indexes too."""
    # Messages 0..9 take 2 bytes each ("0,"), 10..12 take 3.
    store = segment_per_message(make_store, messages=13, indexes_kept=2)
    packed = compact_when_reading(store, "events", 20)  # message 10, which the limit cuts
    result = store.read("events", 0, max_bytes=21)
    assert (b"".join(result.chunks), result.end) == (b"[0,1,2,3,4,5,6,7,8,9]", 20)
    assert packed and len(store._streams["events"].starts) < packed[0]


def reader_of_an_append_it_has_not_seen(storage_url: str, make_store: MakeStore) -> StreamStore:
    """A store that read "log" ("0"), on local disk, before another store appended "1"."""
    if storage_url.startswith("s3://"):
        pytest.skip("an object in a bucket is durable once it exists")
    writer_store, reader_store = make_store(), make_store()
    writer_store.create("log", CreateRequest(TEXT, payload=Payload(b"0")))
    assert read_all(reader_store, "log") == b"0"
    append_text(writer_store, "log", b"1")
    return reader_store


def test_another_stores_segment_is_made_durable_before_a_reader_takes_it_in(
    storage_url: str, make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its writer syncs data and link only after the link: a crash in between would take
    back what a reader had served, if the reader did not sync them first."""
    reader_store = reader_of_an_append_it_has_not_seen(storage_url, make_store)
    handle, synced = reader_store._streams["log"], []

    def sync_published(directory: str) -> None:
        synced.append((directory, handle.state.tail))

    monkeypatch.setattr(localdisk, "sync_published", sync_published)
    assert read_all(reader_store, "log") == b"01"
    segments = os.path.dirname(reader_store.objects.path(handle.segment_key(1)))
    assert synced == [(segments, 1)]  # synced while the reader's tail was still 1


def test_a_segment_that_cannot_be_made_durable_is_not_served(
    storage_url: str, make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing sync is storage failing: serve what is known, claim no more."""
    reader_store = reader_of_an_append_it_has_not_seen(storage_url, make_store)

    def failing_sync(directory: str) -> None:
        raise OSError(errno.EIO, "input/output error", directory)

    monkeypatch.setattr(localdisk, "sync_published", failing_sync)
    result = reader_store.read("log", 0)
    assert (b"".join(result.chunks), result.up_to_date) == (b"0", False)


def test_forks_read_their_source_up_to_the_fork_point(make_store: MakeStore) -> None:
    store = make_store()
    store.create("source", CreateRequest(TEXT, payload=Payload(b"abc")))
    append_text(store, "source", b"def")
    created, info = store.create("fork", CreateRequest("", fork_source="source", fork_offset=3))
    assert (created, info.tail, info.content_type) == (True, 3, TEXT)
    append_text(store, "fork", b"XYZ")
    append_text(store, "source", b"ghi")
    assert read_all(store, "fork") == b"abcXYZ"
    assert read_all(store, "fork", 3) == b"XYZ"
    assert read_all(store, "fork", 2) == b"abcXYZ"  # inside an append: from its start
    assert read_all(store, "source") == b"abcdefghi"

    # A sub-offset forks part-way into the append that starts at the fork offset.
    store.create(
        "partial", CreateRequest("", fork_source="source", fork_offset=3, fork_sub_offset=2)
    )
    assert read_all(store, "partial") == b"abcde"
    whole = store.read("partial", None)  # the part of an append it holds ends a read
    assert (b"".join(whole.chunks), whole.end, whole.up_to_date) == (b"abcde", 5, True)
    assert read_all(store, "partial", 4) == b"de"  # the part of "def" the fork holds
    # A fork of a fork reads through both.
    store.create("grandchild", CreateRequest("", fork_source="fork", fork_offset=5))
    append_text(store, "grandchild", b"!")
    assert read_all(store, "grandchild") == b"abcXY!"


# -- hostile names, producers and forks (security review) ----------------------------------

LONG_PATH = "private/a/" + "x" * 300  # too long to encode: its key is hashed


def test_no_short_path_names_the_storage_of_a_long_one(make_store: MakeStore) -> None:
    store = make_store()
    store.create(LONG_PATH, CreateRequest(TEXT, payload=Payload(b"secret")))
    digest = hashlib.sha256(LONG_PATH.encode()).hexdigest()
    for alias in ("~" + digest, "%h" + digest, "%25h" + digest):
        with pytest.raises(StreamNotFound):
            store.read(alias, None)
        store.create(alias, CreateRequest(TEXT, payload=Payload(b"mine")))
        assert read_all(store, alias) == b"mine"
        store.delete(alias)
    assert read_all(make_store(), LONG_PATH) == b"secret"
    assert LONG_PATH in set(make_store().paths())  # deleted ones may linger in a listing


def move_to_legacy_key(storage_url: str, path: str) -> str:
    """Move a long path's folder to the name releases before 2026-12-06 gave it."""
    objects = open_objects(storage_url)
    legacy = streams.legacy_stream_key(path)
    assert legacy is not None
    old, new = objects.path(f"streams/{stream_key(path)}"), objects.path(f"streams/{legacy}")
    if objects.is_local:
        os.rename(old, new)
        return legacy
    for name in objects.filesystem.find(old):  # read and write: s3fs's copies mangle '%'
        objects.filesystem.pipe_file(new + name[len(old) :], objects.filesystem.cat_file(name))
    objects.filesystem.rm(old, recursive=True)
    return legacy


def test_a_long_path_an_older_release_wrote_stays_its_own(
    make_store: MakeStore, storage_url: str
) -> None:
    store = make_store()
    store.create(LONG_PATH, CreateRequest(TEXT, payload=Payload(b"old ")))
    legacy = move_to_legacy_key(storage_url, LONG_PATH)
    store = make_store()
    assert read_all(store, LONG_PATH) == b"old "
    append_text(store, LONG_PATH, b"and new")
    assert read_all(make_store(), LONG_PATH) == b"old and new"
    assert list(make_store().paths()) == [LONG_PATH]
    # The short path the old name spells is no way in, and cannot be created over it.
    with pytest.raises(StreamNotFound):
        store.read(legacy, None)
    with pytest.raises(StreamConflict):
        store.create(legacy, CreateRequest(TEXT))
    assert store.create(LONG_PATH, CreateRequest(TEXT))[0] is False  # the old one, as is
    store.delete(LONG_PATH)
    with pytest.raises(StreamNotFound):
        make_store().read(LONG_PATH, None)


def test_a_small_append_writes_a_bounded_part_of_the_producer_table(
    make_store: MakeStore, storage_url: str
) -> None:
    store = make_store()
    store.create("crowd", CreateRequest(TEXT))
    ids = [f"{n:03d}-" + "p" * (streams.MAX_PRODUCER_ID_BYTES - 4) for n in range(300)]
    for producer_id in ids:
        append_text(store, "crowd", b"x", producer=Producer(producer_id, 0, 0))
    tail = store.head("crowd").tail
    append_text(store, "crowd", b"y", producer=Producer(ids[0], 0, 1))
    objects, handle = open_objects(storage_url), store._streams["crowd"]
    sizes = [len(objects.read(handle.segment_key(start))) for start in range(tail + 1)]
    # The table is 90 KB; every segment carries at most the changes since a snapshot.
    assert max(sizes) < commits.PRODUCER_CHANGES_BYTES + 2 * streams.PRODUCER_ENTRY_BYTES + 1024

    restarted = make_store()  # state from the last segment and the snapshot it names
    assert append_text(restarted, "crowd", b"z", producer=Producer(ids[7], 0, 0)).duplicate
    assert not append_text(restarted, "crowd", b"z", producer=Producer(ids[7], 0, 1)).duplicate
    with pytest.raises(ProducerGap):
        append_text(restarted, "crowd", b"z", producer=Producer(ids[0], 0, 3))
    assert read_all(restarted, "crowd") == b"x" * 300 + b"yz"


def test_idle_and_surplus_producers_are_forgotten_oldest_first() -> None:
    now = 2_000_000_000.0
    idle = now - commits.PRODUCER_IDLE_SECONDS - 1
    producers = {"idle": (0, 5, int(idle))}
    producers.update({f"p{n}": (0, n, int(now) - n) for n in range(commits.MAX_PRODUCERS + 2)})
    commits._forget_producers(producers, now)
    assert len(producers) == commits.MAX_PRODUCERS
    assert "idle" not in producers and "p0" in producers
    assert f"p{commits.MAX_PRODUCERS}" not in producers  # the two used longest ago


def test_forks_of_forks_go_only_so_deep(make_store: MakeStore) -> None:
    store = make_store()
    store.create("f0", CreateRequest(TEXT, payload=Payload(b"a")))
    for depth in range(1, streams.MAX_FORK_DEPTH + 1):
        store.create(f"f{depth}", CreateRequest("", fork_source=f"f{depth - 1}"))
    with pytest.raises(InvalidRequest):
        store.create("too-deep", CreateRequest("", fork_source=f"f{streams.MAX_FORK_DEPTH}"))
    assert read_all(make_store(), f"f{streams.MAX_FORK_DEPTH}") == b"a"


def test_a_chain_too_deep_to_load_fails_alone(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chains an older release let grow deeper than the limit: that stream alone fails."""
    store = make_store()
    store.create("g0", CreateRequest(TEXT, payload=Payload(b"a")))
    for depth in range(1, 6):
        store.create(f"g{depth}", CreateRequest("", fork_source=f"g{depth - 1}"))
    monkeypatch.setattr(storage, "MAX_FORK_DEPTH", 3)
    fresh = make_store()
    with pytest.raises(StreamConflict):
        fresh.read("g5", None)
    assert read_all(fresh, "g3") == b"a"
    assert sorted(fresh.paths()) == [f"g{depth}" for depth in range(6)]
    fresh.sweep()  # goes past the one it cannot load


def test_a_json_fork_is_never_cut_inside_a_message(make_store: MakeStore) -> None:
    store = make_store()
    store.create("doc", CreateRequest(JSON))
    append_json(store, "doc", {"a": 1}, {"b": 2})
    with pytest.raises(InvalidRequest):
        store.create("cut", CreateRequest("", fork_source="doc", fork_offset=3))
    store.create("whole", CreateRequest("", fork_source="doc", fork_offset=8))
    append_json(store, "whole", 3)
    assert orjson.loads(read_all(store, "whole")) == [{"a": 1}, 3]


def test_a_batch_of_many_large_appends_commits_in_bounded_segments(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, storage_url: str
) -> None:
    monkeypatch.setattr(commits, "MAX_SEGMENT_BYTES", 1000)
    store = make_store()
    store.create("big", CreateRequest(TEXT))
    pieces = [bytes([65 + n]) * 400 for n in range(10)]
    gevent.joinall(
        [gevent.spawn(append_text, store, "big", piece) for piece in pieces], raise_error=True
    )
    assert sorted(read_all(store, "big")[i : i + 400] for i in range(0, 4000, 400)) == pieces
    objects = open_objects(storage_url)
    handle = store._streams["big"]
    sizes = [decode_header(objects.read(handle.piece_key(start)))[0] for start in handle.starts]
    assert all(index.end - index.start <= 1000 for index in sizes), sizes


def test_close_is_final_and_idempotent(make_store: MakeStore) -> None:
    store = make_store()
    store.create("log", CreateRequest(TEXT))
    append_text(store, "log", b"last words")
    result = store.append("log", AppendRequest(TEXT, Payload(b"."), close=True))
    assert (result.info.tail, result.info.closed) == (11, True)

    with pytest.raises(StreamClosed) as closed:
        append_text(store, "log", b"more")
    assert closed.value.tail == 11
    again = store.append("log", AppendRequest(None, None, close=True))
    assert again.duplicate and again.info.closed
    assert store.wait("log", 11, WAIT_TIMEOUT_SECONDS).closed  # answers at once
    assert read_all(store, "log") == b"last words."
    # A stream can also be created closed.
    store.create("sealed", CreateRequest(TEXT, closed=True, payload=Payload(b"x")))
    assert store.head("sealed").closed


def test_a_conditional_append_is_checked_against_the_tail_its_batch_planned(
    make_store: MakeStore,
) -> None:
    """Two appends naming one tail wait behind a commit and form one batch with a plain
    one: the first lands, the second fails at the tail the first planned, though neither
    was written yet when the batch was checked, and its 412 names the tail the whole
    batch left (the current one when it is answered), not the one it was checked at."""
    store = make_store()
    store.create("log", CreateRequest(TEXT))
    handle, create = store._streams["log"], store.objects.create
    segments, landing, release = [], Event(), Event()

    def creating(key: str, data: bytes, **options: bool) -> None:
        segments.append(key)
        landing.set()
        release.wait()  # the first commit is held until both appends wait behind it
        create(key, data, **options)

    store.objects.create = creating  # type: ignore[method-assign]
    first = gevent.spawn(append_text, store, "log", b"first;")
    assert landing.wait(WAIT_TIMEOUT_SECONDS)
    named = len(b"first;")
    # One at a time, each queued before the next is sent: on S3 opening the stream may
    # ask storage, and appends sent together could queue in any order.
    second = queued(handle, gevent.spawn(append_text, store, "log", b"second;", if_match=named))
    third = queued(handle, gevent.spawn(append_text, store, "log", b"third;", if_match=named))
    fourth = queued(handle, gevent.spawn(append_text, store, "log", b"fourth;"))
    release.set()
    assert first.get(timeout=WAIT_TIMEOUT_SECONDS).info.tail == named
    assert second.get(timeout=WAIT_TIMEOUT_SECONDS).info.tail == len(b"first;second;")
    stored = b"first;second;fourth;"
    assert fourth.get(timeout=WAIT_TIMEOUT_SECONDS).info.tail == len(stored)
    with pytest.raises(PreconditionFailed) as failed:
        third.get(timeout=WAIT_TIMEOUT_SECONDS)
    assert (failed.value.tail, failed.value.closed) == (len(stored), False)
    assert len(segments) == 2, segments  # the first append's, then the batch's
    assert read_all(store, "log") == stored


def queued(handle: Stream, appending: gevent.Greenlet) -> gevent.Greenlet:
    """`appending`, once its append waits in the stream's queue."""
    waiting = len(handle.pending) + 1
    deadline = time.monotonic() + WAIT_TIMEOUT_SECONDS
    while len(handle.pending) < waiting:
        assert time.monotonic() < deadline, "the append never queued"
        gevent.sleep(0.01)
    return appending


def test_conditional_appends_rank_after_closure_and_type_before_producers_and_seq(
    make_store: MakeStore,
) -> None:
    store = make_store()
    store.create("log", CreateRequest(TEXT))
    tail = append_text(store, "log", b"ab", stream_seq="5").info.tail
    with pytest.raises(StreamConflict):  # the content type first
        store.append("log", AppendRequest(JSON, messages(1), if_match=0))
    with pytest.raises(InvalidRequest):  # If-Match and a producer cannot go together
        append_text(store, "log", b"c", if_match=0, producer=Producer("p", 0, 5))
    with pytest.raises(PreconditionFailed) as stale:  # before the Stream-Seq conflict
        append_text(store, "log", b"c", if_match=0, stream_seq="1")
    assert stale.value.tail == tail
    with pytest.raises(StreamConflict):
        append_text(store, "log", b"c", if_match=tail, stream_seq="1")
    closed = store.append("log", AppendRequest(None, None, close=True, if_match=tail))
    assert (closed.info.tail, closed.info.closed) == (tail, True)
    with pytest.raises(StreamClosed):  # closure before a stale If-Match
        append_text(store, "log", b"c", if_match=0)
    with pytest.raises(PreconditionFailed) as stale_close:  # a close again, named stale
        store.append("log", AppendRequest(None, None, close=True, if_match=0))
    assert (stale_close.value.tail, stale_close.value.closed) == (tail, True)
    again = store.append("log", AppendRequest(None, None, close=True, if_match=tail))
    assert again.duplicate and again.info.closed
    assert read_all(store, "log") == b"ab"


def test_producer_appends_are_deduplicated(make_store: MakeStore) -> None:
    store = make_store()
    store.create("produced", CreateRequest(TEXT))
    assert not produce(store, "produced", b"a", 0, 0).duplicate
    assert not produce(store, "produced", b"b", 0, 1).duplicate
    retry = produce(store, "produced", b"b", 0, 1)
    assert retry.duplicate and retry.producer == Producer("producer-1", 0, 1)
    with pytest.raises(ProducerGap) as gap:
        produce(store, "produced", b"d", 0, 3)
    assert (gap.value.expected, gap.value.received) == (2, 3)
    assert not produce(store, "produced", b"c", 1, 0).duplicate  # a new epoch restarts at 0
    with pytest.raises(ProducerFenced) as fenced:
        produce(store, "produced", b"x", 0, 2)
    assert fenced.value.current_epoch == 1
    with pytest.raises(InvalidRequest):
        produce(store, "produced", b"x", 2, 1)
    assert read_all(store, "produced") == b"abc"


def test_stream_seq_must_increase(make_store: MakeStore) -> None:
    store = make_store()
    store.create("seq", CreateRequest(TEXT))
    append_text(store, "seq", b"1", stream_seq="09")
    append_text(store, "seq", b"2", stream_seq="10")
    with pytest.raises(StreamConflict):
        append_text(store, "seq", b"3", stream_seq="10")
    assert read_all(store, "seq") == b"12"


def test_delete_then_recreate_starts_empty(make_store: MakeStore) -> None:
    store = make_store()
    store.create("doomed", CreateRequest(TEXT, payload=Payload(b"old")))
    old = store.head("doomed").incarnation
    store.delete("doomed")
    with pytest.raises(StreamNotFound):
        store.read("doomed", None)
    with pytest.raises(StreamNotFound):
        append_text(store, "doomed", b"x")
    with pytest.raises(StreamNotFound):
        store.delete("doomed")
    created, info = store.create("doomed", CreateRequest(TEXT))
    assert created and info.tail == 0 and info.incarnation != old
    append_text(store, "doomed", b"new")
    assert read_all(store, "doomed") == b"new"


def test_deleted_and_expired_streams_leave_no_objects(make_store: MakeStore) -> None:
    store = make_store()
    store.create("deleted", CreateRequest(TEXT, payload=Payload(b"gone soon")))
    prefix = f"streams/deleted/{store.head('deleted').incarnation}"
    store.delete("deleted")
    assert store.objects.list(f"{prefix}/seg") == []
    assert not store.objects.exists("streams/deleted/meta.json")

    store.create("expiring", CreateRequest(TEXT, ttl=1, payload=Payload(b"brief")))
    prefix = f"streams/expiring/{store.head('expiring').incarnation}"
    gevent.sleep(1.2)
    with pytest.raises(StreamNotFound):
        store.read("expiring", None)  # touching an expired stream removes it
    assert store.objects.list(f"{prefix}/seg") == []
    assert not store.objects.exists("streams/expiring/meta.json")


def test_a_sweep_deletes_expired_streams_nobody_touches(make_store: MakeStore) -> None:
    store = make_store()
    store.create("lapsed", CreateRequest(TEXT, ttl=1, payload=Payload(b"brief")))
    store.create("lasting", CreateRequest(TEXT, ttl=3600, payload=Payload(b"kept")))
    store.create("plain", CreateRequest(TEXT, payload=Payload(b"kept")))
    prefix = f"streams/lapsed/{store.head('lapsed').incarnation}"
    gevent.sleep(1.2)
    other_node = make_store()  # it never opened "lapsed": only the sweep finds it
    other_node.sweep()
    assert other_node.objects.list(f"{prefix}/seg") == []
    assert not other_node.objects.exists("streams/lapsed/meta.json")
    with pytest.raises(StreamNotFound):
        store.head("lapsed")
    assert read_all(other_node, "lasting") == b"kept"
    assert read_all(other_node, "plain") == b"kept"


def test_a_sweep_removes_folders_no_stream_uses_once_old(
    make_store: MakeStore, storage_url: str
) -> None:
    """A writer that raced a delete left a segment in the deleted stream's folder."""
    if storage_url.startswith("s3://"):
        pytest.skip("object stores have no folders with an age")
    store = make_store()
    store.create("log", CreateRequest(TEXT, payload=Payload(b"old")))
    deleted = store._checked_handle("log")
    store.delete("log")
    store.create("log", CreateRequest(TEXT, payload=Payload(b"new")))
    old_leftover, young_leftover = f"{deleted.prefix}/seg", "streams/log/0123456789abcdef/seg"
    for folder in (old_leftover, young_leftover):
        store.objects.create(f"{folder}/{streams.segment_name(3)}", b"raced")
    an_hour_ago = time.time() - 3600
    os.utime(store.objects.path(deleted.prefix), (an_hour_ago, an_hour_ago))
    store.sweep()
    kept = ["meta.json", "0123456789abcdef", store.head("log").incarnation]
    assert sorted(store.objects.list("streams/log")) == sorted(kept)
    assert read_all(store, "log") == b"new"


def test_deleting_a_forked_source_keeps_it_for_its_forks(make_store: MakeStore) -> None:
    store = make_store()
    store.create("origin", CreateRequest(TEXT, payload=Payload(b"shared")))
    store.create("copy", CreateRequest("", fork_source="origin"))
    store.delete("origin")
    with pytest.raises(StreamGone):
        store.read("origin", None)
    with pytest.raises(StreamConflict):
        store.create("origin", CreateRequest(TEXT))
    assert read_all(store, "copy") == b"shared"
    store.delete("copy")  # the last fork: the source goes with it
    with pytest.raises(StreamNotFound):
        store.read("origin", None)
    assert store.create("origin", CreateRequest(TEXT))[0]


# -- a second store on the same root (a second node) ---------------------------------------


def nothing() -> None:
    pass


def around(
    store: StreamStore,
    method: str,
    key: str,
    *,
    before: Action = nothing,
    after: Action = nothing,
    whole: bool = False,
) -> None:
    """Run `before` and `after` around the first call of `store.objects.<method>` on a key
    starting with `key` (with `whole`, the first without a byte range): another node
    acting in between."""
    original = getattr(store.objects, method)

    def call(wanted: str, *arguments: object, **options: object) -> object:
        if not wanted.startswith(key) or (whole and arguments):
            return original(wanted, *arguments, **options)
        setattr(store.objects, method, original)
        before()
        try:
            return original(wanted, *arguments, **options)
        finally:
            after()

    setattr(store.objects, method, call)


def two_segments_a_second_store_has_not_seen(
    make_store: MakeStore,
) -> tuple[StreamStore, StreamStore, str]:
    """The store that wrote "log" ("0", then "1"), a second one, and the last segment's key."""
    first, second = make_store(), make_store()
    first.create("log", CreateRequest(TEXT, payload=Payload(b"0")))
    append_text(first, "log", b"1")
    return first, second, first._streams["log"].segment_key(1)


def test_a_stream_deleted_while_a_second_store_loads_it_is_not_found(
    make_store: MakeStore,
) -> None:
    """Loading lists the pieces, then reads the last: another node may delete it between."""
    first, second, last_segment = two_segments_a_second_store_has_not_seen(make_store)
    around(second, "read", last_segment, before=lambda: first.delete("log"))
    with pytest.raises(StreamNotFound):
        second.delete("log")


def test_a_stream_deleted_by_another_store_while_a_read_looks_up_its_pieces_is_not_found(
    make_store: MakeStore,
) -> None:
    """The handle was checked when the read began; the first segment's index is read after."""
    first, second, _ = two_segments_a_second_store_has_not_seen(make_store)
    first_segment = first._streams["log"].segment_key(0)
    around(second, "read", first_segment, before=lambda: first.delete("log"))
    with pytest.raises(StreamNotFound):
        second.read("log", 0)


def test_a_stream_listed_while_another_store_deletes_its_pieces_is_not_found(
    make_store: MakeStore,
) -> None:
    """A delete removes meta.json, then the pieces one by one: a listing taken meanwhile
    misses some, and the gap it leaves is the stream being deleted, not storage failing."""
    first, second, _ = two_segments_a_second_store_has_not_seen(make_store)
    append_text(first, "log", b"2")
    handle = first._streams["log"]
    middle_segment = handle.segment_key(1)

    def delete_under_way() -> None:
        first.objects.delete(streams.meta_key("log"))
        first.objects.delete_many([middle_segment])

    around(second, "list", f"{handle.prefix}/seg", before=delete_under_way)
    with pytest.raises(StreamNotFound):
        second.read("log", 0)


def test_a_stream_deleted_before_a_read_takes_its_first_bytes_is_not_found(
    make_store: MakeStore,
) -> None:
    """The rest of a long read is read as it is sent, but its first piece before it starts:
    the answer to a read of one piece is whole or a 404, never cut."""
    first, second, _ = two_segments_a_second_store_has_not_seen(make_store)
    first_segment = first._streams["log"].segment_key(0)
    around(second, "read", first_segment, before=lambda: first.delete("log"), whole=True)
    with pytest.raises(StreamNotFound):
        second.read("log", 0, max_bytes=1)


def test_a_last_segment_dropped_while_a_second_store_loads_it_leaves_the_one_before(
    make_store: MakeStore,
) -> None:
    """A node that found the last segment torn removes it: what stays is the stream."""
    first, second, last_segment = two_segments_a_second_store_has_not_seen(make_store)
    around(second, "read", last_segment, before=lambda: first.objects.delete_many([last_segment]))
    assert read_all(second, "log") == b"0"


@pytest.mark.parametrize("forked", [False, True])
def test_a_stream_deleted_by_another_store_as_it_is_created_was_created(
    make_store: MakeStore, forked: bool
) -> None:
    """Another node's DELETE may land between the create and its answer (a soft delete if
    that node forked the stream first): still a 201."""
    first, second = make_store(), make_store()

    def fork_and_delete() -> None:
        if forked:
            second.create("fork", CreateRequest("", fork_source="log"))
        second.delete("log")

    around(first, "create", streams.meta_key("log"), after=fork_and_delete)
    created, info = first.create("log", CreateRequest(TEXT, payload=Payload(b"abc")))
    assert (created, info.tail) == (True, 3)
    with pytest.raises(StreamGone if forked else StreamNotFound):
        first.head("log")


def test_a_create_that_lost_to_a_stream_deleted_meanwhile_creates_it_after_all(
    make_store: MakeStore,
) -> None:
    """Another node created the stream first, then deleted it before this create could
    confirm it: a PUT means "make sure it exists", so this one creates it."""
    first, second = make_store(), make_store()
    meta = streams.meta_key("log")
    around(
        first,
        "create",
        meta,
        before=lambda: second.create("log", CreateRequest(TEXT)),
        after=lambda: second.delete("log"),
    )
    created, info = first.create("log", CreateRequest(TEXT, payload=Payload(b"abc")))
    assert (created, info.tail) == (True, 3)
    assert read_all(second, "log") == b"abc"


# -- forks being created or deleted while another store deletes their source --------------


def two_stores_knowing_a_source(make_store: MakeStore) -> tuple[StreamStore, StreamStore, str]:
    """Two stores that have both opened "source" ("data"), and its key prefix."""
    first, second = make_store(), make_store()
    first.create("source", CreateRequest(TEXT, payload=Payload(b"data")))
    second.head("source")
    return first, second, first._streams["source"].prefix


def assert_freed(store: StreamStore, prefix: str, *paths: str) -> None:
    """`paths` are not found, nothing under the source's `prefix` names a fork, and a PUT
    at each path creates a new stream (a soft-deleted one would answer 409)."""
    assert store.objects.list(f"{prefix}/forks") == []
    for path in paths:
        with pytest.raises(StreamNotFound):
            store.head(path)
        assert store.create(path, CreateRequest(TEXT))[0]


def test_a_fork_whose_source_another_store_deletes_before_it_is_marked_is_refused(
    make_store: MakeStore,
) -> None:
    """The delete listed the source's forks before this fork wrote its marker."""
    first, second, prefix = two_stores_knowing_a_source(make_store)
    around(first, "create", f"{prefix}/forks/", before=lambda: second.delete("source"))
    with pytest.raises(StreamConflict):
        first.create("fork", CreateRequest("", fork_source="source"))
    assert_freed(make_store(), prefix, "source", "fork")


def test_a_fork_that_sees_its_source_being_deleted_gives_it_up(make_store: MakeStore) -> None:
    """The delete saw the fork's marker and soft-deleted the source; the fork, seeing the
    delete, is refused and frees the source it alone kept."""
    first, second, prefix = two_stores_knowing_a_source(make_store)
    around(first, "exists", f"{prefix}/deleting", before=lambda: second.delete("source"))
    with pytest.raises(StreamConflict):
        first.create("fork", CreateRequest("", fork_source="source"))
    assert_freed(make_store(), prefix, "source", "fork")


def test_a_source_deleted_after_its_fork_passed_the_check_is_kept_for_it(
    make_store: MakeStore,
) -> None:
    """The delete finds the marker of a fork whose meta.json is not written yet."""
    first, second, prefix = two_stores_knowing_a_source(make_store)
    around(first, "create", "streams/fork/meta.json", before=lambda: second.delete("source"))
    assert first.create("fork", CreateRequest("", fork_source="source"))[0]
    third = make_store()
    with pytest.raises(StreamGone):
        third.head("source")
    assert read_all(third, "fork") == b"data"
    third.delete("fork")
    assert_freed(make_store(), prefix, "source")


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_source_whose_last_fork_goes_while_it_is_deleted_is_freed(
    make_store: MakeStore, when: str
) -> None:
    """The fork goes while the delete writes the source's `gone` marker."""
    first, second, prefix = two_stores_knowing_a_source(make_store)
    first.create("fork", CreateRequest("", fork_source="source"))
    second.head("fork")
    around(first, "create", f"{prefix}/gone", **{when: lambda: second.delete("fork")})
    first.delete("source")
    assert_freed(make_store(), prefix, "source", "fork")


def soft_deleted_source_with_a_fork(make_store: MakeStore) -> StreamStore:
    """The store that created "source" ("data"), forked it as "fork", then deleted it."""
    first = make_store()
    first.create("source", CreateRequest(TEXT, payload=Payload(b"data")))
    first.create("fork", CreateRequest("", fork_source="source"))
    first.delete("source")  # soft: kept for the fork
    return first


@pytest.mark.parametrize("source_after", ["created again", "gone"])
def test_a_fork_deleted_while_a_store_loads_it_is_not_found(
    make_store: MakeStore, source_after: str
) -> None:
    """Loading a fork reads its meta.json, then looks up its source. In between another
    node deletes the fork, which frees its soft-deleted source, and may create the source
    again: the fork is not found (a PUT creates it anew), rather than a 503 that says
    storage lost its source."""
    first = soft_deleted_source_with_a_fork(make_store)

    def delete_fork() -> None:
        first.delete("fork")
        if source_after == "created again":
            first.create("source", CreateRequest(TEXT))

    second = make_store()
    around(second, "identity", "streams/source/meta.json", before=delete_fork)
    with pytest.raises(StreamNotFound, match="stream fork "):
        second.head("fork")


def test_a_fork_whose_source_storage_lost_is_unavailable(make_store: MakeStore) -> None:
    """A source goes only after its forks: a fork still there without its source says
    storage lost data (503), not that the fork is not found."""
    first = soft_deleted_source_with_a_fork(make_store)
    first.objects.delete("streams/source/meta.json")
    with pytest.raises(StorageUnavailable, match="fork source source is missing"):
        make_store().head("fork")


def test_concurrent_creates_of_one_fork_keep_the_winner_s_marker(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loser of the race for the fork's meta.json removes its own marker only."""
    first, second, prefix = two_stores_knowing_a_source(make_store)
    fork = CreateRequest("", fork_source="source")
    around(first, "create", f"{prefix}/forks/", before=lambda: second.create("fork", fork))
    assert first.create("fork", fork)[0] is False
    monkeypatch.setattr(lifecycle, "FORK_MARKER_SECONDS", 0.0)  # only a live fork keeps it
    first.delete("source")
    third = make_store()
    with pytest.raises(StreamGone):
        third.head("source")
    assert read_all(third, "fork") == b"data"


def test_a_sweep_frees_a_source_kept_for_a_fork_that_never_came(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork's creator that died after marking its source left only the marker."""
    store, _, prefix = two_stores_knowing_a_source(make_store)
    store.objects.create(f"{prefix}/forks/fork+0123456789abcdef", b"")
    store.delete("source")
    store.sweep()
    with pytest.raises(StreamGone):
        store.head("source")  # the marker is young: that fork may still come
    monkeypatch.setattr(lifecycle, "FORK_MARKER_SECONDS", 0.0)
    make_store().sweep()
    assert_freed(make_store(), prefix, "source")


def test_a_fork_created_as_another_store_trims_its_source_starts_at_the_trim(
    make_store: MakeStore,
) -> None:
    """Retention looked for forks before this fork marked the source, then trimmed it."""
    first, second, prefix = two_stores_knowing_a_source(make_store)
    append_text(first, "source", b"more")
    trimmed = second._checked_handle("source")
    around(
        first,
        "create",
        f"{prefix}/forks/",
        before=lambda: second.lifecycle.publish_trim(trimmed, 4),
    )
    first.create("fork", CreateRequest("", fork_source="source"))
    third = make_store()
    assert read_all(third, "fork") == b"more"
    with pytest.raises(OffsetTrimmed):
        third.read("fork", 0)


@pytest.mark.parametrize(("when", "fork_reads"), [("before", b"datamore"), ("after", b"more")])
def test_a_trim_that_finds_a_fork_created_meanwhile_is_not_published(
    make_store: MakeStore, when: str, fork_reads: bytes
) -> None:
    """Retention found no fork, then a fork was created before or after it wrote its
    intent: its second look finds the fork. A fork that saw the intent starts there."""
    first, second, prefix = two_stores_knowing_a_source(make_store)
    append_text(first, "source", b"more")
    fork = CreateRequest("", fork_source="source")
    creating = {when: lambda: first.create("fork", fork)}
    around(second, "create", f"{prefix}/trimming/", **creating)
    assert second.lifecycle.publish_trim(second._checked_handle("source"), 4) is False
    third = make_store()
    assert read_all(third, "fork") == fork_reads
    assert read_all(third, "source") == b"datamore"
    assert third.objects.list(f"{prefix}/trimming") == []


def test_a_trim_intent_left_by_a_crash_stops_counting_once_old(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention's process died between writing its intent and removing it."""
    store, _, prefix = two_stores_knowing_a_source(make_store)
    append_text(store, "source", b"more")
    store.objects.create(f"{prefix}/trimming/{streams.segment_name(4)}", b"")
    monkeypatch.setattr(lifecycle, "FORK_MARKER_SECONDS", 0.0)
    store.create("fork", CreateRequest("", fork_source="source"))
    assert read_all(make_store(), "fork") == b"datamore"


def test_a_read_from_the_start_while_retention_trims_starts_at_the_trim(
    make_store: MakeStore,
) -> None:
    """The read looks for news at the tail (a yield on S3) while retention, in the same
    process, trims: it starts at the new earliest offset, not at the one it opened."""
    store = make_store()
    store.create("log", CreateRequest(TEXT, payload=Payload(b"data")))
    append_text(store, "log", b"more")
    handle = store._checked_handle("log")

    def trim() -> None:  # what retention.py does after publishing
        assert store.lifecycle.publish_trim(handle, 4)
        handle.starts, handle.earliest = [4], 4

    around(store, "may_exist", handle.segment_key(8), before=trim)
    assert read_all(store, "log") == b"more"


def test_a_pack_that_another_store_trims_through_serves_the_rest(make_store: MakeStore) -> None:
    """One node packed segments [0, 6) while another, which had not seen the pack, trimmed
    the stream at 2. Once each has removed what it replaced or trimmed, only the pack
    holds [2, 6)."""
    packer, trimmer = make_store(), make_store()
    packer.create("log", CreateRequest(TEXT, payload=Payload(b"aa")))
    for data in (b"bb", b"cc", b"dd"):
        append_text(packer, "log", data)
    trimmed = trimmer._checked_handle("log")
    compaction._compact(packer.pieces, packer._streams["log"])
    assert trimmer.lifecycle.publish_trim(trimmed, 2)
    packer.objects.delete_many([trimmed.segment_key(start) for start in (0, 2, 4)])
    assert read_all(make_store(), "log") == b"bbccdd"


def test_packs_two_stores_made_over_each_other_serve_all_they_hold(
    make_store: MakeStore,
) -> None:
    """One node packed [0, 6) then [6, 12); another, which had seen neither, packed
    [0, 10). Once each has removed the segments it replaced, [10, 12) is only in the
    first node's second pack, which starts inside the other node's."""
    first, second = make_store(compact_max_segments=3), make_store(compact_max_segments=5)
    first.create("log", CreateRequest(TEXT, payload=Payload(b"aa")))
    for data in (b"bb", b"cc", b"dd", b"ee", b"ff", b"gg", b"hh"):
        append_text(first, "log", data)
    unaware = second._checked_handle("log")
    for _ in range(2):
        compaction._compact(first.pieces, first._streams["log"])
    compaction._compact(second.pieces, unaware)
    first.objects.delete_many([unaware.segment_key(start) for start in range(0, 12, 2)])
    assert read_all(make_store(), "log") == b"aabbccddeeffgghh"


def test_an_append_through_a_store_that_missed_another_store_s_close_is_refused(
    make_store: MakeStore,
) -> None:
    """A close is an empty segment at the tail: the append loses the race to create there,
    and must learn the stream is closed, not retry at the same tail until it gives up."""
    first, second = make_store(), make_store()
    first.create("log", CreateRequest(TEXT, payload=Payload(b"abc")))
    assert read_all(second, "log") == b"abc"
    first.append("log", AppendRequest(None, None, close=True))
    with pytest.raises(StreamClosed) as closed:
        append_text(second, "log", b"x")
    assert closed.value.tail == 3
    assert read_all(second, "log") == b"abc"


def test_a_second_store_sees_everything_the_first_wrote(make_store: MakeStore) -> None:
    first = make_store()
    expires = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    first.create("ttl", CreateRequest(TEXT, ttl=3600, payload=Payload(b"t")))
    first.create("expiring", CreateRequest(JSON, expires_at=expires))
    append_json(first, "expiring", {"n": 1}, {"n": 2})
    first.create("closed", CreateRequest(TEXT, payload=Payload(b"end")))
    first.append("closed", AppendRequest(None, None, close=True))
    first.create("produced", CreateRequest(TEXT))
    produce(first, "produced", b"a", 0, 0)
    produce(first, "produced", b"b", 0, 1)
    first.create("fork", CreateRequest("", fork_source="ttl"))
    append_text(first, "fork", b"+f")

    second = make_store()
    assert second.head("ttl") == first.head("ttl")
    assert second.head("ttl").ttl == 3600
    assert second.head("expiring").expires_at == first.head("expiring").expires_at
    assert datetime.fromisoformat(second.head("expiring").expires_at) == expires
    assert read_all(second, "expiring") == b'[{"n":1},{"n":2}]'
    assert read_all(second, "expiring", 8) == b'[{"n":2}]'
    closed = second.head("closed")
    assert (closed.closed, closed.tail) == (True, 3)
    with pytest.raises(StreamClosed):
        append_text(second, "closed", b"x")
    assert read_all(second, "fork") == b"t+f"
    assert second.head("fork").tail == 3

    # Producer state came from storage: a retry is a duplicate, a skip is a gap.
    assert produce(second, "produced", b"b", 0, 1).duplicate
    with pytest.raises(ProducerGap):
        produce(second, "produced", b"d", 0, 3)
    assert not produce(second, "produced", b"c", 0, 2).duplicate
    # The first store's cached state is stale now; storage corrects it.
    assert produce(first, "produced", b"c", 0, 2).duplicate
    assert not produce(first, "produced", b"d", 0, 3).duplicate
    assert produce(second, "produced", b"d", 0, 3).duplicate
    assert not produce(second, "produced", b"e", 1, 0).duplicate
    with pytest.raises(ProducerFenced):
        produce(first, "produced", b"x", 0, 4)
    assert read_all(first, "produced") == read_all(second, "produced") == b"abcde"

    # Deletes and re-creates made through one store are what the other sees.
    second.delete("closed")
    with pytest.raises(StreamNotFound):
        first.read("closed", None)
    first.create("closed", CreateRequest(JSON))
    assert second.head("closed").content_type == JSON


def stores_knowing_an_empty_stream(make_store: MakeStore, path: str) -> list[StreamStore]:
    """Two stores (two nodes), each with a handle on a new, empty text stream."""
    stores = [make_store(), make_store()]
    stores[0].create(path, CreateRequest(TEXT))
    stores[1].head(path)
    return stores


@dataclass
class HeldRefresh:
    """A refresh of `path` on `store`, in a greenlet of its own, held inside one segment read.

    The read at `start` completes, or fails its checks when `fails`, only once `release`
    is set; `tails_seen` records the handle's tail at each segment read it begins.
    """

    greenlet: gevent.Greenlet
    held: Event
    release: Event
    tails_seen: list[int]


def hold_refresh(store: StreamStore, path: str, start: int, *, fails: bool = False) -> HeldRefresh:
    handle, read_segment = store._streams[path], store.pieces.read_segment
    refresh = HeldRefresh(gevent.Greenlet(store.head, path), Event(), Event(), [])

    def reading(stream: object, at: int, **options: bool) -> object:
        if gevent.getcurrent() is not refresh.greenlet:
            return read_segment(stream, at, **options)
        refresh.tails_seen.append(handle.state.tail)
        found = read_segment(stream, at, **options)
        if at == start:
            refresh.held.set()
            refresh.release.wait()
            if fails:
                raise CorruptSegment("made to fail its checks")
        return found

    store.pieces.read_segment = reading  # type: ignore[method-assign]
    refresh.greenlet.start()
    assert refresh.held.wait(WAIT_TIMEOUT_SECONDS)
    return refresh


def test_a_refresh_holding_an_older_segment_never_takes_the_tail_back(
    make_store: MakeStore,
) -> None:
    """Two refreshes of one handle overlap (S3 reads yield); the slower read an older segment."""
    writer, reader = stores_knowing_an_empty_stream(make_store, "log")
    tails = [append_text(writer, "log", b"%d;" % number).info.tail for number in range(3)]
    slow = hold_refresh(reader, "log", tails[0])  # the second segment's state in hand
    assert reader.head("log").tail == tails[-1]  # a second refresh reads to the true tail
    slow.release.set()
    assert slow.greenlet.get(timeout=WAIT_TIMEOUT_SECONDS).tail == tails[-1]
    after_release = slow.tails_seen[slow.tails_seen.index(tails[0]) + 1 :]
    # It went on from the true tail, never from the older state it held.
    assert all(tail == tails[-1] for tail in after_release), slow.tails_seen


def test_a_failed_read_of_a_segment_another_read_verified_drops_nothing(
    make_store: MakeStore,
) -> None:
    writer, reader = stores_knowing_an_empty_stream(make_store, "log")
    tails = [append_text(writer, "log", b"%d;" % number).info.tail for number in range(2)]
    slow = hold_refresh(reader, "log", 0, fails=True)
    assert reader.head("log").tail == tails[-1]
    slow.release.set()
    slow.greenlet.join(timeout=WAIT_TIMEOUT_SECONDS)
    assert read_all(make_store(), "log") == b"0;1;"


def test_a_writer_whose_segment_a_refresh_read_past_keeps_the_further_tail(
    make_store: MakeStore,
) -> None:
    """While our create is in flight, another store appends after it and a refresh reads both."""
    ours, other = stores_knowing_an_empty_stream(make_store, "log")
    handle, create = ours._streams["log"], ours.objects.create
    landed, release = Event(), Event()

    def creating(key: str, data: bytes, **options: bool) -> None:
        create(key, data, **options)
        landed.set()
        release.wait()  # the segment is in storage; our writer has not heard yet

    ours.objects.create = creating  # type: ignore[method-assign]
    writing = gevent.spawn(append_text, ours, "log", b"ours;")
    assert landed.wait(WAIT_TIMEOUT_SECONDS)
    further = append_text(other, "log", b"theirs;").info.tail  # lands after ours
    assert ours.head("log").tail == further
    release.set()
    assert writing.get(timeout=WAIT_TIMEOUT_SECONDS).info.tail == len(b"ours;")
    assert handle.state.tail == further
    assert read_all(ours, "log") == b"ours;theirs;"


def test_a_writer_behind_by_many_segments_catches_up_in_a_few_reads(
    make_store: MakeStore,
) -> None:
    """A store whose tail is old loses the race at it, then lists instead of reading each
    segment: read one by one, the segments written since would cost a request each (and
    a store that kept writing would stay ahead of the reader)."""
    behind, ahead = make_store(), make_store()
    ahead.create("log", CreateRequest(TEXT))
    append_text(behind, "log", b"0")  # it knows the tail
    for number in range(1, SEGMENTS_AHEAD + 1):
        append_text(ahead, "log", b"%d," % number)
    reads, read = [], behind.objects.read

    def counted(key: str, *arguments: object) -> bytes:
        reads.append(key)
        return read(key, *arguments)

    behind.objects.read = counted  # type: ignore[method-assign]
    append_text(behind, "log", b"last")
    assert len([key for key in reads if "/seg/" in key]) <= 2, reads
    expected = b"0" + b"".join(b"%d," % n for n in range(1, SEGMENTS_AHEAD + 1)) + b"last"
    assert read_all(make_store(), "log") == expected


def test_stores_alternating_on_one_stream_never_overwrite(make_store: MakeStore) -> None:
    first, second = make_store(), make_store()
    first.create("shared", CreateRequest(TEXT))
    second.head("shared")  # both now cache the stream at tail 0
    expected, tails = b"", []
    for round_number in range(ALTERNATING_ROUNDS):
        for name, store in (("first", first), ("second", second)):
            # Each store's cached tail is stale here: the create-only write must lose,
            # re-read, and land after what the other store wrote.
            data = f"<{name}-{round_number}>".encode()
            tails.append(append_text(store, "shared", data).info.tail)
            expected += data
    assert tails == sorted(tails) and len(set(tails)) == len(tails)
    assert tails[-1] == len(expected)
    third = make_store()
    assert read_all(first, "shared") == read_all(second, "shared") == expected
    assert read_all(third, "shared") == expected


def test_conditional_appends_through_a_stale_store_are_checked_at_the_true_tail(
    make_store: MakeStore,
) -> None:
    """Each store's cached tail is stale in turn: a conditional append is never judged
    against it, but against the tail the refresh (nothing to write) or the lost create
    at the stale tail (a write) brings in."""
    first, second = stores_knowing_an_empty_stream(make_store, "log")
    assert append_text(first, "log", b"a;").info.tail == 2
    # The second store believes the tail is 0: 2 fails there, then holds after a refresh.
    assert append_text(second, "log", b"b;", if_match=2).info.tail == 4
    # The first believes 2, which matches there: its create at 2 loses, and the batch,
    # checked again at the true tail, fails.
    with pytest.raises(PreconditionFailed) as stale:
        append_text(first, "log", b"c;", if_match=2)
    assert stale.value.tail == 4
    assert append_text(first, "log", b"c;", if_match=4).info.tail == 6
    assert read_all(make_store(), "log") == b"a;b;c;"


def test_concurrent_appends_from_two_stores_land_exactly_once(make_store: MakeStore) -> None:
    stores = [make_store(), make_store()]
    stores[0].create("busy", CreateRequest(JSON))
    acknowledged: dict[bytes, int] = {}

    def writer(store_number: int, writer_number: int) -> None:
        for n in range(APPENDS_PER_WRITER):
            value = {"s": store_number, "w": writer_number, "n": n}
            result = append_json(stores[store_number], "busy", value)
            acknowledged[orjson.dumps(value)] = result.info.tail

    greenlets = [
        gevent.spawn(writer, store_number, writer_number)
        for store_number in range(len(stores))
        for writer_number in range(WRITERS_PER_STORE)
    ]
    gevent.joinall(greenlets, timeout=JOIN_TIMEOUT_SECONDS, raise_error=True)
    assert all(greenlet.ready() for greenlet in greenlets), "writers did not finish"

    stored = orjson.loads(read_all(make_store(), "busy"))
    assert len(stored) == len(acknowledged) == 2 * WRITERS_PER_STORE * APPENDS_PER_WRITER
    # Every acknowledged message is stored exactly once, ending where its ack said.
    position = 0
    for value in stored:
        position += len(orjson.dumps(value)) + 1
        assert acknowledged.pop(orjson.dumps(value)) == position
    assert not acknowledged
    # Each writer waited for its ack before the next append: its order is kept.
    for store_number in range(len(stores)):
        for writer_number in range(WRITERS_PER_STORE):
            sequence = [
                value["n"]
                for value in stored
                if (value["s"], value["w"]) == (store_number, writer_number)
            ]
            assert sequence == list(range(APPENDS_PER_WRITER))


def test_a_read_after_a_wait_takes_the_stream_as_fresh_as_the_wait_did(
    make_store: MakeStore,
) -> None:
    """A live reader fetching what its wait announced makes no storage request for it:
    a tail this store confirmed within the poll interval is taken as it is, as the wait
    takes it. A plain read always looks for other stores' appends."""
    ours, theirs = make_store(poll_interval=JOIN_TIMEOUT_SECONDS), make_store()
    ours.create("live", CreateRequest(TEXT, payload=Payload(b"0")))
    append_text(ours, "live", b"1")  # our own create at the tail confirms it
    append_text(theirs, "live", b"2")
    assert b"".join(ours.read("live", 1, after_wait=True).chunks) == b"1"
    assert b"".join(ours.read("live", 1).chunks) == b"12"
    assert b"".join(ours.read("live", 1, after_wait=True).chunks) == b"12"


def test_a_waiting_reader_sees_another_stores_append(make_store: MakeStore) -> None:
    writer_store, reader_store = make_store(), make_store()
    writer_store.create("live", CreateRequest(TEXT, payload=Payload(b"0")))
    waiting = gevent.spawn(reader_store.wait, "live", 1, WAIT_TIMEOUT_SECONDS)
    gevent.sleep(2 * POLL_INTERVAL)  # the reader is waiting before the append
    assert not waiting.ready()
    append_text(writer_store, "live", b"1")
    info = waiting.get(timeout=WAIT_TIMEOUT_SECONDS + 5)
    assert info.tail == 2, "the reader's wait ended without the other store's append"
    assert read_all(reader_store, "live", 1) == b"1"


@pytest.mark.parametrize("forked", [False, True], ids=["deleted", "soft-deleted"])
def test_a_wait_on_a_stream_deleted_in_this_store_ends_at_once(
    make_store: MakeStore, forked: bool
) -> None:
    """No data can come to a deleted stream: its waiters end (404, or 410 while a fork
    still reads it) instead of waiting out their timeout on it."""
    store = make_store()
    store.create("live", CreateRequest(TEXT, payload=Payload(b"0")))
    if forked:
        store.create("fork", CreateRequest("", fork_source="live"))
    waiting = gevent.spawn(store.wait, "live", 1, WAIT_TIMEOUT_SECONDS)
    gevent.sleep(2 * POLL_INTERVAL)
    assert not waiting.ready()
    store.delete("live")
    waiting.join(timeout=WAIT_TIMEOUT_SECONDS / 2)
    assert waiting.ready(), "the wait went on after its stream was deleted"
    assert isinstance(waiting.exception, StreamGone if forked else StreamNotFound)


def test_a_live_read_never_goes_on_in_the_stream_created_after_its_own_was_deleted(
    make_store: MakeStore,
) -> None:
    """Another node deletes the stream a reader follows and creates a longer one at its
    path: the reader's offsets say nothing about the new stream's bytes (404)."""
    reader_store, other_store = make_store(), make_store()
    reader_store.create("live", CreateRequest(TEXT, payload=Payload(b"old")))
    followed = reader_store.head("live").incarnation
    other_store.delete("live")
    other_store.create("live", CreateRequest(TEXT, payload=Payload(b"the new stream")))
    gevent.sleep(2 * POLL_INTERVAL)  # a wait takes a handle checked within the interval
    with pytest.raises(StreamNotFound):
        reader_store.wait("live", 3, WAIT_TIMEOUT_SECONDS, incarnation=followed)
    with pytest.raises(StreamNotFound):
        reader_store.read("live", 3, incarnation=followed)
    # An offset alone reads the stream there now (from inside its append: the append).
    assert read_all(reader_store, "live", 3) == b"the new stream"


@NEEDS_INOTIFY
@pytest.mark.parametrize("initial", [b"0", b""], ids=["with data", "created empty"])
def test_on_local_disk_a_watch_wakes_a_reader_of_another_stores_append(
    storage_url: str, initial: bytes
) -> None:
    """With a minute between timed looks, only the watch can wake the reader in time;
    a stream created empty has its segment directory to watch from the start."""
    if storage_url.startswith("s3://"):
        pytest.skip("object stores have no watch: they poll")
    settings = StoreSettings(poll_interval=60, watched_poll_interval=60)
    writer_store, reader_store = (StreamStore(open_objects(storage_url), settings) for _ in "ab")
    writer_store.create("live", CreateRequest(TEXT, payload=Payload(initial)))
    waiting = gevent.spawn(reader_store.wait, "live", len(initial), WAIT_TIMEOUT_SECONDS)
    gevent.sleep(2 * POLL_INTERVAL)  # the reader is waiting before the append
    assert not waiting.ready()
    append_text(writer_store, "live", b"1")
    info = waiting.get(timeout=WAIT_TIMEOUT_SECONDS + 5)
    assert info.tail == len(initial) + 1, "the wait ended without the other store's append"


def test_on_local_disk_a_wait_on_a_stream_another_store_deletes_ends_at_once(
    storage_url: str,
) -> None:
    """With a minute between timed looks, only the watch hears the segment directory go:
    the reader's wait ends with a 404 now instead of answering at its deadline."""
    if storage_url.startswith("s3://"):
        pytest.skip("object stores have no watch: they poll")
    settings = StoreSettings(poll_interval=60, watched_poll_interval=60)
    deleting_store, reader_store = (StreamStore(open_objects(storage_url), settings) for _ in "ab")
    deleting_store.create("live", CreateRequest(TEXT, payload=Payload(b"0")))
    waiting = gevent.spawn(reader_store.wait, "live", 1, 2 * WAIT_TIMEOUT_SECONDS)
    gevent.sleep(2 * POLL_INTERVAL)
    assert not waiting.ready()
    deleting_store.delete("live")
    waiting.join(timeout=WAIT_TIMEOUT_SECONDS)
    assert waiting.ready(), "the wait went on after another store deleted its stream"
    assert isinstance(waiting.exception, StreamNotFound)


@pytest.mark.parametrize(
    ("name", "creating", "news"),
    [
        ("", None, True),  # events were lost: look
        (".tmp-0123", None, False),
        ("00000000000000000000", None, False),  # behind the tail
        ("00000000000000000001", None, True),  # at the tail: another process's
        ("00000000000000000001", 1, False),  # the one our writer is creating
        ("00000000000000000007", 1, True),  # beyond the tail: we missed one
    ],
)
def test_which_new_files_send_a_waiting_reader_to_look(
    make_store: MakeStore, name: str, creating: int | None, news: bool
) -> None:
    store = make_store()
    store.create("live", CreateRequest(TEXT, payload=Payload(b"0")))
    handle = store._streams["live"]
    handle.creating = creating
    assert store.waits.may_be_news(handle, name) is news


def test_the_readers_an_append_wakes_run_before_it_is_answered(make_store: MakeStore) -> None:
    """The append commits in its own greenlet; the live readers its commit woke still go
    first, so their event never waits for the appender's answer to be written."""
    store = make_store()
    store.create("live", CreateRequest(TEXT, payload=Payload(b"0")))
    waiting = gevent.spawn(store.wait, "live", 1, WAIT_TIMEOUT_SECONDS)
    gevent.sleep(2 * POLL_INTERVAL)
    assert not waiting.ready()
    append_text(store, "live", b"1")
    assert waiting.ready(), "the appender was answered before the reader it woke ran"
    assert waiting.value.tail == 2


def slow_creates(store: StreamStore, seconds: float) -> Event:
    """Make the store's creates take `seconds` first; the event is set when one starts."""
    create, started = store.objects.create, Event()

    def slow_create(key: str, data: bytes, **options: bool) -> None:
        started.set()
        gevent.sleep(seconds)
        create(key, data, **options)

    store.objects.create = slow_create  # type: ignore[method-assign]
    return started


def test_an_appender_killed_while_it_commits_fails_its_batch_and_hands_on_the_rest(
    make_store: MakeStore,
) -> None:
    """The first append to find the stream idle commits its batch itself; if that
    request's greenlet dies mid-commit (a server stopping), the appends in its batch are
    answered with an error, not left waiting, and those queued after it are written."""
    store = make_store(linger_fraction=1.0)  # a batch forms meanwhile
    store.create("live", CreateRequest(TEXT, payload=Payload(b"0")))
    handle = store._streams["live"]
    handle.write_seconds = 10.0  # so the first waits the 50 ms at most
    committing = slow_creates(store, 1.0)
    first = gevent.spawn(append_text, store, "live", b"1")
    deadline = time.monotonic() + WAIT_TIMEOUT_SECONDS
    while not handle.writing and time.monotonic() < deadline:
        gevent.sleep(0.001)
    assert handle.writing, "the first append did not start"
    in_batch = gevent.spawn(append_text, store, "live", b"2")
    assert committing.wait(timeout=WAIT_TIMEOUT_SECONDS)
    assert not handle.pending, "the second append missed the first one's batch"
    queued = gevent.spawn(append_text, store, "live", b"3")
    gevent.sleep(0.05)  # it waits behind the batch
    first.kill(block=True)
    in_batch.join(timeout=WAIT_TIMEOUT_SECONDS)
    assert isinstance(in_batch.exception, StorageUnavailable)
    assert queued.get(timeout=WAIT_TIMEOUT_SECONDS).info.tail == 2
    assert read_all(store, "live") == b"03"
    assert not store._streams["live"].writing


def test_a_writer_names_the_segment_it_is_creating_while_it_does(make_store: MakeStore) -> None:
    store = make_store()
    store.create("live", CreateRequest(TEXT, payload=Payload(b"0")))
    handle, create, seen = store._streams["live"], store.objects.create, []

    def creating(key: str, data: bytes, **options: bool) -> None:
        seen.append(handle.creating)
        create(key, data, **options)

    store.objects.create = creating  # type: ignore[method-assign]
    append_text(store, "live", b"1")
    assert (seen, handle.creating) == ([1], None)


# -- the handle cache ---------------------------------------------------------------------


def test_the_handle_cache_keeps_to_its_count_of_handles(make_store: MakeStore) -> None:
    store = make_store(cached_streams=2)
    for number in range(4):
        store.create(f"s{number}", CreateRequest(TEXT))
        store.head(f"s{number}")
    assert store._streams.paths() == ["s2", "s3"]  # the least recently used went
    assert store.head("s0").tail == 0  # and is loaded again when asked for


def test_a_handle_that_grows_pushes_the_oldest_out_of_the_cache(make_store: MakeStore) -> None:
    store = make_store(handle_cache_bytes=3 * streams.HANDLE_BYTES)
    store.create("idle", CreateRequest(TEXT))
    store.create("busy", CreateRequest(TEXT))
    assert store._streams.paths() == ["idle", "busy"]
    pieces = 2 * streams.HANDLE_BYTES // streams.PIECE_BYTES
    for number in range(pieces):  # a segment each: the busy handle outgrows the cache
        store.append("busy", AppendRequest(TEXT, Payload(b"%d;" % number)))
    assert store._streams.paths() == ["busy"]
    assert store._streams.size_bytes == store._open("busy").counted_bytes
