"""SSE fan-out (live.py) against a real server: what every subscriber at the tail gets
when the stream's broadcaster writes to its connection instead of its own greenlet.

Subscribers read with http.client, which checks the chunked framing the broadcaster
writes, or over HTTP/1.0, where the body is the bare bytes up to the connection's end.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
import requests
from test_http import TEXT, append, close, create, parse_sse
from werkzeug.test import Client

from picomq import create_app
from settings import Settings

if TYPE_CHECKING:
    from pathlib import Path

    from conftest import Server

READ_SECONDS = 30.0
SMALL_RECEIVE_BUFFER = 4096
STALLING_BYTES = 16 * 1024 * 1024  # the kernel buffers up to 4 MiB per socket each way here
LONG_POLL_TIMEOUT_SECONDS = 0.5  # conftest's default


def sse_target(server: Server, path: str) -> str:
    return f"{urlsplit(server.stream_url(path)).path}?offset=-1&live=sse"


class Subscriber(threading.Thread):
    """An SSE request made at once, its body read to the end in this thread.

    `hang_up`: read the first bytes, then close the connection. `receive_buffer`: a
    small socket buffer, and nothing read until `go` is set.
    """

    def __init__(
        self,
        server: Server,
        path: str,
        *,
        http10: bool = False,
        hang_up: bool = False,
        receive_buffer: int | None = None,
    ) -> None:
        super().__init__(daemon=True)
        address = urlsplit(server.url)
        self.sock = socket.socket()
        self.sock.settimeout(READ_SECONDS)
        if receive_buffer is not None:  # before connecting, so the window starts small
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.connect((address.hostname, address.port))
        version = "HTTP/1.0" if http10 else "HTTP/1.1"
        self.sock.sendall(f"GET {sse_target(server, path)} {version}\r\nHost: x\r\n\r\n".encode())
        self.http10, self.hang_up = http10, hang_up
        self.go = threading.Event()
        if receive_buffer is None:
            self.go.set()
        self.body = ""
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.go.wait(READ_SECONDS)
            self.body = self.read_http10() if self.http10 else self.read_chunked()
        except BaseException as error:  # noqa: BLE001 - raised in the test's thread by result()
            self.error = error
        finally:
            self.sock.close()

    def read_chunked(self) -> str:
        """Through http.client, which checks the chunked framing."""
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        assert response.status == 200
        assert response.getheader("Transfer-Encoding") == "chunked"
        return response.read(1).decode() if self.hang_up else response.read().decode()

    def read_http10(self) -> str:
        received = b"".join(iter(lambda: self.sock.recv(65536), b""))
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding" not in head.lower()
        return body.decode()

    def result(self) -> str:
        self.go.set()
        self.join(READ_SECONDS + 5)
        assert not self.is_alive(), "a subscriber's response did not end"
        if self.error is not None:
            raise self.error
        return self.body


def data_and_controls(body: str) -> tuple[str, list[dict]]:
    events = parse_sse(body)
    data = "".join(text for kind, text in events if kind == "data")
    return data, [json.loads(text) for kind, text in events if kind == "control"]


def assert_whole_stream_once(body: str, expected: str) -> None:
    data, controls = data_and_controls(body)
    assert data == expected
    assert [control.get("streamClosed") for control in controls].count(True) == 1
    assert controls[-1].get("streamClosed") is True
    offsets = [int(control["streamNextOffset"]) for control in controls]
    assert offsets == sorted(offsets), "a control event went back in the stream"


def test_every_subscriber_gets_every_event_once_and_one_closing_event(server: Server) -> None:
    """Subscribers join while appends go on, some at the tail and some behind; some hang
    up; in the end each of the others holds the whole stream exactly once, in order."""
    path = f"fanout/{uuid.uuid4().hex}"
    url = server.stream_url(path)
    create(url, TEXT)
    messages = [f"message {index} " + "x" * (index * 37 % 500) for index in range(60)]
    subscribers, hanging_up = [], []
    for index, message in enumerate(messages):
        subscribers.append(Subscriber(server, path, http10=index % 3 == 0))
        if index % 10 == 5:
            hanging_up.append(Subscriber(server, path, hang_up=True))
        append(url, message.encode() + b"\n", TEXT)
        time.sleep(0.01)
    close(url)
    for subscriber in hanging_up:
        subscriber.result()
    expected = "".join(message + "\n" for message in messages)
    for subscriber in subscribers:
        assert_whole_stream_once(subscriber.result(), expected)


def test_a_subscriber_that_stops_reading_holds_up_nobody_and_misses_nothing(
    server: Server,
) -> None:
    """More than the kernel buffers between server and client: the broadcaster cannot
    hand the whole of some event to the stalled subscriber's socket. It goes on with the
    others; the stalled subscriber's own greenlet sends the rest once it reads again."""
    path = f"fanout/{uuid.uuid4().hex}"
    url = server.stream_url(path)
    create(url, TEXT)
    stalled = Subscriber(server, path, receive_buffer=SMALL_RECEIVE_BUFFER)
    reading = Subscriber(server, path)
    time.sleep(0.2)  # both at the tail, parked with the broadcaster
    piece = 128 * 1024
    messages = [f"{index:04}".encode() * (piece // 4) for index in range(STALLING_BYTES // piece)]
    for message in messages:
        append(url, message, TEXT)
    close(url)
    expected = b"".join(messages).decode()
    assert_whole_stream_once(reading.result(), expected)  # while the other still reads nothing
    assert stalled.is_alive(), "the stalled subscriber's response ended before it read"
    assert_whole_stream_once(stalled.result(), expected)


def test_an_idle_subscriber_gets_a_control_event_each_timeout_then_the_next_data(
    server: Server,
) -> None:
    """Parked at the tail, a subscriber comes back to its own greenlet each long-poll
    timeout (0.5 s on the test server) for a control event, and parks again."""
    path = f"fanout/{uuid.uuid4().hex}"
    url = server.stream_url(path)
    create(url, TEXT)
    subscriber = Subscriber(server, path)
    time.sleep(4 * LONG_POLL_TIMEOUT_SECONDS)
    append(url, b"after the quiet\n", TEXT)
    close(url)
    body = subscriber.result()
    assert_whole_stream_once(body, "after the quiet\n")
    _, controls = data_and_controls(body)
    start = controls[0]["streamNextOffset"]
    assert [control["streamNextOffset"] for control in controls].count(start) >= 4, controls


@pytest.mark.parametrize("created_again", [False, True], ids=["deleted", "created again"])
def test_deleting_the_stream_ends_every_parked_subscriber(
    server: Server, created_again: bool
) -> None:
    """Created again, longer, at the same path, the stream is a new one: the old one's
    subscribers end with its data, never the new one's bytes from the old offset on
    (which they were once sent, after a long-poll timeout)."""
    path = f"fanout/{uuid.uuid4().hex}"
    url = server.stream_url(path)
    create(url, TEXT)
    append(url, b"before\n", TEXT)
    subscribers = [Subscriber(server, path, http10=index % 2 == 0) for index in range(6)]
    time.sleep(0.2)  # at the tail, parked with the broadcaster
    requests.delete(url).raise_for_status()
    if created_again:
        create(url, TEXT)
        append(url, b"the stream created after the delete\n", TEXT)
        time.sleep(4 * LONG_POLL_TIMEOUT_SECONDS)  # each subscriber's wait ends at least once
        close(url)  # so that a subscriber gone on into the new stream would end too
    for subscriber in subscribers:
        data, controls = data_and_controls(subscriber.result())
        assert data == "before\n"
        assert not any(control.get("streamClosed") for control in controls)
        assert {control["streamNextOffset"] for control in controls} == {
            controls[0]["streamNextOffset"]
        }


def test_an_sse_response_starts_with_the_read_that_checked_its_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The view reads from the offset to refuse a bad one before the 200; that read is
    the first event, not read again (in process: Flask's views, no fan-out)."""
    environment = {"PICOMQ_STORAGE_URL": str(tmp_path / "data"), "PICOMQ_LOG_FORMAT": "text"}
    app = create_app(Settings.from_environment(environment))
    client = Client(app)
    headers = TEXT | {"Stream-Closed": "true"}
    assert client.put("/v1/stream/s", data=b"hello\n", headers=headers).status_code == 201
    store = app.extensions["picomq.store"]
    reads = []
    read = store.read

    def counted_read(*args: object, **kwargs: object) -> object:
        reads.append(args)
        return read(*args, **kwargs)

    monkeypatch.setattr(store, "read", counted_read)
    response = client.get("/v1/stream/s?offset=-1&live=sse")
    events = parse_sse(response.get_data(as_text=True))
    assert [kind for kind, _ in events] == ["data", "control"]
    assert events[0][1] == "hello\n"
    assert len(reads) == 1
