"""Generated requests against a real server: zero 5xx, nothing written outside the data
directory, and a server that still works afterwards.

schemathesis drives every operation in openapi.yaml (examples, boundary values,
random and schema-violating data, and create→append/read/delete sequences); hypothesis
drives offsets, stream paths and protocol headers. Runs are seeded, so a failure
reproduces; each prints how many requests it sent. PICOMQ_FUZZ_SEED picks another seed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, unquote_to_bytes, urlsplit

import jwt
import pytest
import requests
from conftest import REPO_DIR, find_executable, make_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_limits import (
    RawResponse,
    assert_all_inside,
    assert_server_answers,
    json_error_problem,
    send_raw,
    snapshot_ancestors,
)

if TYPE_CHECKING:
    from conftest import Server

SEED = int(os.environ.get("PICOMQ_FUZZ_SEED", "1"))
SCHEMATHESIS_TIMEOUT_SECONDS = 240
SECRET = "fuzz-secret-" + "f" * 52
OCTETS = {"Content-Type": "application/octet-stream"}
SEEDED_STREAMS = {  # the path examples in openapi.yaml, so generated requests find data
    "fuzz-bytes": ({"Content-Type": "application/octet-stream"}, b"\x00\x01seed bytes\xff"),
    "fuzz-json": ({"Content-Type": "application/json"}, b'[1, {"a": [2, "three"]}, null]'),
    "fuzz-text": ({"Content-Type": "text/plain"}, "héllo\nworld".encode()),
    "fuzz-closed": ({"Content-Type": "text/plain", "Stream-Closed": "true"}, b"the end"),
}
HYPOTHESIS = settings(
    max_examples=300,
    deadline=None,  # never a wall-clock assertion
    database=None,  # nothing written into the checkout
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


class RequestCount:
    """Requests sent by the hypothesis tests, printed with the figures at the end."""

    def __init__(self, server: Server | None = None) -> None:
        self.server = server
        self.by_status: Counter[int] = Counter()

    def send(self, method: str, url: str, **arguments: object) -> requests.Response:
        response = requests.request(method, url, timeout=30, **arguments)
        self.by_status[response.status_code] += 1
        return response

    def raw(self, method: str, target: str, body: bytes = b"") -> RawResponse:
        """`target` exactly as given, on the fuzz server."""
        response = send_raw(self.server, method, target.encode(), OCTETS, body)
        self.by_status[response.status] += 1
        return response


def report(capsys: pytest.CaptureFixture[str], name: str, statuses: Counter[int]) -> None:
    summary = ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items()))
    with capsys.disabled():
        print(f"\n[fuzz] {name}: {sum(statuses.values())} requests ({summary})")


def assert_json_4xx(response: requests.Response, context: object) -> None:
    """Never a 5xx; a 4xx from the app has a JSON error body. gunicorn's own refusals
    (request line or header limits, malformed requests) are HTML: the app never saw them."""
    status, body = response.status_code, response.content
    assert status < 500, (context, status, body[:300])
    if status < 400:
        return
    content_type = response.headers.get("Content-Type", "")
    if content_type.startswith("text/html"):
        assert status in (400, 414, 431), (context, status, body[:300])
        return
    assert content_type.startswith("application/json"), (context, status, content_type)
    if response.request.method != "HEAD":
        error = response.json()["error"]
        assert isinstance(error["code"], str) and isinstance(error["message"], str), context


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Short live reads, so generated long-polls and SSE reads end quickly."""
    server = make_server(
        tmp_path_factory.mktemp("picomq-fuzz"),
        long_poll_timeout=0.2,
        env={"PICOMQ_SSE_MAX_DURATION": "0.3"},
    )
    server.start()
    seed_streams(server)
    yield server
    server.stop()


def seed_streams(server: Server, headers: dict[str, str] | None = None) -> None:
    for path, (stream_headers, data) in SEEDED_STREAMS.items():
        url = server.stream_url(path)
        response = requests.put(url, data=data, headers={**stream_headers, **(headers or {})})
        assert response.status_code in (200, 201), (path, response.content)


