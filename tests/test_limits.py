"""Hostile and malformed input: always a 4xx with a JSON error, never a 5xx, never a file
outside the data directory, and a server that keeps answering afterwards.

Paths are sent over raw sockets because HTTP clients normalise `..`, percent-escapes and
double slashes before a server could see them.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
import requests

from settings import Settings, SettingsError
from streams import MAX_FORK_DEPTH, MAX_PRODUCER_ID_BYTES, MAX_STREAM_SEQ_BYTES

if TYPE_CHECKING:
    from conftest import Server, StartServer

SOCKET_TIMEOUT_SECONDS = 10.0
MAX_REQUEST_BYTES = 1024
OCTETS = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
METHODS = ("GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS")


# -- raw HTTP -----------------------------------------------------------------------


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def send_raw(
    server: Server,
    method: str,
    target: bytes,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
) -> RawResponse:
    """One request with `target` sent byte for byte, on its own connection; header
    values in UTF-8, and the body's length unless `headers` give a Content-Length."""
    lines = [
        method.encode() + b" " + target + b" HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Connection: close",
    ]
    fields = {"Content-Length": str(len(body)), **(headers or {})}
    lines += [f"{name}: {value}".encode() for name, value in fields.items()]
    port = urlsplit(server.url).port
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_SECONDS) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        try:
            return RawResponse(response.status, response.headers, response.read())
        finally:
            response.close()


def json_error_problem(response: requests.Response | RawResponse, method: str = "GET") -> str:
    """Why this is not a 4xx with `{"error": {"code", "message"}}`; empty if it is."""
    status = response.status_code if isinstance(response, requests.Response) else response.status
    body = response.content if isinstance(response, requests.Response) else response.body
    if not 400 <= status < 500:
        return f"status {status}, body {body[:200]!r}"
    if b"Traceback" in body:
        return f"stack trace in body {body[:200]!r}"
    content_type = response.headers.get("Content-Type") or ""
    if not content_type.startswith("application/json"):
        return f"status {status} with Content-Type {content_type!r}"
    if method == "HEAD":
        return "" if not body else f"HEAD response with a body {body[:200]!r}"
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {status} without a JSON error body: {body[:200]!r}"
    if not isinstance(error.get("code"), str) or not isinstance(error.get("message"), str):
        return f"status {status} with a malformed error object {error!r}"
    return ""


def assert_json_error(response: requests.Response, status: int | None = None) -> None:
    problem = json_error_problem(response, response.request.method or "GET")
    assert not problem, f"{response.request.method} {response.url}: {problem}"
    if status is not None:
        assert response.status_code == status, response.content


def assert_refused(url: str) -> None:
    """A GET that must be a 400; a 200 (perhaps a live read) is not read, only reported."""
    with requests.get(url, stream=True, timeout=30) as response:
        assert response.status_code != 200, f"GET {url}: 200"
        assert_json_error(response, 400)


def tail_of(url: str) -> str:
    response = requests.head(url)
    assert response.status_code == 200, response.status_code
    return response.headers["Stream-Next-Offset"]


# -- hostile paths ------------------------------------------------------------------


def hostile_targets(marker: str) -> list[tuple[bytes, bool]]:
    """(request target, whether the app answers it) for every spelling of an escape.

    Targets the app answers must get a JSON error; gunicorn itself refuses request lines
    with raw control bytes before the app sees them, with its own (HTML) 400.
    """
    m = marker.encode()
    stream_relative = [
        b"../../" + m,
        b"a/../../../" + m,
        b"../" * 12 + m,
        b"%2e%2e/%2e%2e/" + m,
        b"%2E%2E%2F%2E%2E%2F" + m,
        b"..%2f..%2f" + m,
        b"a%2f..%2f..%2f" + m,
        b"%2e%2e%2f" * 12 + m,
        b"..\\..\\" + m,
        b"..%5c..%5c" + m,
        b"%2e%2e%5c%2e%2e%5c" + m,
        b"a\\b",
        b".",
        b"..",
        b"%2e",
        b"%2e%2e",
        b"a/./b",
        b"a/",
        b"a//b",
        b"a%00" + m,
        b"%00",
        b"a%01b",
        b"a%1f" + m,
        b"a%7f" + m,
        b"a%09b",
        b"a%0d%0a" + m,
        b"%c0%ae%c0%ae/" + m,
        b"%c0%ae%c0%ae%c0%af" + m,
        b"%e0%80%ae%e0%80%ae/" + m,
        b"%2fetc%2fpasswd",
        b"%2f%2e%2e%2f" + m,
        b"a" * (1024 + 76),
        b"/".join([b"d"] * 40),
        b"/".join([b"d"] * 33),
    ]
    targets = [(b"/v1/stream/" + path, True) for path in stream_relative]
    targets += [
        (b"//etc/passwd", True),
        (b"/v1/stream//etc/passwd", True),
        (b"/v1/stream//etc", True),
        (b"/v1/stream/a\x00" + m, False),
        (b"/v1/stream/a\x01b", False),
        (b"/v1/stream/a\x7fb", False),
        (b"/v1/stream/\xc0\xae\xc0\xae/" + m, False),
    ]
    return targets


