"""Protocol behaviours pinned beyond the conformance suite, against a real PicoMQ.

JSON flattening and number fidelity, paged catch-up reads under a small read cap,
caching headers, CORS, long-poll and SSE details, forks, delete/re-create and TTL expiry.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import time
import uuid
from typing import TYPE_CHECKING

import pytest
import requests

from protocol import format_offset

if TYPE_CHECKING:
    from conftest import Server, StartServer

OCTETS = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
TEXT = {"Content-Type": "text/plain"}
MAX_READ_BYTES = 1000
EXPIRY_DEADLINE_SECONDS = 15.0
MAX_PAGES = 1000


def create(url: str, headers: dict[str, str], body: bytes | None = None) -> None:
    response = requests.put(url, data=body, headers=headers)
    assert response.status_code == 201, response.content


def append(url: str, body: bytes, headers: dict[str, str]) -> str:
    """POST a body; returns the new tail offset."""
    response = requests.post(url, data=body, headers=headers)
    assert response.status_code == 204, response.content
    return response.headers["Stream-Next-Offset"]


def close(url: str) -> None:
    response = requests.post(url, headers={"Stream-Closed": "true"})
    assert response.status_code == 204, response.content


# -- JSON mode --------------------------------------------------------------------------


def test_json_posts_are_flattened_exactly_one_level(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    create(url, JSON)
    bodies_and_counts = [
        (b'["a", "b"]', 2),
        (b"[[1, 2], [3, 4]]", 2),
        (b"[[[1]]]", 1),
        (b"42", 1),
        (b'{"k": [1, 2]}', 1),
        (b'"text"', 1),
        (b"null", 1),
        (b"[[]]", 1),
    ]
    for body, count in bodies_and_counts:
        before = json.loads(requests.get(url).content)
        append(url, body, JSON)
        after = json.loads(requests.get(url).content)
        assert len(after) - len(before) == count, (body, after[len(before) :])

    expected = ["a", "b", [1, 2], [3, 4], [[1]], 42, {"k": [1, 2]}, "text", None, []]
    assert json.loads(requests.get(url).content) == expected


def test_json_integers_wider_than_64_bits_round_trip(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    create(url, JSON)
    values = [
        2**64,
        -(2**63) - 1,
        123456789012345678901234567890,
        -98765432109876543210987654321,
        {"id": 2**100, "nested": [2**70, 1]},
        2**64 - 1,
    ]
    append(url, json.dumps(values).encode(), JSON)
    # Parsed by the stdlib, a float anywhere would mean precision was lost.
    assert json.loads(requests.get(url).content) == values


def test_json_messages_are_stored_byte_for_byte(server: Server, unique_stream: str) -> None:
    """Never re-serialised: number spellings, key order and inner whitespace all stay."""
    url = server.stream_url(unique_stream)
    create(url, JSON)
    messages = [b"1.0", b"1E5", b"-0", b'{"b": 2, "a" : [ 1 ]}', b'"\\u00e9\\n"', b"1e400"]
    append(url, b" [ " + b" ,\n ".join(messages) + b" ]\n", JSON)
    pretty = b'{\n  "line": 1,\r\n  "text": "a"\n}'
    append(url, pretty, JSON)
    assert requests.get(url).content == b"[" + b",".join([*messages, pretty]) + b"]"

    close(url)
    response = requests.get(url, params={"offset": "-1", "live": "sse"}, timeout=30)
    batches = [json.loads(data) for kind, data in parse_sse(response.text) if kind == "data"]
    assert [message for batch in batches for message in batch][-1] == {"line": 1, "text": "a"}


def test_a_read_from_inside_a_json_message_starts_at_that_message(
    server: Server, unique_stream: str
) -> None:
    url = server.stream_url(unique_stream)
    create(url, JSON)
    boundary = append(url, b'{"first": 1}', JSON)
    append(url, b'[{"second": 2}, {"third": 3}]', JSON)
    assert requests.get(url, params={"offset": boundary}).json() == [{"second": 2}, {"third": 3}]

    inside = format_offset(int(boundary.rsplit("_", 1)[1]) + 3)
    assert_read_in_every_mode(url, inside, b'[{"second": 2},{"third": 3}]', boundary)


def assert_read_in_every_mode(url: str, offset: str, body: bytes, start: str) -> None:
    """Catch-up, long-poll and SSE all read `body`, which begins at `start` (the first
    SSE event's control names where the data ends, as a catch-up's next offset does)."""
    catch_up = requests.get(url, params={"offset": offset}, timeout=30)
    assert (catch_up.status_code, catch_up.content) == (200, body)
    long_poll = requests.get(url, params={"offset": offset, "live": "long-poll"}, timeout=30)
    assert (long_poll.status_code, long_poll.content) == (200, body)
    assert long_poll.headers["ETag"] == catch_up.headers["ETag"]
    assert start.rsplit("_", 1)[1].lstrip("0") in catch_up.headers["ETag"]
    params = {"offset": offset, "live": "sse"}
    with requests.get(url, params=params, stream=True, timeout=30) as sse:
        assert sse.status_code == 200
        first = next(sse.iter_lines())
    assert first == b"event: data"


def test_a_read_from_inside_an_append_starts_at_that_append(
    server: Server, unique_stream: str
) -> None:
    """What the reference server answers, and the Yjs provider's server relies on."""
    url = server.stream_url(unique_stream)
    create(url, OCTETS)
    boundary = append(url, b"abc", OCTETS)
    append(url, b"defgh", OCTETS)
    inside = format_offset(int(boundary.rsplit("_", 1)[1]) + 1)
    assert_read_in_every_mode(url, inside, b"defgh", boundary)