@pytest.fixture
def outside_untouched(fuzz_server: Server) -> Iterator[set[str]]:
    """Yields a set for the test to fill with every path segment it sent. Afterwards: no
    new entry beside the data dir (a directory only this server uses), no new entry
    named like a sent segment further up (other processes share those directories),
    and nothing inside the data dir that resolves outside it."""
    sent: set[str] = set()
    before = snapshot_ancestors(fuzz_server.data_dir)
    yield sent
    after = snapshot_ancestors(fuzz_server.data_dir)
    sentinel = fuzz_server.data_dir.parent
    assert after[sentinel] == before[sentinel], "entries appeared beside the data directory"
    for ancestor, names in after.items():
        escaped = (names - before[ancestor]) & sent
        assert not escaped, f"{sorted(escaped)[:10]} appeared in {ancestor}"
    assert_all_inside(fuzz_server.data_dir)
    assert_server_answers(fuzz_server)


def segments_of(url_path: str) -> set[str]:
    """Every name a request path could create: decoded, split on both kinds of slash."""
    decoded = unquote(url_path.partition("/v1/stream/")[2], errors="replace")
    return {name for name in re.split(r"[/\\]", decoded) if name}


# -- schemathesis over openapi.yaml ---------------------------------------------------


def run_schemathesis(server: Server, har: Path, max_examples: int, *options: str) -> list[dict]:
    """Run `st run` on openapi.yaml against `server`; the HAR entries of every request."""
    command = [
        str(find_executable("st")),
        "run",
        str(REPO_DIR / "openapi.yaml"),
        "--url",
        server.url,
        "--checks",
        "not_a_server_error",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--max-examples",
        str(max_examples),
        "--seed",
        str(SEED),
        "--request-timeout",
        "30",
        "--report",
        "har",
        "--report-har-path",
        str(har),
        "--no-color",
        *options,
    ]
    result = subprocess.run(
        command,
        cwd=har.parent,
        capture_output=True,
        text=True,
        timeout=SCHEMATHESIS_TIMEOUT_SECONDS,
    )
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-6000:]}{result.stderr}"
    return json.loads(har.read_text())["log"]["entries"]


def statuses_of(entries: list[dict]) -> Counter[int]:
    return Counter(entry["response"]["status"] for entry in entries)


