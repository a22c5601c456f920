"""No client holds a connection, its greenlet or a live slot past a deadline (worker.py).

A request body must arrive whole within PICOMQ_BODY_TIMEOUT of its head, each write of
a response must be taken within PICOMQ_WRITE_TIMEOUT, and the unread body of a refused
request is never waited for: the answer says `Connection: close`, and the connection
closes. The servers here have deadlines of a second. Clients stall over raw sockets;
each wait on the server is bounded by WAIT_SECONDS, which fails the test if the server
holds on (it held on for good before these deadlines).
"""

from __future__ import annotations

import select
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
import requests
from conftest import make_server

if TYPE_CHECKING:
    from conftest import Server, StartServer

DEADLINE_SECONDS = 1
DEADLINES = {
    "PICOMQ_BODY_TIMEOUT": str(DEADLINE_SECONDS),
    "PICOMQ_WRITE_TIMEOUT": str(DEADLINE_SECONDS),
}
WAIT_SECONDS = 15.0  # far past every deadline here: a server still holding on fails
DRIP_SECONDS = 0.2  # between the bytes of a body sent a byte at a time
SMALL_RECEIVE_BUFFER = 4096
LARGE_BYTES = 16 * 1024 * 1024  # more than the kernel buffers between server and client
PIECE_BYTES = 128 * 1024
SECRET = "deadline-secret-" + "k" * 40
TEXT = {"Content-Type": "text/plain"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Deadlines of a second, one live read at a time, catch-up reads of any size."""
    env = {
        **DEADLINES,
        "PICOMQ_MAX_LIVE_CONNECTIONS": "1",
        "PICOMQ_MAX_READ_BYTES": str(2 * LARGE_BYTES),
    }
    started = make_server(tmp_path_factory.mktemp("picomq-deadlines"), env=env)
    started.start()
    yield started
    started.stop()


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


def connect(server: Server, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(WAIT_SECONDS)
    if receive_buffer is not None:  # before connecting, so the window starts small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", urlsplit(server.url).port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; a socket timeout if it never does."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with bytes of ours unread: as good as a close
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def parse_answer(received: bytes) -> Answer:
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return Answer(int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body)


def request_head(method: str, target: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def stream_target(server: Server, name: str) -> str:
    return urlsplit(server.stream_url(name)).path


def created_stream(server: Server) -> str:
    name = f"deadlines-{uuid.uuid4().hex[:12]}"
    response = requests.put(server.stream_url(name), headers=TEXT, timeout=WAIT_SECONDS)
    assert response.status_code == 201, response.content
    return name


def assert_server_answers(server: Server) -> None:
    response = requests.get(f"{server.url}/healthz", timeout=WAIT_SECONDS)
    assert response.status_code == 200, response.content


# -- a body that stalls ---------------------------------------------------------------

FIRST_PART = b"x" * 400


def stalled_requests(server: Server) -> dict[str, bytes]:
    """Each head, and the first part of its body; each body would be 1,000 bytes."""
    stream = stream_target(server, created_stream(server))
    length = {"Content-Length": "1000"}
    subscription = f"{stream_target(server, '__ds')}/subscriptions/sub-{uuid.uuid4().hex[:8]}"
    chunked = {**TEXT, "Transfer-Encoding": "chunked"}
    return {
        "plain append": request_head("POST", stream, {**TEXT, **length}) + FIRST_PART,
        "create": request_head("PUT", stream + "-new", {**TEXT, **length}) + FIRST_PART,
        "chunked append": request_head("POST", stream, chunked) + b"3e8\r\n" + FIRST_PART,
        "subscription": request_head("PUT", subscription, {"Content-Type": "application/json",
                                                           **length}) + b"{" + FIRST_PART,
    }  # fmt: skip


@pytest.mark.parametrize("drip", [False, True], ids=["stalls", "drips"])
@pytest.mark.parametrize("kind", ["plain append", "create", "chunked append", "subscription"])
def test_a_body_that_does_not_arrive_in_time_is_refused_and_its_connection_closed(
    server: Server, kind: str, drip: bool
) -> None:
    """The client sends a head and part of the body, then nothing more, or a byte every
    DRIP_SECONDS (a deadline on each read would never pass); others are served meanwhile."""
    with connect(server) as sock:
        sock.sendall(stalled_requests(server)[kind])
        assert_server_answers(server)
        give_up_at = time.monotonic() + WAIT_SECONDS
        while not select.select([sock], [], [], DRIP_SECONDS)[0]:
            assert time.monotonic() < give_up_at, "the server waits on for the body"
            if drip:
                sock.sendall(b"x")
        answer = parse_answer(read_until_closed(sock))
    assert answer.status == 400, answer
    assert answer.headers["connection"] == "close", answer.headers
    assert answer.headers["content-type"] == "application/json", answer.headers
    assert_server_answers(server)


def test_stalled_bodies_on_every_connection_slot_do_not_stop_the_server(
    start_server: StartServer,
) -> None:
    """More stalled requests than the worker has connections for: they are let go by
    their deadline, so /healthz, queued behind them, is answered."""
    slots, stalled = 100, 200
    server = start_server(env={**DEADLINES, "GUNICORN_CMD_ARGS": f"--worker-connections {slots}"})
    head = request_head("POST", stream_target(server, created_stream(server)), {
        **TEXT, "Content-Length": "1000"
    })  # fmt: skip
    sockets = []
    try:
        for _ in range(stalled):
            sock = connect(server)
            sockets.append(sock)
            sock.sendall(head + FIRST_PART)
        assert_server_answers(server)
    finally:
        for sock in sockets:
            sock.close()


# -- the unread body of a refused request ---------------------------------------------


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = make_server(tmp_path_factory.mktemp("picomq-deadlines-auth"),
                          env={"PICOMQ_JWT_SECRET": SECRET})  # fmt: skip
    started.start()
    yield started
    started.stop()


REFUSALS = {  # (server fixture, status, extra headers, body bytes sent of 1,000,000)
    "too large": ("server", 413, {}, b"x" * 10),
    "no token": ("auth_server", 401, {}, b"x" * 10),
    "no token, expecting 100-continue": ("auth_server", 401, {"Expect": "100-continue"}, b""),
}


@pytest.mark.parametrize(("fixture", "status", "headers", "sent"), REFUSALS.values(),
                         ids=REFUSALS.keys())  # fmt: skip
def test_a_refused_request_s_unread_body_closes_its_connection(
    request: pytest.FixtureRequest, fixture: str, status: int, headers: dict, sent: bytes
) -> None:
    """The server answers without the body, then closes rather than wait for a body that
    may never come (or, after a 401, take a megabyte from someone without a token)."""
    server = request.getfixturevalue(fixture)
    if fixture == "auth_server":  # its PUT needs a token: this stream need not exist
        target = stream_target(server, f"deadlines-{uuid.uuid4().hex[:12]}")
    else:
        target = stream_target(server, created_stream(server))
    length = 1_000_000 if status == 401 else 100_000_000
    head = request_head("POST", target, {**TEXT, "Content-Length": str(length), **headers})
    with connect(server) as sock:
        sock.sendall(head + sent)
        answer = parse_answer(read_until_closed(sock))
    assert answer.status == status, answer
    assert answer.headers["connection"] == "close", answer.headers
    assert_server_answers(server)


# -- a reader that stops reading ------------------------------------------------------


def append_large(server: Server, name: str) -> None:
    piece = b"y" * PIECE_BYTES
    for _ in range(LARGE_BYTES // PIECE_BYTES):
        response = requests.post(server.stream_url(name), data=piece, headers=TEXT, timeout=30)
        assert response.status_code == 204, response.content


def test_an_sse_reader_that_stops_reading_is_let_go_and_its_live_slot_freed(
    server: Server,
) -> None:
    """The server's one live slot is the stalled reader's until its write deadline
    passes; then a long-poll gets it. Before, the slot stayed taken for good (the
    response's own deadline is only looked at between writes)."""
    name = created_stream(server)
    with connect(server, SMALL_RECEIVE_BUFFER) as sock:
        sock.sendall(request_head("GET", f"{stream_target(server, name)}?offset=-1&live=sse", {}))
        append_large(server, name)
        give_up_at = time.monotonic() + WAIT_SECONDS
        while True:
            params = {"offset": "now", "live": "long-poll"}
            waited = requests.get(server.stream_url(name), params=params, timeout=WAIT_SECONDS)
            if waited.status_code != 503:
                break
            assert time.monotonic() < give_up_at, "the stalled reader keeps the live slot"
            time.sleep(0.2)
        assert waited.status_code == 204, waited.content
        received = read_until_closed(sock)
    assert not received.endswith(b"0\r\n\r\n"), "the stalled response was sent whole"


def test_a_catch_up_reader_that_stops_reading_is_let_go(server: Server) -> None:
    """One catch-up response larger than the kernel buffers: its client reads nothing
    for three write deadlines, then everything it can: the server has cut it short."""
    name = created_stream(server)
    append_large(server, name)
    target = f"{stream_target(server, name)}?offset=-1"
    with connect(server, SMALL_RECEIVE_BUFFER) as sock:
        sock.sendall(request_head("GET", target, {}))
        time.sleep(3 * DEADLINE_SECONDS)
        answer = parse_answer(read_until_closed(sock))
    assert answer.status == 200
    assert len(answer.body) < LARGE_BYTES, "the stalled response was sent whole"
    assert_server_answers(server)