def test_a_read_from_beyond_the_tail_is_empty_and_up_to_date(
    server: Server, unique_stream: str
) -> None:
    url = server.stream_url(unique_stream)
    create(url, OCTETS)
    tail = append(url, b"abc", OCTETS)
    beyond = format_offset(int(tail.rsplit("_", 1)[1]) + 100)
    response = requests.get(url, params={"offset": beyond})
    assert (response.status_code, response.content) == (200, b"")
    assert response.headers["Stream-Next-Offset"] == tail
    assert response.headers["Stream-Up-To-Date"] == "true"
    response = requests.get(url, params={"offset": beyond, "live": "long-poll"}, timeout=30)
    assert (response.status_code, response.headers["Stream-Next-Offset"]) == (204, tail)
    for malformed in ("12", "0000000000000000_x", "-2", "0000000000000000_0000000000000003,"):
        assert requests.get(url, params={"offset": malformed}).status_code == 400


# -- paged catch-up reads -----------------------------------------------------------------


@pytest.fixture
def capped_server(start_server: StartServer) -> Server:
    return start_server(env={"PICOMQ_MAX_READ_BYTES": str(MAX_READ_BYTES)})


def read_pages(url: str) -> list[requests.Response]:
    """Catch-up from the start, following Stream-Next-Offset until up to date."""
    pages, offset = [], "-1"
    for _ in range(MAX_PAGES):
        response = requests.get(url, params={"offset": offset})
        assert response.status_code == 200, response.content
        pages.append(response)
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            return pages
    pytest.fail(f"no Stream-Up-To-Date after {MAX_PAGES} pages")


def test_json_catch_up_is_paged_by_the_read_cap_on_message_boundaries(
    capped_server: Server,
) -> None:
    url = capped_server.stream_url(f"paged-json-{uuid.uuid4().hex[:12]}")
    create(url, JSON)
    messages: list[object] = [{"n": n, "pad": "x" * (n * 37 % 170)} for n in range(120)]
    messages.insert(60, {"big": "y" * (3 * MAX_READ_BYTES)})  # one message over the cap
    for start in range(0, len(messages), 9):
        append(url, json.dumps(messages[start : start + 9]).encode(), JSON)
    assert sum(len(json.dumps(m)) for m in messages) > 10 * 1024

    pages = read_pages(url)
    received = []
    for page in pages:
        items = json.loads(page.content)
        assert isinstance(items, list) and items, page.content[:200]
        last = len(json.dumps(items[-1], separators=(",", ":")))
        assert len(page.content) - last <= MAX_READ_BYTES, (len(page.content), len(items))
        received += items
    assert received == messages
    assert len(pages) > 10
    assert all(page.headers.get("Stream-Up-To-Date") is None for page in pages[:-1])


