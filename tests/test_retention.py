"""Retention: whole pieces trimmed from the head, and 410 before the earliest offset."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import gevent
import pytest
import requests
from conftest import soon

from storage import StreamStore, open_objects
from streams import (
    AppendRequest,
    CreateRequest,
    OffsetTrimmed,
    Payload,
    Producer,
    StoreSettings,
    StreamClosed,
)

# Tiny index age: fence 0.1 s, deletion grace 0.5 s; no compaction in the way.
SETTINGS = StoreSettings(index_max_age=0.05, compact_after=10_000)
TEXT = "text/plain"


def append_pieces(store: StreamStore, path: str, count: int, *, producer: bool = False) -> None:
    """One segment per append: each call is its own group commit."""
    for number in range(count):
        owner = Producer("writer", 0, number) if producer else None
        store.append(path, AppendRequest(TEXT, Payload(b"%04d" % number), producer=owner))


def piece_count(store: StreamStore, path: str) -> int:
    prefix = f"streams/{path}/{store.head(path).incarnation}"
    return len(store.objects.list(f"{prefix}/seg")) + len(store.objects.list(f"{prefix}/pack"))


def test_size_retention_trims_the_head_and_answers_410(storage_url: str) -> None:
    store = StreamStore(open_objects(storage_url), SETTINGS)
    store.create("sized", CreateRequest(content_type=TEXT, retention_bytes=20))
    append_pieces(store, "sized", 20, producer=True)
    before = piece_count(store, "sized")
    gevent.sleep(0.2)  # let the last pieces age past the fence
    append_pieces_after = store.append(
        "sized", AppendRequest(TEXT, Payload(b"tail"), producer=Producer("writer", 0, 20))
    )
    assert append_pieces_after.info.tail == 84
    soon(lambda: store.head("sized").earliest > 0)
    soon(lambda: piece_count(store, "sized") < before)

    info = store.head("sized")
    assert 0 < info.earliest <= 84 - 20 + 4, "more than the retained size is still readable"
    assert piece_count(store, "sized") < before, "trimmed pieces were not deleted"
    with pytest.raises(OffsetTrimmed) as trimmed:
        store.read("sized", 0)
    assert trimmed.value.earliest == info.earliest
    from_start = store.read("sized", None)  # -1 starts at the earliest retained data
    assert from_start.start == info.earliest
    assert b"".join(from_start.chunks).endswith(b"0019tail")

    fresh = StreamStore(open_objects(storage_url), SETTINGS)  # another node: storage says so
    assert fresh.head("sized").earliest == info.earliest
    with pytest.raises(OffsetTrimmed):
        fresh.read("sized", 0)
    # producer state survived: a retry of seq 20 is a duplicate, seq 21 is accepted
    retry = fresh.append(
        "sized", AppendRequest(TEXT, Payload(b"tail"), producer=Producer("writer", 0, 20))
    )
    assert retry.duplicate


def test_age_retention_trims_and_keeps_closed_flag(storage_url: str) -> None:
    store = StreamStore(open_objects(storage_url), SETTINGS)
    store.create("aged", CreateRequest(content_type=TEXT, retention_age=1))
    append_pieces(store, "aged", 5)
    gevent.sleep(1.3)
    store.append("aged", AppendRequest(TEXT, Payload(b"last"), close=True))
    soon(lambda: store.head("aged").earliest >= 20)
    info = store.head("aged")
    assert info.earliest == 20 and info.closed
    with pytest.raises(StreamClosed):
        store.append("aged", AppendRequest(TEXT, Payload(b"more")))
    assert b"".join(store.read("aged", None).chunks) == b"last"


def test_forked_streams_are_not_trimmed(storage_url: str) -> None:
    # A slower fence (1 s) so the fork surely exists before anything may be trimmed.
    store = StreamStore(open_objects(storage_url), replace(SETTINGS, index_max_age=0.5))
    store.create("source", CreateRequest(content_type=TEXT, retention_bytes=8))
    append_pieces(store, "source", 6)
    store.create("fork", CreateRequest(content_type="", fork_source="source", fork_offset=24))
    gevent.sleep(1.2)
    append_pieces(store, "source", 2)
    gevent.sleep(1.0)
    assert store.head("source").earliest == 0
    assert b"".join(store.read("fork", None).chunks) == b"".join(b"%04d" % n for n in range(6))


def test_streams_without_retention_keep_everything(storage_url: str) -> None:
    store = StreamStore(open_objects(storage_url), SETTINGS)
    store.create("kept", CreateRequest(content_type=TEXT))
    append_pieces(store, "kept", 10)
    gevent.sleep(0.5)
    assert store.head("kept").earliest == 0
    assert b"".join(store.read("kept", None).chunks) == b"".join(b"%04d" % n for n in range(10))


def test_http_retention_headers_410_and_resume(start_server: object) -> None:
    server = start_server(env={"PICOMQ_INDEX_MAX_AGE": "0.05"})  # type: ignore[operator]
    url = server.stream_url(f"retained-{uuid.uuid4().hex[:8]}")
    created = requests.put(
        url, headers={"Content-Type": TEXT, "Stream-Retention-Bytes": "20"}, timeout=10
    )
    assert created.status_code == 201
    for number in range(20):
        assert requests.post(url, data=b"%04d" % number, headers={"Content-Type": TEXT}).ok
    time.sleep(0.3)
    assert requests.post(url, data=b"tail", headers={"Content-Type": TEXT}).ok

    def earliest() -> str:
        return requests.head(url, timeout=10).headers["Stream-Earliest-Offset"]

    deadline = time.monotonic() + 15
    while earliest().endswith("_0000000000000000") and time.monotonic() < deadline:
        time.sleep(0.1)
    head = requests.head(url, timeout=10)
    assert head.headers["Stream-Retention-Bytes"] == "20"
    first = head.headers["Stream-Earliest-Offset"]
    assert not first.endswith("_0000000000000000"), "nothing was trimmed"

    gone = requests.get(url, params={"offset": "0000000000000000_0000000000000000"}, timeout=10)
    assert gone.status_code == 410
    assert gone.headers["Stream-Earliest-Offset"] >= first  # trimming may have moved on
    assert gone.json()["error"]["code"] == "offset_trimmed"
    resumed = requests.get(url, params={"offset": first}, timeout=10)
    for _ in range(20):  # the trim may move on meanwhile: follow the 410 as a client would
        if resumed.status_code != 410:
            break
        earliest_now = resumed.headers["Stream-Earliest-Offset"]
        resumed = requests.get(url, params={"offset": earliest_now}, timeout=10)
    assert resumed.status_code == 200 and resumed.content.endswith(b"0019tail")
    from_start = requests.get(url, params={"offset": "-1"}, timeout=10)
    assert from_start.status_code == 200 and from_start.content.endswith(b"0019tail")
    long_poll = requests.get(
        url, params={"offset": "0000000000000000_0000000000000000", "live": "long-poll"}
    )
    assert long_poll.status_code == 410


def test_malformed_retention_headers_are_400(server: object) -> None:
    url = server.stream_url(f"bad-retention-{uuid.uuid4().hex[:8]}")  # type: ignore[attr-defined]
    for header, value in [("Stream-Retention-Age", "-5"), ("Stream-Retention-Bytes", "1e6")]:
        answer = requests.put(url, headers={"Content-Type": TEXT, header: value}, timeout=10)
        assert answer.status_code == 400
        assert "error" in answer.json()