def snapshot_ancestors(data_dir: Path) -> dict[Path, set[str]]:
    return {ancestor: set(os.listdir(ancestor)) for ancestor in data_dir.parents}


@pytest.mark.parametrize("method", METHODS)
def test_hostile_paths_get_a_json_4xx_and_touch_nothing_outside_the_data_dir(
    start_server: StartServer, method: str
) -> None:
    server = start_server()
    marker = f"pmq-escape-{uuid.uuid4().hex[:12]}"
    before = snapshot_ancestors(server.data_dir)

    problems = []
    for target, answered_by_app in hostile_targets(marker):
        body = b"x" if method in ("POST", "PUT") else b""
        response = send_raw(server, method, target, OCTETS if body else None, body)
        if answered_by_app:
            problem = json_error_problem(response, method)
        elif not 400 <= response.status < 500 or b"Traceback" in response.body:
            problem = f"status {response.status}, body {response.body[:200]!r}"
        else:
            problem = ""
        if problem:
            problems.append(f"{method} {target[:80]!r}: {problem}")
    assert not problems, "\n".join(problems)

    after = snapshot_ancestors(server.data_dir)
    for ancestor, names in after.items():
        escaped = sorted(name for name in names if marker in name)
        assert not escaped, f"{method}: files escaped the data dir into {ancestor}: {escaped}"
    sentinel = server.data_dir.parent
    assert after[sentinel] == before[sentinel], f"{method}: new entries beside the data dir"
    assert_all_inside(server.data_dir)
    assert_server_answers(server)


def assert_all_inside(data_dir: Path) -> None:
    root = data_dir.resolve()
    for directory, names, files in os.walk(data_dir):
        for name in names + files:
            path = Path(directory, name).resolve()
            assert path.is_relative_to(root), f"{Path(directory, name)} resolves to {path}"