def test_byte_catch_up_is_paged_by_the_read_cap_and_reassembles_exactly(
    capped_server: Server,
) -> None:
    url = capped_server.stream_url(f"paged-bytes-{uuid.uuid4().hex[:12]}")
    create(url, OCTETS)
    data = os.urandom(10 * 1024 + 7)
    for start in range(0, len(data), 777):
        append(url, data[start : start + 777], OCTETS)

    pages = read_pages(url)
    assert all(len(page.content) <= MAX_READ_BYTES for page in pages)
    assert b"".join(page.content for page in pages) == data
    assert len(pages) >= len(data) // MAX_READ_BYTES


# -- caching, ETags, CORS -----------------------------------------------------------------


def test_etag_gives_304_and_changes_when_the_stream_closes(
    server: Server, unique_stream: str
) -> None:
    url = server.stream_url(unique_stream)
    create(url, TEXT)
    append(url, b"hello", TEXT)
    first = requests.get(url)
    etag = first.headers["ETag"]

    not_modified = requests.get(url, headers={"If-None-Match": etag})
    assert not_modified.status_code == 304
    assert not_modified.content == b""
    assert not_modified.headers["ETag"] == etag

    close(url)
    after_close = requests.get(url)
    assert after_close.status_code == 200
    assert after_close.content == b"hello"
    assert after_close.headers["Stream-Closed"] == "true"
    assert after_close.headers["ETag"] != etag
    assert requests.get(url, headers={"If-None-Match": etag}).status_code == 200
    revalidated = requests.get(url, headers={"If-None-Match": after_close.headers["ETag"]})
    assert revalidated.status_code == 304


def test_cache_control_on_head_now_and_catch_up(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    create(url, TEXT)
    append(url, b"data", TEXT)

    assert requests.head(url).headers["Cache-Control"] == "no-store"
    now = requests.get(url, params={"offset": "now"})
    assert now.status_code == 200 and now.content == b""
    assert now.headers["Cache-Control"] == "no-store"
    assert "ETag" not in now.headers
    catch_up = requests.get(url, params={"offset": "-1"})
    assert "public" in catch_up.headers["Cache-Control"]
    assert "no-store" not in catch_up.headers["Cache-Control"]


def test_a_stream_read_as_a_page_is_sandboxed_and_loads_nothing(
    server: Server, unique_stream: str
) -> None:
    """Anyone who may create a stream can write a page: a browser must run none of it
    on this origin (tests/test_inspector.py opens one in Chromium)."""
    url = server.stream_url(unique_stream)
    page = b"<script>fetch('/v1/streams').then(r => r.text()).then(alert)</script>"
    create(url, {"Content-Type": "text/html"}, page)
    tail = requests.head(url).headers["Stream-Next-Offset"]
    answers = {
        "catch-up": requests.get(url, params={"offset": "-1"}),
        "not modified": requests.get(
            url, headers={"If-None-Match": requests.get(url).headers["ETag"]}
        ),
        "now": requests.get(url, params={"offset": "now"}),
        "long-poll": requests.get(url, params={"offset": "-1", "live": "long-poll"}),
        "long-poll, timed out": requests.get(url, params={"offset": tail, "live": "long-poll"}),
        "head": requests.head(url),
    }
    for name, answer in answers.items():
        assert answer.status_code in (200, 204, 304), (name, answer.status_code)
        policy = [part.strip() for part in answer.headers["Content-Security-Policy"].split(";")]
        assert "sandbox" in policy and "default-src 'none'" in policy, (name, policy)
    assert answers["catch-up"].content == page


def test_cors_preflight_allows_the_protocol_headers(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    response = requests.options(
        url,
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "if-none-match, producer-id, stream-seq",
        },
    )
    assert response.status_code in (200, 204)
    assert response.headers["Access-Control-Allow-Origin"] == "*"
    allowed = response.headers["Access-Control-Allow-Headers"].lower()
    assert allowed == "*" or all(h in allowed for h in ("if-none-match", "producer-id"))
    methods = response.headers["Access-Control-Allow-Methods"]
    assert all(method in methods for method in ("GET", "POST", "PUT", "DELETE", "HEAD"))

    create(url, TEXT)
    exposed = requests.get(url).headers["Access-Control-Expose-Headers"].lower()
    for header in ("stream-next-offset", "stream-cursor", "stream-up-to-date", "etag"):
        assert header in exposed


# -- live reads ---------------------------------------------------------------------------


def test_long_poll_times_out_with_204_and_a_decimal_cursor(
    server: Server, unique_stream: str
) -> None:
    url = server.stream_url(unique_stream)
    create(url, TEXT)
    tail = append(url, b"x", TEXT)

    response = requests.get(url, params={"offset": tail, "live": "long-poll"}, timeout=30)
    assert response.status_code == 204
    assert response.content == b""
    assert response.headers["Stream-Next-Offset"] == tail
    assert response.headers["Stream-Up-To-Date"] == "true"
    cursor = response.headers["Stream-Cursor"]
    assert cursor.isdigit() and cursor.isascii()

    echoed = requests.get(
        url, params={"offset": tail, "live": "long-poll", "cursor": cursor}, timeout=30
    )
    assert echoed.status_code == 204
    assert int(echoed.headers["Stream-Cursor"]) > int(cursor)


def parse_sse(text: str) -> list[tuple[str, str]]:
    """(event type, data joined by newlines) for each event of an SSE body."""
    events = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line]
        if not lines:
            continue
        kind = next(line[6:].strip() for line in lines if line.startswith("event:"))
        data = "\n".join(line[5:] for line in lines if line.startswith("data:"))
        events.append((kind, data))
    return events


