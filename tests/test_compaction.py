"""Compaction: small segments merge into packs; reads stay byte-identical on both backends."""

from __future__ import annotations

import time

import gevent
from conftest import read_all

from storage import StreamStore, open_objects
from streams import AppendRequest, CreateRequest, Payload, StoreSettings

SETTINGS = StoreSettings(compact_after=4, compact_max_segments=8, index_max_age=0.03)


def object_names(store: StreamStore, path: str, folder: str) -> list[str]:
    incarnation = store.head(path).incarnation
    return store.objects.list(f"streams/{path}/{incarnation}/{folder}")


def test_small_segments_become_packs_and_originals_go(storage_url: str) -> None:
    store = StreamStore(open_objects(storage_url), SETTINGS)
    store.create("events", CreateRequest(content_type="application/json"))
    for number in range(30):
        message = Payload.from_messages([b'{"n":%d}' % number])
        store.append("events", AppendRequest("application/json", message))
    expected = b"[" + b",".join(b'{"n":%d}' % n for n in range(30)) + b"]"
    gevent.sleep(0)  # let the compaction greenlets run
    deadline = time.monotonic() + 20
    while len(object_names(store, "events", "seg")) > 8 and time.monotonic() < deadline:
        gevent.sleep(0.1)

    packs = object_names(store, "events", "pack")
    assert packs, "no pack was written"
    assert len(object_names(store, "events", "seg")) <= 8, "compacted originals were not deleted"
    assert read_all(store, "events") == expected

    fresh = StreamStore(open_objects(storage_url), SETTINGS)  # another node, empty cache
    assert read_all(fresh, "events") == expected
    assert fresh.head("events").tail == store.head("events").tail


def test_a_members_lone_commits_compact_what_its_rewrites_wrote(storage_url: str) -> None:
    """Served alone, a stream commits each append through the member's log, and only
    a commit that begins a run looks at compaction (one that joins its run adds no
    piece): the first after each rewrite."""
    store = StreamStore(open_objects(storage_url), SETTINGS)
    store.serves_alone = lambda path: True
    store.log.begin("m1")
    expected = []
    try:
        store.create("events", CreateRequest(content_type="application/json"))
        for number in range(24):
            message = b'{"n":%d}' % number
            store.append(
                "events", AppendRequest("application/json", Payload.from_messages([message]))
            )
            expected.append(message)
            if number % 2:  # two commits a run: the first begins it, the second joins
                assert store.rewrites.rewrite_all(10)
        deadline = time.monotonic() + 20
        while not object_names(store, "events", "pack") and time.monotonic() < deadline:
            gevent.sleep(0.1)

        assert object_names(store, "events", "pack"), "no pack was written"
        assert read_all(store, "events") == b"[" + b",".join(expected) + b"]"
    finally:
        if store.rewrites.worker is not None:
            store.rewrites.worker.kill()


def test_reads_from_any_offset_after_compaction(storage_url: str) -> None:
    """Packs keep where each append ends: a read from inside one starts at its start."""
    store = StreamStore(open_objects(storage_url), SETTINGS)
    store.create("bytes", CreateRequest(content_type="text/plain"))
    for number in range(20):
        store.append("bytes", AppendRequest("text/plain", Payload(b"%02d" % number)))
    gevent.sleep(1)
    whole = b"".join(b"%02d" % n for n in range(20))
    for offset in range(0, 40, 3):
        start = offset - offset % 2
        assert b"".join(store.read("bytes", offset, max_bytes=1000).chunks) == whole[start:]


def test_packs_are_bounded_by_bytes_and_large_segments_stay(storage_url: str) -> None:
    """A batched producer's large segments are not copied, and no pack outgrows its bound."""
    settings = StoreSettings(
        compact_after=4, compact_max_segments=1024, compact_max_bytes=1600, index_max_age=0.03
    )
    store = StreamStore(open_objects(storage_url), settings)
    store.create("mixed", CreateRequest(content_type="text/plain"))
    small, large = b"s" * 40, b"L" * 100  # a sixteenth of 1,600 bytes is 100: large
    sizes = [small] * 60 + [large] * 10 + [small] * 3
    for data in sizes:
        store.append("mixed", AppendRequest("text/plain", Payload(data)))
    deadline = time.monotonic() + 20  # the 60 small segments: 40 bytes each, 1,600 at most
    while len(object_names(store, "mixed", "pack")) < 2 and time.monotonic() < deadline:
        gevent.sleep(0.1)
    gevent.sleep(0.5)  # later passes, if any, would pack the large segments by now
    large_start = 60 * len(small)
    large_end = large_start + 10 * len(large)
    for name in object_names(store, "mixed", "pack"):
        start, end = (int(offset) for offset in name.rsplit("/", 1)[-1].split("-"))
        assert end - start <= 1600, f"pack {start}-{end} holds more than compact_max_bytes"
        assert end <= large_start or start >= large_end, f"pack {start}-{end} copied large ones"
    assert read_all(store, "mixed") == b"".join(sizes)