def test_schemathesis_finds_no_server_error(
    fuzz_server: Server,
    outside_untouched: set[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    entries = run_schemathesis(fuzz_server, tmp_path / "run.har", 50)
    for entry in entries:
        outside_untouched.update(segments_of(urlsplit(entry["request"]["url"]).path))
    statuses = statuses_of(entries)
    report(capsys, "schemathesis, access control off", statuses)
    assert not [status for status in statuses if status >= 500], statuses
    assert len(entries) >= 500, "schemathesis sent fewer requests than a real run does"
    for status in (200, 201, 204, 400, 404, 409):  # it reached the core, not just errors
        assert statuses[status] > 0, statuses


def test_schemathesis_with_access_control_on(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The same run through the token check, with a token that may do everything."""
    server = make_server(
        tmp_path_factory.mktemp("picomq-fuzz-auth"),
        long_poll_timeout=0.2,
        env={"PICOMQ_SSE_MAX_DURATION": "0.3", "PICOMQ_JWT_SECRET": SECRET},
    )
    server.start()
    try:
        scope = "read:** append:** create:** delete:** admin:**"
        token = jwt.encode({"scope": scope, "exp": int(time.time()) + 3600}, SECRET)
        authorization = {"Authorization": f"Bearer {token}"}
        seed_streams(server, authorization)
        before = snapshot_ancestors(server.data_dir)
        entries = run_schemathesis(
            server, tmp_path / "auth.har", 20, "--header", f"Authorization: Bearer {token}"
        )
        statuses = statuses_of(entries)
        report(capsys, "schemathesis, access control on", statuses)
        assert not [status for status in statuses if status >= 500], statuses
        assert statuses[201] > 0 and statuses[200] > 0, statuses  # the token let them in
        sentinel = server.data_dir.parent
        assert snapshot_ancestors(server.data_dir)[sentinel] == before[sentinel]
        assert_all_inside(server.data_dir)
        url = server.stream_url(f"after-{uuid.uuid4().hex[:12]}")
        assert requests.put(url, headers={**OCTETS, **authorization}).status_code == 201
        assert requests.head(url).status_code == 401
    finally:
        server.stop()


# -- hypothesis: offsets --------------------------------------------------------------

OFFSET_DIGITS = st.integers(min_value=0, max_value=10**16 - 1)
OFFSET_TEXT = st.one_of(
    st.just("-1"),
    st.just("now"),
    OFFSET_DIGITS.map(lambda n: f"{0:016d}_{n:016d}"),
    st.integers(min_value=0, max_value=64).map(lambda n: f"{0:016d}_{n:016d}"),
    st.tuples(OFFSET_DIGITS, OFFSET_DIGITS).map(lambda p: f"{p[0]:016d}_{p[1]:016d}"),
    st.from_regex(r"-?[0-9_]{0,40}", fullmatch=True),
    st.text(max_size=60),
)


def test_offsets_read_exactly_the_rest_or_are_refused(
    fuzz_server: Server, outside_untouched: set[str], capsys: pytest.CaptureFixture
) -> None:
    """Any offset: a 4xx, or the stream's bytes from the start of the append holding it
    (here, one append: all of them), none past the tail; for every read mode."""
    path = f"offsets-{uuid.uuid4().hex[:12]}"
    outside_untouched.add(path)
    url = fuzz_server.stream_url(path)
    data = bytes(range(256)) * 2
    headers = {**OCTETS, "Stream-Closed": "true"}  # closed: live reads end at once
    assert requests.put(url, data=data, headers=headers).status_code == 201
    counter = RequestCount()

    @HYPOTHESIS
    @given(offset=OFFSET_TEXT, live=st.sampled_from([None, "long-poll", "sse"]))
    def check(offset: str, live: str | None) -> None:
        params = {"offset": offset} if live is None else {"offset": offset, "live": live}
        response = counter.send("GET", url, params=params)
        assert_json_4xx(response, (offset, live))
        if response.status_code >= 400 or live is not None:
            return
        start = 0 if offset == "-1" else len(data) if offset == "now" else int(offset[17:])
        expected = data if start < len(data) else b""
        assert response.content == expected, (offset, response.status_code)

    check()
    report(capsys, "hypothesis, offsets", counter.by_status)
    assert counter.by_status[200] > 0 and counter.by_status[400] > 0, counter.by_status


# -- hypothesis: stream paths ---------------------------------------------------------

SEGMENT = st.one_of(
    st.sampled_from(["", ".", "..", "%2e%2e", "%2F", "%00", "%c0%ae", "a\\b", "~", "__ds"]),
    st.text(min_size=1, max_size=12),
    st.text(alphabet="abc./%\\", min_size=1, max_size=6),
)
PATHS = st.lists(SEGMENT, min_size=1, max_size=6).map("/".join)


def test_generated_paths_name_one_stream_each_or_are_refused(
    fuzz_server: Server, outside_untouched: set[str], capsys: pytest.CaptureFixture
) -> None:
    """A path is refused (4xx) or names its own stream: created once, never an alias.

    Sent over raw sockets: HTTP clients rewrite dot segments and bad escapes first."""
    prefix = f"paths-{uuid.uuid4().hex[:12]}"
    created: dict[str, bytes] = {}
    counter = RequestCount(fuzz_server)

    @HYPOTHESIS
    @given(path=PATHS, safe=st.sampled_from(["/", "/%"]))
    def check(path: str, safe: str) -> None:
        target = f"/v1/stream/{prefix}/{quote(path, safe=safe)}"  # "/%": escapes sent as is
        name = unquote_to_bytes(target[len("/v1/stream/") :]).decode(errors="replace")
        outside_untouched.update(segments_of(target))
        data = uuid.uuid4().bytes
        response = counter.raw("PUT", target, data)
        if response.status == 201:  # first: a failure below must not hide this create
            assert name not in created, f"{target} created {name!r} twice"
            created[name] = data
        problem = json_error_problem(response, "PUT") if response.status >= 400 else ""
        assert not problem and response.status in (200, 201, 400, 409), (target, problem)
        if "\ufffd" in name:  # not UTF-8: refused, so no two such spellings can alias
            assert response.status == 400, (target, response.status)
        if response.status == 200:  # it exists: this very path must have created it
            assert name in created, f"{target} answered 200, but {name!r} was never created"
        if response.status == 201:
            assert counter.raw("GET", target).body == data, target

    check()
    for name, data in created.items():  # no later path overwrote or aliased an earlier one
        assert counter.raw("GET", f"/v1/stream/{quote(name, safe='/')}").body == data, name
    report(capsys, "hypothesis, stream paths", counter.by_status)
    assert created and counter.by_status[400] > 0, counter.by_status


# -- hypothesis: protocol headers ----------------------------------------------------

JUNK = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40),
    st.sampled_from(["", "-1", "0", "00", "1.5", str(2**53), "9" * 30, "true", "%00", " x"]),
)
DECIMAL = st.integers(min_value=0, max_value=2**53 + 10).map(str)
OFFSET = st.integers(min_value=0, max_value=40).map(lambda n: f"{0:016d}_{n:016d}")
MOMENT = st.datetimes(timezones=st.timezones()).map(lambda moment: moment.isoformat())
# Per header: values the protocol accepts, mixed with junk, so requests get past the
# first check often enough to reach the store.
HEADERS = {
    "Content-Type": st.sampled_from(
        ["application/octet-stream", "application/json", "text/plain; charset=utf-8", "x/y"]
    ),
    "Stream-TTL": DECIMAL,
    "Stream-Expires-At": MOMENT,
    "Stream-Closed": st.sampled_from(["true", "false", "TRUE"]),
    "Stream-Seq": st.text(alphabet="0123456789abc", max_size=8),
    "Stream-Forked-From": st.sampled_from([*SEEDED_STREAMS, "/v1/stream/fuzz-json", "../x"]),
    "Stream-Fork-Offset": OFFSET,
    "Stream-Fork-Sub-Offset": DECIMAL,
    "Stream-Retention-Age": DECIMAL,
    "Stream-Retention-Bytes": DECIMAL,
    "Producer-Id": st.sampled_from(["p1", "p2"]),
    "Producer-Epoch": st.integers(min_value=0, max_value=3).map(str),
    "Producer-Seq": st.integers(min_value=0, max_value=5).map(str),
    "If-None-Match": st.text(max_size=20).map(lambda text: f'"{text}"'),
    "Authorization": st.sampled_from(["Bearer x", "Basic eDp5"]),
}


def header_values(name: str) -> st.SearchStrategy[str]:
    """Valid-looking or junk; never what an HTTP client refuses to send."""
    sendable = st.one_of(HEADERS[name], JUNK).filter(
        lambda value: value.isprintable() and value == value.strip()
    )
    return sendable.map(lambda value: value.encode("latin-1", "replace").decode("latin-1"))


HEADER_SETS = st.lists(
    st.sampled_from(list(HEADERS)).flatmap(
        lambda name: st.tuples(st.just(name), header_values(name))
    ),
    max_size=7,
).map(dict)
BODIES = st.one_of(st.binary(max_size=64), st.sampled_from([b"[]", b"[1,2]", b'{"a":1}', b"["]))


def test_generated_headers_never_cause_a_server_error(
    fuzz_server: Server, outside_untouched: set[str], capsys: pytest.CaptureFixture
) -> None:
    base = f"headers-{uuid.uuid4().hex[:12]}"
    outside_untouched.update({base, "a", "b", *SEEDED_STREAMS})
    counter = RequestCount()

    @HYPOTHESIS
    @given(
        method=st.sampled_from(["PUT", "POST", "GET", "HEAD", "DELETE"]),
        name=st.sampled_from([*SEEDED_STREAMS, f"{base}/a", f"{base}/b"]),
        headers=HEADER_SETS,
        body=BODIES,
    )
    def check(method: str, name: str, headers: dict[str, str], body: bytes) -> None:
        data = body if method in ("PUT", "POST") else None
        response = counter.send(method, fuzz_server.stream_url(name), data=data, headers=headers)
        assert_json_4xx(response, (method, name, headers, body))

    check()
    report(capsys, "hypothesis, headers", counter.by_status)
    assert counter.by_status[400] > 0, counter.by_status


# -- hypothesis: numbers --------------------------------------------------------------

ASCII_DIGITS = st.text(alphabet="0123456789", max_size=4)
OTHER_DIGITS = st.characters(categories=["Nd", "No"]).filter(lambda character: ord(character) > 127)
# Text that str.isdigit() or int() takes, or on which int() raises, and that is no number
# of the protocol: past 16 digits (and past int()'s 4,300), digits of other scripts (one
# among ours too), a sign, a space, a separator, a leading zero, past 2^53 - 1.
NOT_NUMBERS = st.one_of(
    st.integers(min_value=17, max_value=6000).map(lambda count: "9" * count),
    st.text(alphabet=OTHER_DIGITS, min_size=1, max_size=8),
    st.tuples(ASCII_DIGITS, OTHER_DIGITS, ASCII_DIGITS).map("".join),
    st.sampled_from(["²", "٣", "３", "+1", "-1", "1 2", "1_0", "0x1", "01", "1.0", "1e3", ""]),
    st.sampled_from([str(2**53), "9" * 16]),
)
NUMBER_PLACES = (
    "Stream-TTL",
    "Stream-Retention-Age",
    "Stream-Retention-Bytes",
    "Stream-Fork-Sub-Offset",
    "Producer-Epoch",
    "Producer-Seq",
    "Content-Length",
    "cursor, long-poll",
    "cursor, SSE",
    "limit",
)


def carrying_number(place: str, value: str, prefix: str) -> tuple[str, str, dict[str, str]]:
    """Method, target and headers of a request that carries `value` at `place`, on the
    streams under `prefix`: `closed` (live reads end at once) and `bytes`."""
    query = quote(value, safe="")
    live = f"/v1/stream/{prefix}/closed?offset=-1&live="
    producer = {"Producer-Id": "numbers", "Producer-Epoch": "0", "Producer-Seq": "0"}
    if place.startswith("Producer-"):
        return "POST", f"/v1/stream/{prefix}/bytes", {**OCTETS, **producer, place: value}
    if place == "Content-Length":
        return "POST", f"/v1/stream/{prefix}/bytes", {**OCTETS, place: value}
    if place == "Stream-Fork-Sub-Offset":
        return (
            "PUT",
            f"/v1/stream/{prefix}/new",
            {"Stream-Forked-From": f"{prefix}/bytes", place: value},
        )
    if place.startswith("Stream-"):
        return "PUT", f"/v1/stream/{prefix}/new", {**OCTETS, place: value}
    if place == "limit":
        return "GET", f"/v1/streams?limit={query}", {}
    return "GET", f"{live}{'sse' if 'SSE' in place else 'long-poll'}&cursor={query}", {}


def test_every_number_a_request_carries_is_ascii_digits_or_refused(
    fuzz_server: Server, outside_untouched: set[str], capsys: pytest.CaptureFixture
) -> None:
    """Each numeric header and query parameter, given what is no number: a JSON 400."""
    statuses: Counter[int] = Counter()
    prefix = f"numbers-{uuid.uuid4().hex[:12]}"
    outside_untouched.add(prefix)
    for name, headers in (("closed", {**OCTETS, "Stream-Closed": "true"}), ("bytes", OCTETS)):
        response = requests.put(fuzz_server.stream_url(f"{prefix}/{name}"), headers=headers)
        assert response.status_code == 201, response.content

    @HYPOTHESIS
    @given(place=st.sampled_from(NUMBER_PLACES), value=NOT_NUMBERS)
    def check(place: str, value: str) -> None:
        method, target, headers = carrying_number(place, value, prefix)
        response = send_raw(fuzz_server, method, target.encode(), headers)
        statuses[response.status] += 1
        problem = json_error_problem(response, method)
        # A length of at most 16 digits is read, and is past the body limit.
        read_length = place == "Content-Length" and re.fullmatch(r"[1-9][0-9]{0,15}", value)
        expected = 413 if read_length else 400
        assert not problem and response.status == expected, (place, value[:40], problem)

    check()
    report(capsys, "hypothesis, numbers", statuses)