def assert_server_answers(server: Server) -> None:
    url = server.stream_url(f"still-alive-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, headers=OCTETS).status_code == 201
    assert requests.post(url, data=b"ok", headers=OCTETS).status_code == 204
    response = requests.get(url)
    assert response.status_code == 200 and response.content == b"ok"


def test_longest_and_deepest_allowed_paths_are_accepted(server: Server) -> None:
    """The limits are boundaries, not guesses: exactly at them still works."""
    prefix = f"edge-{uuid.uuid4().hex[:12]}-"
    longest = prefix + "a" * (1024 - len(prefix))
    deepest = "/".join([prefix.rstrip("-")] + ["d"] * 31)
    for path in (longest, deepest):
        response = requests.put(server.stream_url(path), headers=OCTETS)
        assert response.status_code == 201, (path[:60], response.content)


def test_overlong_utf8_spellings_do_not_alias_one_stream(server: Server) -> None:
    """Two different invalid UTF-8 escapes must not name the same stream."""
    name = uuid.uuid4().hex[:12]
    first = send_raw(server, "PUT", f"/v1/stream/{name}%c0%ae".encode())
    second = send_raw(server, "GET", f"/v1/stream/{name}%ff%fe".encode())
    assert not (first.status == 201 and second.status == 200), (
        f"PUT .../{name}%c0%ae -> {first.status}, then GET .../{name}%ff%fe -> "
        f"{second.status}: both URLs decode to the same stream name"
    )


# -- request body size ----------------------------------------------------------------


@pytest.fixture
def small_server(start_server: StartServer) -> Server:
    return start_server(env={"PICOMQ_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)})


def chunks_of(data: bytes, size: int) -> Iterator[bytes]:
    """A generator body: requests sends it chunked, with no Content-Length."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_body_over_the_limit_gets_413(small_server: Server) -> None:
    url = small_server.stream_url(f"limit-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, headers=OCTETS).status_code == 201

    too_big = requests.post(url, data=b"x" * (MAX_REQUEST_BYTES + 1), headers=OCTETS)
    assert_json_error(too_big, 413)
    assert tail_of(url) == "0000000000000000_0000000000000000"

    exact = requests.post(url, data=b"y" * MAX_REQUEST_BYTES, headers=OCTETS)
    assert exact.status_code == 204, exact.content
    assert requests.get(url).content == b"y" * MAX_REQUEST_BYTES


def test_chunked_body_over_the_limit_gets_413_and_appends_nothing(small_server: Server) -> None:
    url = small_server.stream_url(f"chunked-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, headers=OCTETS).status_code == 201
    before = tail_of(url)

    body = b"z" * (MAX_REQUEST_BYTES + 500)
    response = requests.post(url, data=chunks_of(body, 300), headers=OCTETS)
    assert "Content-Length" not in response.request.headers
    assert response.status_code == 413, (
        f"a chunked {len(body)}-byte POST got {response.status_code}; the stream now holds "
        f"{len(requests.get(url).content)} bytes (limit {MAX_REQUEST_BYTES})"
    )
    assert_json_error(response, 413)
    assert tail_of(url) == before


def test_chunked_body_at_the_limit_is_accepted_whole(small_server: Server) -> None:
    url = small_server.stream_url(f"chunked-ok-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, headers=OCTETS).status_code == 201
    body = bytes(range(256)) * (MAX_REQUEST_BYTES // 256)
    response = requests.post(url, data=chunks_of(body, 100), headers=OCTETS)
    assert response.status_code == 204, response.content
    assert requests.get(url).content == body


def test_create_with_a_body_over_the_limit_gets_413_and_creates_nothing(
    small_server: Server,
) -> None:
    url = small_server.stream_url(f"put-limit-{uuid.uuid4().hex[:12]}")
    response = requests.put(url, data=b"x" * (MAX_REQUEST_BYTES + 1), headers=OCTETS)
    assert_json_error(response, 413)
    assert requests.head(url).status_code == 404


@pytest.mark.parametrize("method", ["POST", "PUT"])
def test_a_body_cut_short_by_the_client_is_400_and_stores_nothing(
    server: Server, unique_stream: str, method: str
) -> None:
    """Content-Length promises 1,000 bytes; 400 arrive, then the client stops sending."""
    url = server.stream_url(unique_stream)
    if method == "POST":
        assert requests.put(url, headers=OCTETS).status_code == 201
    head = (
        f"{method} {urlsplit(url).path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        "Content-Type: application/octet-stream\r\nContent-Length: 1000\r\n\r\n"
    )
    port = urlsplit(server.url).port
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_SECONDS) as sock:
        sock.sendall(head.encode() + b"x" * 400)
        sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        body = response.read()
    assert response.status == 400, (response.status, body)
    assert b"ended after 400 of its 1000 bytes" in body, body
    if method == "POST":
        assert tail_of(url) == "0000000000000000_0000000000000000"
    else:
        assert requests.head(url).status_code == 404


# -- malformed headers ----------------------------------------------------------------


@pytest.mark.parametrize("ttl", ["-1", "03600", "1.5", "abc", "+60", "1e3", "", "9" * 30])
def test_malformed_stream_ttl_is_400(server: Server, unique_stream: str, ttl: str) -> None:
    url = server.stream_url(unique_stream)
    assert_json_error(requests.put(url, headers={"Stream-TTL": ttl}), 400)
    assert requests.head(url).status_code == 404


@pytest.mark.parametrize(
    "expires_at",
    ["garbage", "", "2030-13-01T00:00:00Z", "2030-01-01T25:00:00Z", "2030-01-01T00:00:00", "2030"],
)
def test_malformed_stream_expires_at_is_400(
    server: Server, unique_stream: str, expires_at: str
) -> None:
    url = server.stream_url(unique_stream)
    assert_json_error(requests.put(url, headers={"Stream-Expires-At": expires_at}), 400)
    assert requests.head(url).status_code == 404


def test_ttl_and_expires_at_together_is_400(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    headers = {"Stream-TTL": "60", "Stream-Expires-At": "2999-01-01T00:00:00Z"}
    assert_json_error(requests.put(url, headers=headers), 400)
    assert requests.head(url).status_code == 404


TOO_BIG = str(2**53)
PRODUCER_HEADERS = [
    {"Producer-Id": "p"},
    {"Producer-Id": "p", "Producer-Epoch": "0"},
    {"Producer-Id": "p", "Producer-Seq": "0"},
    {"Producer-Epoch": "0", "Producer-Seq": "0"},
    {"Producer-Id": "", "Producer-Epoch": "0", "Producer-Seq": "0"},
    {"Producer-Id": "p", "Producer-Epoch": "x", "Producer-Seq": "0"},
    {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "one"},
    {"Producer-Id": "p", "Producer-Epoch": "-1", "Producer-Seq": "0"},
    {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "-1"},
    {"Producer-Id": "p", "Producer-Epoch": "1.0", "Producer-Seq": "0"},
    {"Producer-Id": "p", "Producer-Epoch": "01", "Producer-Seq": "0"},
    {"Producer-Id": "p", "Producer-Epoch": TOO_BIG, "Producer-Seq": "0"},
    {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": TOO_BIG},
    {"Producer-Id": "p", "Producer-Epoch": "9" * 40, "Producer-Seq": "0"},
]


@pytest.fixture
def octet_stream(server: Server, unique_stream: str) -> str:
    url = server.stream_url(unique_stream)
    assert requests.put(url, data=b"seed", headers=OCTETS).status_code == 201
    return url


@pytest.mark.parametrize("producer", PRODUCER_HEADERS, ids=lambda headers: repr(headers))
def test_malformed_producer_headers_are_400(octet_stream: str, producer: dict[str, str]) -> None:
    before = tail_of(octet_stream)
    response = requests.post(octet_stream, data=b"x", headers={**OCTETS, **producer})
    assert_json_error(response, 400)
    assert tail_of(octet_stream) == before


def test_largest_producer_numbers_are_accepted(octet_stream: str) -> None:
    largest = str(2**53 - 1)
    headers = {**OCTETS, "Producer-Id": "p", "Producer-Epoch": largest, "Producer-Seq": "0"}
    response = requests.post(octet_stream, data=b"x", headers=headers)
    assert response.status_code == 200, response.content
    assert response.headers["Producer-Epoch"] == largest


BAD_OFFSET_QUERIES = [
    "offset=",
    "offset=-1&offset=-1",
    "offset=-1&offset=0000000000000000_0000000000000000",
    "offset=abc",
    "offset=0000000000000000_00000000000000zz",
    "offset=0000000000000000_0000000000000000%2Fx",
    "offset=0000000000000000_0000000000000000/x",
    "offset=0000000000000000_0000000000000000,0000000000000000_0000000000000001",
    "offset=0000000000000000_0000000000000000%20",
    "offset=%20",
    "offset=..",
    "offset=%00",
    "offset=0000000000000000_0000000000000000%0A",
    "offset=-2",
    "offset=NOW",
    "offset=0000000000000000_0000000000000000_0",
    "offset=0000000000000000_" + "%D9%A0" * 15 + "%D9%A1",  # Arabic-Indic digits: 0...01
]


@pytest.mark.parametrize("query", BAD_OFFSET_QUERIES)
def test_malformed_offsets_are_400(octet_stream: str, query: str) -> None:
    for live in ("", "&live=long-poll", "&live=sse"):
        assert_refused(f"{octet_stream}?{query}{live}")


@pytest.mark.parametrize(
    "query",
    ["offset=-1&live=bogus", "offset=-1&live=", "offset=-1&live=LONG-POLL", "offset=-1&live=true"]
    + ["live=long-poll", "live=sse"],
)
def test_bad_live_values_are_400(octet_stream: str, query: str) -> None:
    assert_refused(f"{octet_stream}?{query}")


# -- malformed bodies -----------------------------------------------------------------

MALFORMED_JSON = [
    b"{",
    b"[1,",
    b"[1,]",
    b"NaN",
    b"[Infinity]",
    b"[-Infinity]",
    b"{'a': 1}",
    b"[1]x",
    b"1 2",
    b"   ",
    b"\xff\xfe",
    b'["\xff"]',
    b'{"\xc3": 1}',
    b'["\xed\xa0\x80"]',
    b'"unterminated',
    b"[" * 100_000,
]


@pytest.fixture
def json_stream(server: Server, unique_stream: str) -> str:
    url = server.stream_url(unique_stream)
    assert requests.put(url, headers=JSON).status_code == 201
    return url


@pytest.mark.parametrize("body", MALFORMED_JSON, ids=lambda body: repr(body[:12]))
def test_malformed_json_bodies_are_400(server: Server, json_stream: str, body: bytes) -> None:
    assert_json_error(requests.post(json_stream, data=body, headers=JSON), 400)
    assert requests.get(json_stream).json() == []
    fresh = server.stream_url(f"json-put-{uuid.uuid4().hex[:12]}")
    assert_json_error(requests.put(fresh, data=body, headers=JSON), 400)
    assert requests.head(fresh).status_code == 404


def test_deeply_nested_valid_json_is_never_a_5xx(json_stream: str) -> None:
    # 990 and 1,020 once got 500: orjson parsed them, then the stdlib fallback that
    # serialised each message ran out of recursion. The depth limit now refuses them.
    for depth in (500, 990, 1_020, 5_000, 50_000):
        body = b"[" * depth + b"]" * depth
        response = requests.post(json_stream, data=body, headers=JSON)
        assert response.status_code < 500, (depth, response.content)


@pytest.mark.parametrize("body", [b'["\\ud800"]', b'"\\udfff"', b'{"k": "a\\udc00b"}'])
def test_lone_surrogate_escapes_are_stored_faithfully_or_refused(
    json_stream: str, body: bytes
) -> None:
    """Valid JSON text that names no Unicode character: keep it exactly, or say 400."""
    response = requests.post(json_stream, data=body, headers=JSON)
    assert response.status_code in (204, 400), (response.status_code, response.content)
    if response.status_code == 400:
        assert_json_error(response, 400)
        return
    sent = json.loads(body)
    assert json.loads(requests.get(json_stream).content) == (
        sent if isinstance(sent, list) else [sent]
    )


def test_empty_json_array_post_is_400(json_stream: str) -> None:
    assert_json_error(requests.post(json_stream, data=b"[]", headers=JSON), 400)
    assert requests.get(json_stream).json() == []


@pytest.mark.parametrize("closed", [None, "false", "1", "yes"])
def test_empty_post_without_stream_closed_true_is_400(octet_stream: str, closed: str) -> None:
    headers = dict(OCTETS) if closed is None else {**OCTETS, "Stream-Closed": closed}
    assert_json_error(requests.post(octet_stream, data=b"", headers=headers), 400)
    assert "Stream-Closed" not in requests.head(octet_stream).headers


# -- settings -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "-1"])
def test_invalid_long_poll_timeout_stops_the_boot_with_a_message(
    start_server: StartServer, value: str
) -> None:
    """gunicorn must exit (not respawn workers forever) and say which variable is wrong."""
    with pytest.raises(pytest.fail.Exception) as failure:
        start_server(env={"PICOMQ_LONG_POLL_TIMEOUT": value})
    message = str(failure.value)
    assert "exited before answering HTTP" in message, message
    assert "PICOMQ_LONG_POLL_TIMEOUT" in message and value in message, message
    assert "Traceback" not in message, message


# -- JSON nesting depth -----------------------------------------------------------------

DEFAULT_MAX_JSON_DEPTH = 128


def nested_json(depth: int) -> bytes:
    """Arrays and objects alternating, `depth` deep counting the outer array."""
    opening = b"".join(b"[" if level % 2 == 0 else b'{"k":' for level in range(depth))
    closing = b"".join(b"]" if level % 2 == 0 else b"}" for level in reversed(range(depth)))
    return opening + b"1" + closing


@pytest.mark.parametrize("method", ["POST", "PUT"])
def test_json_at_the_depth_limit_is_stored_and_one_level_deeper_is_400(
    server: Server, method: str
) -> None:
    url = server.stream_url(f"depth-{uuid.uuid4().hex[:12]}")
    if method == "POST":
        assert requests.put(url, headers=JSON).status_code == 201
    deepest = nested_json(DEFAULT_MAX_JSON_DEPTH)
    response = requests.request(method, url, data=deepest, headers=JSON)
    assert response.status_code in (201, 204), response.content
    assert json.loads(requests.get(url).content) == json.loads(deepest)

    fresh = server.stream_url(f"too-deep-{uuid.uuid4().hex[:12]}")
    target = url if method == "POST" else fresh
    response = requests.request(
        method, target, data=nested_json(DEFAULT_MAX_JSON_DEPTH + 1), headers=JSON
    )
    assert_json_error(response, 400)
    assert str(DEFAULT_MAX_JSON_DEPTH) in response.json()["error"]["message"]
    assert json.loads(requests.get(url).content) == json.loads(deepest)
    assert requests.head(fresh).status_code == 404


def test_brackets_inside_json_strings_do_not_count(json_stream: str) -> None:
    text = '[[[{{"\\"[' * 100
    body = json.dumps([{"text": text, "more": ["]" * 300, "[" * 300]}]).encode()
    response = requests.post(json_stream, data=body, headers=JSON)
    assert response.status_code == 204, response.content
    assert json.loads(requests.get(json_stream).content) == json.loads(body)


def test_json_depth_limit_is_configurable(start_server: StartServer) -> None:
    server = start_server(env={"PICOMQ_MAX_JSON_DEPTH": "3"})
    url = server.stream_url(f"depth3-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, headers=JSON).status_code == 201
    assert requests.post(url, data=nested_json(3), headers=JSON).status_code == 204
    assert_json_error(requests.post(url, data=nested_json(4), headers=JSON), 400)
    assert requests.get(url).json() == [json.loads(nested_json(3))[0]]


def test_the_tightest_nesting_is_measured_to_the_level(start_server: StartServer) -> None:
    # Two bytes a level, the fewest JSON allows: the bound that lets short bodies skip
    # the bracket scan must still send these through it.
    server = start_server(env={"PICOMQ_MAX_JSON_DEPTH": "3"})
    url = server.stream_url(f"tight-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, headers=JSON).status_code == 201
    far_too_deep = b"[" * 100_000 + b"]" * 100_000  # past Python's recursion limit too
    for too_deep in (b"[[[[]]]]", b"[1,[[[]]]]", b'{"":{"":{"":{}}}}', b"[[[{}]]]", far_too_deep):
        response = requests.post(url, data=too_deep, headers=JSON)
        assert_json_error(response, 400)
        assert "nests deeper than 3 levels" in response.json()["error"]["message"]
    for at_the_limit in (b"[[[]]]", b"[1,[[]]]", b'{"":{"":{}}}'):
        assert requests.post(url, data=at_the_limit, headers=JSON).status_code == 204
    assert requests.get(url).json() == [[[]], 1, [[]], {"": {"": {}}}]


@pytest.mark.parametrize("value", ["0", "201", "deep"])
def test_json_depth_setting_is_validated(value: str) -> None:
    with pytest.raises(SettingsError, match="PICOMQ_MAX_JSON_DEPTH"):
        Settings.from_environment({"PICOMQ_MAX_JSON_DEPTH": value})


# -- live connections per worker ----------------------------------------------------------


def open_sse(url: str) -> requests.Response:
    """An SSE read surely in flight: its first event has arrived."""
    response = requests.get(url, params={"offset": "-1", "live": "sse"}, stream=True, timeout=30)
    assert response.status_code == 200, response.content
    assert b"event: control" in next(response.iter_content(chunk_size=None))
    return response


def assert_busy(response: requests.Response) -> None:
    assert response.status_code == 503, (response.status_code, response.content[:200])
    assert response.headers["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "too_many_live_connections"
    assert response.headers["Retry-After"].isdigit()


def wait_until_admitted(url: str) -> requests.Response:
    """Long-poll until the server has a free slot again (it notices a gone client when it
    next writes to it); fails after a generous deadline rather than asserting speed."""
    deadline = time.monotonic() + 30
    while True:
        response = requests.get(url, params={"offset": "now", "live": "long-poll"}, timeout=30)
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_live_reads_past_the_limit_get_503_and_their_slots_come_back(
    start_server: StartServer,
) -> None:
    server = start_server(env={"PICOMQ_MAX_LIVE_CONNECTIONS": "2"})
    url = server.stream_url(f"live-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, data=b"seed", headers=OCTETS).status_code == 201

    first, second = open_sse(url), open_sse(url)
    assert_busy(requests.get(url, params={"offset": "-1", "live": "sse"}, timeout=30))
    assert_busy(requests.get(url, params={"offset": "-1", "live": "long-poll"}, timeout=30))
    # Everything that does not wait is still served.
    assert requests.get(url, params={"offset": "-1"}).content == b"seed"
    assert requests.post(url, data=b"+", headers=OCTETS).status_code == 204
    assert requests.head(url).status_code == 200

    first.close()
    assert wait_until_admitted(url).status_code == 204
    second.close()
    assert wait_until_admitted(url).status_code == 204


def test_finished_live_reads_give_their_slots_back(start_server: StartServer) -> None:
    server = start_server(env={"PICOMQ_MAX_LIVE_CONNECTIONS": "1"})
    url = server.stream_url(f"live1-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, data=b"seed", headers=OCTETS).status_code == 201
    for _ in range(3):  # 204 after the timeout, and 200 with data: each releases its slot
        waited = requests.get(url, params={"offset": "now", "live": "long-poll"}, timeout=30)
        assert waited.status_code == 204, waited.content
        data = requests.get(url, params={"offset": "-1", "live": "long-poll"}, timeout=30)
        assert data.status_code == 200, data.content
        refused = requests.get(url, params={"offset": "x", "live": "long-poll"}, timeout=30)
        assert_json_error(refused, 400)
    assert requests.post(url, headers={"Stream-Closed": "true"}).status_code == 204
    for _ in range(3):  # an SSE read of a closed stream ends by itself
        with requests.get(url, params={"offset": "-1", "live": "sse"}, timeout=30) as response:
            assert response.status_code == 200, response.content
            assert b"streamClosed" in response.content


# -- header and request-line sizes ------------------------------------------------------


def test_headers_past_the_limits_are_refused_by_gunicorn_in_json(
    start_server: StartServer,
) -> None:
    server = start_server(env={"PICOMQ_MAX_HEADER_BYTES": "1024", "PICOMQ_MAX_HEADERS": "20"})
    url = server.stream_url(f"headers-{uuid.uuid4().hex[:12]}")
    target = urlsplit(url).path.encode()
    fitting = {"X-Pad": "p" * 900, **{f"X-Extra-{n}": "1" for n in range(10)}}
    assert send_raw(server, "PUT", target, fitting).status == 201
    too_long = send_raw(server, "GET", target, {"X-Pad": "p" * 2000})
    too_many = send_raw(server, "GET", target, {f"X-Extra-{n}": "1" for n in range(30)})
    long_line = send_raw(server, "GET", target + b"?cursor=" + b"1" * 9000)
    malformed = send_raw(server, "GET", b"no-slash")
    expected = ((too_long, 431), (too_many, 431), (long_line, 414), (malformed, 400))
    for response, status in expected:
        assert response.status == status, (response.status, response.body[:200])
        assert not json_error_problem(response), (status, json_error_problem(response))
    assert_server_answers(server)


def test_longest_path_percent_encoded_with_a_token_sized_query_fits_the_request_line(
    server: Server,
) -> None:
    """1,024 bytes of two-byte UTF-8 become 3,072 characters of %XX in the request line."""
    path = "\u00e9" * (1024 // 2)
    url = server.stream_url(path)
    put = requests.put(url, headers=OCTETS)
    assert put.status_code in (200, 201), put.content
    cursor = "1" * 1200
    response = requests.get(
        url, params={"offset": "-1", "cursor": cursor, "access_token": "t" * 900}
    )
    assert response.status_code == 200, response.content


# -- what one stream's appends may make the server keep (security review) ------------------


def test_producer_ids_and_stream_seqs_past_their_limit_are_400(octet_stream: str) -> None:
    before = tail_of(octet_stream)
    longest = "p" * MAX_PRODUCER_ID_BYTES
    headers = {**OCTETS, "Producer-Id": longest + "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
    assert_json_error(requests.post(octet_stream, data=b"x", headers=headers), 400)
    too_long_seq = {**OCTETS, "Stream-Seq": "9" * (MAX_STREAM_SEQ_BYTES + 1)}
    assert_json_error(requests.post(octet_stream, data=b"x", headers=too_long_seq), 400)
    assert tail_of(octet_stream) == before
    headers = {**OCTETS, "Producer-Id": longest, "Producer-Epoch": "0", "Producer-Seq": "0"}
    assert requests.post(octet_stream, data=b"x", headers=headers).status_code == 200
    seq = {**OCTETS, "Stream-Seq": "9" * MAX_STREAM_SEQ_BYTES}
    assert requests.post(octet_stream, data=b"x", headers=seq).status_code == 204


def test_a_json_append_of_too_many_messages_is_413_before_it_is_parsed(
    start_server: StartServer,
) -> None:
    server = start_server(env={"PICOMQ_MAX_APPEND_MESSAGES": "1000"})
    url = server.stream_url(f"tiny-{uuid.uuid4().hex[:12]}")
    assert requests.put(url, headers=JSON).status_code == 201
    at_limit = b"[" + b",".join([b"0"] * 1000) + b"]"
    assert requests.post(url, data=at_limit, headers=JSON).status_code == 204
    over = b"[" + b",".join([b"0"] * 1001) + b"]"
    assert_json_error(requests.post(url, data=over, headers=JSON), 413)
    # Commas inside strings and nested values are no items of the array.
    nested = b"[" + b",".join([b'{"a":[1,2,3],"b":"x,y,z"}'] * 1000) + b"]"
    assert requests.post(url, data=nested, headers=JSON).status_code == 204
    fresh = server.stream_url(f"tiny-put-{uuid.uuid4().hex[:12]}")
    assert_json_error(requests.put(fresh, data=over, headers=JSON), 413)
    assert len(requests.get(url).json()) == 2000


def test_forks_of_forks_past_the_depth_limit_are_400(server: Server, unique_stream: str) -> None:
    root = server.stream_url(f"{unique_stream}-0")
    assert requests.put(root, data=b"a", headers=OCTETS).status_code == 201
    for depth in range(1, MAX_FORK_DEPTH + 2):
        source = f"/v1/stream/{unique_stream}-{depth - 1}"
        fork = server.stream_url(f"{unique_stream}-{depth}")
        response = requests.put(fork, headers={"Stream-Forked-From": source})
        if depth <= MAX_FORK_DEPTH:
            assert response.status_code == 201, (depth, response.content)
    assert_json_error(response, 400)
    assert requests.get(server.stream_url(f"{unique_stream}-{MAX_FORK_DEPTH}")).content == b"a"
    assert requests.get(f"{server.url}/v1/streams", params={"prefix": unique_stream}).ok


def test_a_json_fork_inside_a_message_is_400(json_stream: str, server: Server) -> None:
    offset = requests.post(json_stream, data=b'[{"a": 1}]', headers=JSON).headers[
        "Stream-Next-Offset"
    ]
    requests.post(json_stream, data=b'[{"b": 2}]', headers=JSON)
    inside = f"{offset[:17]}{int(offset[17:]) + 2:016d}"  # two bytes into the second message
    source = json_stream.split(server.url, 1)[1]
    for fork_offset, status in ((inside, 400), (offset, 201)):
        fork = server.stream_url(f"json-fork-{uuid.uuid4().hex[:12]}")
        headers = {"Stream-Forked-From": source, "Stream-Fork-Offset": fork_offset}
        response = requests.put(fork, headers=headers)
        assert response.status_code == status, response.content