def test_sse_sends_octet_streams_as_base64(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    create(url, OCTETS)
    data = bytes(range(256)) + b"\r\n\n\r" + os.urandom(3000)
    append(url, data, OCTETS)
    close(url)

    response = requests.get(url, params={"offset": "-1", "live": "sse"}, timeout=30)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.headers["Stream-SSE-Data-Encoding"] == "base64"
    events = parse_sse(response.text)
    payload = "".join(data for kind, data in events if kind == "data")
    assert base64.b64decode(payload.replace("\n", "").replace("\r", ""), validate=True) == data
    controls = [json.loads(data) for kind, data in events if kind == "control"]
    assert controls[-1]["streamClosed"] is True


def test_sse_sends_text_streams_as_text(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    create(url, TEXT)
    append(url, "héllo\nworld".encode(), TEXT)
    close(url)

    response = requests.get(url, params={"offset": "-1", "live": "sse"}, timeout=30)
    assert "Stream-SSE-Data-Encoding" not in response.headers
    events = parse_sse(response.content.decode())
    assert [data for kind, data in events if kind == "data"] == ["héllo\nworld"]


# -- forks, delete, expiry -----------------------------------------------------------------


def test_reading_a_fork_across_its_boundary(server: Server, unique_stream: str) -> None:
    source = server.stream_url(f"{unique_stream}-source")
    fork = server.stream_url(f"{unique_stream}-fork")
    create(source, JSON)
    after_first = append(source, b"[1]", JSON)
    fork_point = append(source, b"[2, 3]", JSON)
    append(source, b"[4]", JSON)

    response = requests.put(
        fork,
        headers={
            "Stream-Forked-From": f"/v1/stream/{unique_stream}-source",
            "Stream-Fork-Offset": fork_point,
        },
    )
    assert response.status_code == 201, response.content
    append(fork, b'["f1", "f2"]', JSON)
    append(source, b"[5]", JSON)

    assert requests.get(fork).json() == [1, 2, 3, "f1", "f2"]
    assert requests.get(fork, params={"offset": after_first}).json() == [2, 3, "f1", "f2"]
    assert requests.get(fork, params={"offset": fork_point}).json() == ["f1", "f2"]
    assert requests.get(source).json() == [1, 2, 3, 4, 5]
    assert requests.head(fork).headers["Content-Type"] == "application/json"


def test_reading_a_byte_fork_across_its_boundary(server: Server, unique_stream: str) -> None:
    source = server.stream_url(f"{unique_stream}-source")
    fork = server.stream_url(f"{unique_stream}-fork")
    create(source, OCTETS)
    append(source, b"abc", OCTETS)
    fork_point = append(source, b"def", OCTETS)
    append(source, b"ghi", OCTETS)
    headers = {
        "Stream-Forked-From": source.split(server.url, 1)[1],
        "Stream-Fork-Offset": fork_point,
    }
    assert requests.put(fork, headers=headers).status_code == 201
    append(fork, b"XYZ", OCTETS)

    assert requests.get(fork).content == b"abcdefXYZ"
    assert requests.get(fork, params={"offset": format_offset(3)}).content == b"defXYZ"
    middle = format_offset(2)  # inside the source's first append: from its start
    assert requests.get(fork, params={"offset": middle}).content == b"abcdefXYZ"


def test_delete_then_recreate_serves_only_the_new_data(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    create(url, TEXT)
    append(url, b"old data", TEXT)
    old_etag = requests.get(url).headers["ETag"]

    assert requests.delete(url).status_code == 204
    assert requests.get(url).status_code == 404
    assert requests.head(url).status_code == 404
    assert requests.post(url, data=b"x", headers=TEXT).status_code == 404
    assert requests.delete(url).status_code == 404

    create(url, OCTETS)
    append(url, b"new", OCTETS)
    response = requests.get(url)
    assert response.content == b"new"
    assert response.headers["Content-Type"] == "application/octet-stream"
    assert response.headers["ETag"] != old_etag


@pytest.mark.parametrize("offset", ["tail", "now"])
def test_a_long_poll_on_a_stream_deleted_meanwhile_answers_404(
    start_server: StartServer, offset: str
) -> None:
    """One worker, so the DELETE reaches the process where the long-poll waits: the wait
    ends then with a 404, not with a 204 after its timeout (30 s here)."""
    server = start_server(workers=1, long_poll_timeout=30)
    url = server.stream_url("deleted-while-polled")
    create(url, TEXT)
    tail = append(url, b"old data", TEXT)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        params = {"offset": tail if offset == "tail" else "now", "live": "long-poll"}
        polling = pool.submit(requests.get, url, params=params, timeout=60)
        time.sleep(0.3)  # the long-poll is waiting
        assert requests.delete(url).status_code == 204
        create(url, TEXT)
        append(url, b"the new stream, longer", TEXT)
        response = polling.result()
    assert response.status_code == 404, response.content
    assert response.json()["error"]["message"].endswith("was deleted")


def test_expired_streams_are_swept_without_being_touched(
    start_server: StartServer, unique_stream: str
) -> None:
    server = start_server(env={"PICOMQ_SWEEP_INTERVAL": "0.5"})
    create(server.stream_url(unique_stream), {**TEXT, "Stream-TTL": "1"})
    create(server.stream_url(f"{unique_stream}-kept"), TEXT)
    meta = server.data_dir / "streams" / unique_stream / "meta.json"
    assert meta.exists()
    deadline = time.monotonic() + EXPIRY_DEADLINE_SECONDS
    while meta.exists():  # nothing reads or writes it: only a sweep can remove it
        if time.monotonic() > deadline:
            pytest.fail(f"an expired stream was not swept within {EXPIRY_DEADLINE_SECONDS} s")
        time.sleep(0.2)
    assert list((server.data_dir / "streams" / unique_stream).iterdir()) == []  # data too
    assert (server.data_dir / "streams" / f"{unique_stream}-kept" / "meta.json").exists()


def test_stream_expires_after_its_ttl_and_can_be_recreated(
    server: Server, unique_stream: str
) -> None:
    url = server.stream_url(unique_stream)
    create(url, {**TEXT, "Stream-TTL": "1"})
    append(url, b"short-lived", TEXT)
    head = requests.head(url)
    assert head.headers["Stream-TTL"] == "1"

    # HEAD does not renew a TTL, so polling with it lets the stream expire.
    deadline = time.monotonic() + EXPIRY_DEADLINE_SECONDS
    while requests.head(url).status_code == 200:
        if time.monotonic() > deadline:
            pytest.fail(f"a Stream-TTL: 1 stream still exists after {EXPIRY_DEADLINE_SECONDS} s")
        time.sleep(0.2)

    assert requests.head(url).status_code == 404
    assert requests.get(url).status_code == 404
    assert requests.post(url, data=b"late", headers=TEXT).status_code == 404
    create(url, TEXT)
    assert requests.get(url).content == b""
