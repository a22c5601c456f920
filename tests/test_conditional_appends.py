"""Conditional appends (`If-Match`, pull request #243 of the protocol) against real servers.

A POST naming the stream's tail in `If-Match` appends only if the tail is still there,
else 412 with the tail; its errors rank as the pull request orders them; appends without
the header answer as before. Writers racing on one stream through several workers, and
through two nodes on one bucket, show that the tail is checked where the append is
committed: each success extended the tail it named, each failure saw a newer one, and
the stream holds exactly the successes, in order.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import requests
from test_workers import assert_spread, parse_position, read_to_tail, start_logged_server

from protocol import format_offset

if TYPE_CHECKING:
    from pathlib import Path

    from conftest import S3Storage, Server, StartServer

NEXT_OFFSET = "Stream-Next-Offset"
CLOSED = "Stream-Closed"
TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}
PRODUCER = {"Producer-Id": "writer", "Producer-Epoch": "0", "Producer-Seq": "0"}
REQUEST_TIMEOUT_SECONDS = 30.0
RACE_WRITERS = 6
RACE_ATTEMPTS = 12


def etag(offset: str) -> str:
    return f'"{offset}"'


def create(url: str, headers: dict[str, str] = TEXT, body: bytes = b"") -> str:
    response = requests.put(url, data=body, headers=headers, timeout=REQUEST_TIMEOUT_SECONDS)
    assert response.status_code == 201, response.text
    return response.headers[NEXT_OFFSET]


def post(url: str, body: bytes = b"", **headers: str) -> requests.Response:
    headers = {name.replace("_", "-"): value for name, value in headers.items()}
    return requests.post(
        url,
        data=body,
        headers={**TEXT, "Connection": "close", **headers},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )


def assert_precondition_failed(response: requests.Response, tail: str) -> None:
    """412 with the tail to retry at, as ETag and Stream-Next-Offset, and a JSON error."""
    assert response.status_code == 412, (response.status_code, response.text)
    assert response.headers["ETag"] == etag(tail)
    assert response.headers[NEXT_OFFSET] == tail
    assert response.json()["error"]["code"] == "precondition_failed"


# -- one writer ----------------------------------------------------------------------------


def test_an_append_lands_only_while_the_tail_is_the_one_if_match_names(
    server: Server, unique_stream: str
) -> None:
    url = server.stream_url(unique_stream)
    start = create(url)
    first = post(url, b"a;", If_Match=etag(start))
    assert first.status_code == 204, first.text
    assert first.headers["ETag"] == etag(first.headers[NEXT_OFFSET])
    chained = post(url, b"b;", If_Match=first.headers["ETag"])  # no HEAD in between
    assert chained.status_code == 204, chained.text
    tail = chained.headers[NEXT_OFFSET]
    assert tail == format_offset(4)

    assert_precondition_failed(post(url, b"stale;", If_Match=etag(start)), tail)
    # Nothing but the exact quoted tail matches: no wildcard, weak or unquoted tag, list.
    for value in ("*", tail, f"W/{etag(tail)}", f"{etag(start)}, {etag(tail)}", "junk"):
        assert_precondition_failed(post(url, b"other;", If_Match=value), tail)
    retried = post(url, b"c;", If_Match=etag(tail))  # from the tail the 412 named
    assert retried.status_code == 204, retried.text
    assert requests.get(url, timeout=REQUEST_TIMEOUT_SECONDS).content == b"a;b;c;"


def test_appends_without_if_match_carry_no_etag(server: Server, unique_stream: str) -> None:
    """Only a conditional append answers with an ETag; the others answer as before."""
    url = server.stream_url(unique_stream)
    create(url)
    for headers in ({}, {"Stream-Seq": "1"}, PRODUCER):
        response = post(url, b"x", **headers)
        assert response.ok and "ETag" not in response.headers, (headers, response.headers)


CASES = {
    # name: (stream is closed, request headers, body, expected status)
    "missing stream, with producer headers": (None, PRODUCER, b"x", 404),
    "closed stream, stale tail": (True, {}, b"x", 409),
    "closed stream, producer headers too": (True, PRODUCER, b"x", 409),
    "other content type, stale tail": (False, JSON, b"1", 409),
    "producer headers, tail matching": (False, PRODUCER, b"x", 400),
    "producer headers, stale tail": (False, PRODUCER, b"x", 400),
    "stale tail, Stream-Seq going back": (False, {"Stream-Seq": "1"}, b"x", 412),
    "tail matching, Stream-Seq going back": (False, {"Stream-Seq": "1"}, b"x", 409),
    "close again, stale tail": (True, {CLOSED: "true"}, b"", 412),
    "close again, tail matching": (True, {CLOSED: "true"}, b"", 204),
}


@pytest.mark.parametrize("case", CASES)
def test_errors_rank_as_the_pull_request_orders_them(
    server: Server, unique_stream: str, case: str
) -> None:
    """404, closed 409, content type 409, 400 (with producer headers), 412, producer
    errors, Stream-Seq: the first that applies answers."""
    closed, headers, body, status = CASES[case]
    url = server.stream_url(unique_stream)
    if closed is not None:
        create(url, body=b"ab")
        assert post(url, b"c", Stream_Seq="5").status_code == 204
        if closed:
            assert post(url, Stream_Closed="true").status_code == 204
    tail = format_offset(3)
    named = tail if "matching" in case else format_offset(1)
    response = post(url, body, **{**headers, "If-Match": etag(named)})
    assert response.status_code == status, (response.status_code, response.text)
    if status == 412:
        assert_precondition_failed(response, tail)
        assert response.headers.get(CLOSED) == ("true" if closed else None)
    if status == 204:
        assert response.headers["ETag"] == etag(tail)
    if closed is not None:
        assert requests.get(url, timeout=REQUEST_TIMEOUT_SECONDS).content == b"abc"


# -- writers racing ------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    body: bytes
    named: int  # the tail the append named
    succeeded: bool
    tail: int  # after it: the new tail, or the one its 412 reported


def race(urls: list[str]) -> list[Attempt]:
    """RACE_WRITERS writers, each through one of `urls` in turn, make RACE_ATTEMPTS
    conditional appends each, at once; each names the tail its last answer gave
    (an ETag, or a 412's tail), the first the tail HEAD gives."""

    def write(number: int) -> list[Attempt]:
        url = urls[number % len(urls)]
        head = requests.head(url, headers={"Connection": "close"}, timeout=REQUEST_TIMEOUT_SECONDS)
        named, attempts = head.headers[NEXT_OFFSET], []
        for attempt in range(RACE_ATTEMPTS):
            body = f"{number:02d}:{attempt:03d};".encode()
            response = post(url, body, If_Match=etag(named))
            assert response.status_code in (204, 412), (response.status_code, response.text)
            tail = response.headers[NEXT_OFFSET]
            assert response.headers["ETag"] == etag(tail)
            succeeded = response.status_code == 204
            attempts.append(Attempt(body, parse_position(named), succeeded, parse_position(tail)))
            named = tail
        return attempts

    with ThreadPoolExecutor(RACE_WRITERS) as pool:
        return [
            attempt for attempts in pool.map(write, range(RACE_WRITERS)) for attempt in attempts
        ]


def check_race(attempts: list[Attempt], stored: bytes) -> None:
    successes = sorted(
        (attempt for attempt in attempts if attempt.succeeded), key=lambda a: a.named
    )
    failures = [attempt for attempt in attempts if not attempt.succeeded]
    assert failures and len(successes) > RACE_WRITERS, "the writers did not race"
    position = 0
    for success in successes:  # one after another, none naming a tail another took
        assert success.named == position, f"{success} does not start at {position}"
        position = success.tail
        assert success.tail == success.named + len(success.body), success
    for failure in failures:
        assert failure.tail > failure.named, f"{failure}: its 412 named no newer tail"
    assert stored == b"".join(success.body for success in successes)
    print(f"\n{len(successes)} conditional appends landed, {len(failures)} answered 412")


def test_conditional_writers_racing_through_two_workers(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    server, access_log = start_logged_server(start_server, tmp_path, workers=2)
    url = server.stream_url(unique_stream)
    create(url)
    attempts = race([url])
    assert_spread(access_log, "POST", f"/v1/stream/{unique_stream}")
    check_race(attempts, read_to_tail(url))


def test_conditional_writers_racing_through_two_nodes_on_s3(
    s3_storage: S3Storage, start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    """Two nodes (each a machine of its own: no writer locks shared) with a worker each:
    only the create at the tail decides, and a batch that lost it is checked again."""
    nodes = []
    for number in range(2):
        machine_tmp = tmp_path / f"node{number}"
        machine_tmp.mkdir()
        env = {**s3_storage.env, "TMPDIR": str(machine_tmp)}
        nodes.append(start_server(storage_url=s3_storage.url, env=env, workers=1))
    urls = [node.stream_url(unique_stream) for node in nodes]
    create(urls[0])
    attempts = race(urls)
    check_race(attempts, read_to_tail(urls[1]))
