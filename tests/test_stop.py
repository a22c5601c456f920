"""A stop (SIGTERM, as `systemctl restart` sends) ends every connection at once, each
cleanly (worker.py), and the server exits.

Live reads answer with what they have: an SSE response sends its last control event and
ends its body, a long-poll answers its 204; an append in flight is received whole,
stored and answered; an idle kept-alive connection is closed. A reload (SIGHUP, as
`systemctl reload`) stops the old workers the same way while gunicorn keeps the
listening socket: no connection is refused. Each wait here is bounded by WAIT_SECONDS:
before, a live read held a stop up to its own deadline (a minute for SSE), and an idle
connection up to gunicorn's keepalive (a minute on this server). How long a restart
takes is bench/restart.py's to measure.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import requests

if TYPE_CHECKING:
    from conftest import Server, StartServer

WAIT_SECONDS = 20.0  # far less than the minute the live reads and the idle connection wait
LIVE_SECONDS = 60  # the server's long-poll timeout, SSE duration and keepalive
SETTLE_SECONDS = 0.5  # the server has read every request's head and waits
RELOAD_SECONDS = 3.0  # long enough for a new worker to start and answer
TEXT = {"Content-Type": "text/plain"}


def connect(server: Server) -> socket.socket:
    port = urlsplit(server.url).port
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_SECONDS)


def send_get(
    sockets: ExitStack, server: Server, target: str
) -> tuple[socket.socket, http.client.HTTPResponse]:
    """A GET on a connection of its own, its answer's head not read yet."""
    sock = sockets.enter_context(connect(server))
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return sock, http.client.HTTPResponse(sock, method="GET")


def create(server: Server, body: bytes = b"") -> tuple[str, str]:
    """A new text stream: its URL and its path as a request target."""
    url = server.stream_url(f"stop-{uuid.uuid4().hex[:12]}")
    response = requests.put(url, data=body, headers=TEXT, timeout=WAIT_SECONDS)
    assert response.status_code == 201, response.content
    return url, urlsplit(url).path


def read_event(response: http.client.HTTPResponse) -> list[bytes]:
    lines = []
    while (line := response.readline()) not in (b"\n", b""):
        lines.append(line.rstrip(b"\n"))
    return lines


def test_a_stop_ends_live_reads_cleanly_answers_appends_in_flight_and_exits(
    start_server: StartServer,
) -> None:
    server = start_server(
        long_poll_timeout=LIVE_SECONDS,
        env={"GUNICORN_CMD_ARGS": f"--keep-alive {LIVE_SECONDS}"},
    )
    _, followed = create(server, b"before the stop")
    _, polled = create(server)
    appended_url, appended = create(server)

    with ExitStack() as sockets:
        stop_with_connections_open(server, sockets, followed, polled, appended)
    assert server.managed.process is not None
    assert server.managed.process.wait(timeout=WAIT_SECONDS) == 0
    server.stop()  # already gone: forgets the process
    server.start()
    stored = requests.get(appended_url, params={"offset": "-1"}, timeout=WAIT_SECONDS)
    assert stored.content == b"helloworld"


def stop_with_connections_open(
    server: Server, sockets: ExitStack, followed: str, polled: str, appended: str
) -> None:
    """An SSE response, a long-poll, an idle connection and an append half sent: then
    SIGTERM, the rest of the append, and how each connection ends."""
    _, sse = send_get(sockets, server, f"{followed}?offset=-1&live=sse")
    sse.begin()
    assert sse.status == 200
    assert read_event(sse) == [b"event: data", b"data:before the stop"]
    _, poll = send_get(sockets, server, f"{polled}?offset=now&live=long-poll")
    idle_socket, idle = send_get(sockets, server, "/healthz")
    idle.begin()
    assert idle.status == 200 and idle.getheader("Connection") is None
    idle.read()
    append_socket = sockets.enter_context(connect(server))
    append_socket.sendall(
        f"POST {appended} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        "Content-Length: 10\r\n\r\nhello".encode()
    )
    time.sleep(SETTLE_SECONDS)

    os.kill(server.pid, signal.SIGTERM)
    append_socket.sendall(b"world")
    answer = http.client.HTTPResponse(append_socket, method="POST")
    answer.begin()
    assert answer.status == 204, answer.read()
    assert answer.getheader("Connection") == "close"

    poll.begin()
    assert poll.status == 204, poll.read()
    assert poll.getheader("Stream-Up-To-Date") == "true"
    assert poll.getheader("Stream-Next-Offset")

    rest = sse.read()  # to the end of the body: IncompleteRead if it were cut short
    *_, last_event = rest.decode().strip("\n").split("\n\n")
    kind, data = last_event.split("\n")
    assert kind == "event: control", rest
    assert json.loads(data.removeprefix("data:"))["upToDate"] is True

    assert idle_socket.recv(1024) == b"", "the idle connection was kept open"


def children(parent: int) -> set[int]:
    """The processes whose parent is `parent` (the fourth field of each /proc stat)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:  # it ended meanwhile
            continue
        fields = stat.rpartition(")")[2].split()
        if fields and int(fields[1]) == parent and fields[0] != "Z":
            found.add(int(entry))
    return found


def test_a_stop_that_reaches_a_worker_as_it_boots_ends_it(start_server: StartServer) -> None:
    """gunicorn sets a worker's signal handlers only once it has set itself up. A
    SIGTERM before then went to the master's handler, which the fork had copied, and
    was lost: the worker served on until the master killed it, graceful_timeout (75 s)
    after a stop or reload began."""
    server = start_server(workers=1)
    serving = children(server.pid)
    os.kill(server.pid, signal.SIGTTIN)  # one worker more
    deadline = time.monotonic() + WAIT_SECONDS
    while not (booting := children(server.pid) - serving):
        assert time.monotonic() < deadline, "no worker was added"
        time.sleep(0.005)
    (worker,) = booting
    # Once it has logged its boot: a signal in its first microseconds, before Python's
    # own set-up after the fork, is dropped by Python, as in any forked process.
    while f"Booting worker with pid: {worker}" not in server.output():
        assert time.monotonic() < deadline, "the worker did not log its boot"
        time.sleep(0.005)
    os.kill(worker, signal.SIGTERM)
    while worker in children(server.pid):
        assert time.monotonic() < deadline, "the worker did not stop"
        time.sleep(0.05)


def test_a_reload_ends_live_reads_cleanly_and_refuses_no_connection(
    start_server: StartServer,
) -> None:
    server = start_server(long_poll_timeout=LIVE_SECONDS)
    _, followed = create(server, b"before the reload")
    with ExitStack() as sockets:
        _, sse = send_get(sockets, server, f"{followed}?offset=-1&live=sse")
        sse.begin()
        assert read_event(sse) == [b"event: data", b"data:before the reload"]
        os.kill(server.pid, signal.SIGHUP)
        answered_until = time.monotonic() + RELOAD_SECONDS
        while time.monotonic() < answered_until:  # the old worker stops, a new one starts
            health = requests.get(f"{server.url}/healthz", timeout=WAIT_SECONDS)
            assert health.status_code == 200, health.content
        rest = sse.read()  # to the end of the body: IncompleteRead if it were cut short
    assert rest.endswith(b"\n\n") and b"event: control" in rest.rsplit(b"\n\n", 2)[-2], rest
