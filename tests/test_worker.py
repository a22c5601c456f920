"""The gunicorn worker (worker.py).

Every byte of a write arrives, in order, once: the eager send takes what the kernel
accepts at once and leaves the rest to gevent's sendall; these tests make the kernel
take only part of a write, so both halves run.

Before the app sees a request, the worker refuses heads a proxy could read apart, in
JSON, and lets go of connections that send nothing. Those requests go over raw sockets:
HTTP clients would not send these heads.
"""

from __future__ import annotations

import email.utils
import http.client
import socket
import time
import uuid
from datetime import UTC, datetime
from urllib.parse import urlsplit

import gevent
import pytest
import requests
from conftest import Server, StartServer
from gevent import socket as gevent_socket
from test_limits import (
    SOCKET_TIMEOUT_SECONDS,
    RawResponse,
    assert_server_answers,
    json_error_problem,
)

from worker import EagerSendSocket

SMALL_SEND_BUFFER = 4096
KEEPALIVE_SECONDS = 5  # gunicorn.conf.py's keepalive: the worker's limit on reading a head
GRACE_SECONDS = 20


def connected_pair() -> tuple[gevent_socket.socket, gevent_socket.socket]:
    """A loopback TCP connection: (the side that will send eagerly, the reading side)."""
    listener = gevent_socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    reader = gevent_socket.create_connection(listener.getsockname())
    sender, _ = listener.accept()
    listener.close()
    sender.__class__ = EagerSendSocket
    return sender, reader


def read_exactly(reader: gevent_socket.socket, size: int) -> bytes:
    chunks, received = [], 0
    while received < size:
        chunk = reader.recv(min(65536, size - received))
        assert chunk, "connection closed early"
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def test_a_write_larger_than_the_send_buffer_arrives_whole_and_in_order() -> None:
    sender, reader = connected_pair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_SEND_BUFFER)
    data = bytes(range(256)) * (8 * 1024 * 1024 // 256)  # 8 MiB: many buffers' worth
    receiving = gevent.spawn(read_exactly, reader, len(data))
    with gevent.Timeout(30):
        sender.sendall(data)
        assert receiving.get() == data
    sender.close()
    reader.close()


def test_small_writes_arrive_in_order_without_waiting() -> None:
    sender, reader = connected_pair()
    events = [f"event: data\ndata:[{n}]\n\n".encode() for n in range(1000)]
    with gevent.Timeout(30):
        for event in events:
            sender.sendall(event)  # no reader yet: each must fit the kernel's buffer
        assert read_exactly(reader, sum(map(len, events))) == b"".join(events)
    sender.close()
    reader.close()


def test_a_write_to_a_closed_peer_raises() -> None:
    sender, reader = connected_pair()
    reader.close()
    with gevent.Timeout(30):
        try:
            for _ in range(1000):
                sender.sendall(b"x" * 65536)
        except OSError:
            return
        finally:
            sender.close()
    raise AssertionError("64 MiB sent to a closed peer without an error")


def test_the_server_runs_this_worker(server: Server) -> None:
    assert requests.get(f"{server.url}/healthz", timeout=10).status_code == 200
    assert "Using worker: worker.PicoMQWorker" in server.managed.output()


def connect(server: Server) -> socket.socket:
    port = urlsplit(server.url).port
    return socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_SECONDS)


def send_head(server: Server, head: bytes, body: bytes = b"") -> RawResponse:
    """`head` (request line and header lines, CRLF-ended) as given, then `body`."""
    with connect(server) as sock:
        sock.sendall(head + b"\r\n" + body)
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        try:
            return RawResponse(response.status, response.headers, response.read())
        finally:
            response.close()


def created_stream(server: Server) -> tuple[str, bytes]:
    url = server.stream_url(f"worker-{uuid.uuid4().hex[:12]}")
    response = requests.put(url, headers={"Content-Type": "text/plain"}, timeout=10)
    assert response.status_code == 201, response.content
    return url, urlsplit(url).path.encode()


AMBIGUOUS_HEADS = {
    "length and chunked": [b"Content-Length: 5", b"Transfer-Encoding: chunked"],
    "two lengths": [b"Content-Length: 5", b"Content-Length: 5"],
    "signed length": [b"Content-Length: +5"],
    "length with underscore": [b"Content-Length: 0_5"],
    "length with a leading zero": [b"Content-Length: 05"],
    "length past 16 digits": [b"Content-Length: 00000000000000005"],
    "coding other than chunked": [b"Transfer-Encoding: gzip, chunked"],
    "two codings": [b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"],
    "space before colon": [b"Content-Length : 5"],
    "folded line": [b"Content-Length: 5", b"X-Note: one", b" two"],
    "line without colon": [b"Content-Length: 5", b"no colon here"],
}


@pytest.mark.parametrize("lines", AMBIGUOUS_HEADS.values(), ids=AMBIGUOUS_HEADS.keys())
def test_a_head_a_proxy_could_read_apart_is_refused_in_json_and_stores_nothing(
    server: Server, lines: list[bytes]
) -> None:
    url, path = created_stream(server)
    head = b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
    response = send_head(server, head + b"".join(line + b"\r\n" for line in lines), b"hello")
    assert response.status == 400, (response.status, response.body)
    assert not json_error_problem(response), json_error_problem(response)
    assert response.headers["Connection"] == "close"
    assert requests.get(url, params={"offset": "-1"}, timeout=10).content == b""
    assert_server_answers(server)


def test_a_head_request_with_a_body_is_refused(server: Server) -> None:
    _, path = created_stream(server)
    head = b"HEAD " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
    with connect(server) as sock:
        sock.sendall(head + b"\r\nhello")
        response = http.client.HTTPResponse(sock, method="GET")  # GET: read the body
        response.begin()
        body = response.read()
    assert response.status == 400, (response.status, body)
    assert b"Unexpected Content-Length" in body, body
    assert_server_answers(server)


def test_a_plain_chunked_body_is_still_appended(server: Server) -> None:
    url, path = created_stream(server)
    head = (
        b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
    )
    response = send_head(server, head, b"5\r\nhello\r\n0\r\n\r\n")
    assert response.status == 204, (response.status, response.body)
    assert requests.get(url, params={"offset": "-1"}, timeout=10).content == b"hello"


def test_a_target_that_is_not_a_path_is_refused(server: Server) -> None:
    response = send_head(server, b"GET http://127.0.0.1/v1/stream/x HTTP/1.1\r\nHost: a\r\n")
    assert response.status == 400, (response.status, response.body)
    assert not json_error_problem(response), json_error_problem(response)


def closed_after(sock: socket.socket, first: bytes) -> float:
    """Seconds from sending `first` until the server closes the connection unanswered."""
    sock.settimeout(KEEPALIVE_SECONDS + GRACE_SECONDS)
    sent_at = time.monotonic()
    sock.sendall(first)
    assert sock.recv(1024) == b"", "the server answered a head it never got whole"
    return time.monotonic() - sent_at


@pytest.mark.parametrize(
    "first", [b"", b"GET /v1/stream/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"], ids=["idle", "half a head"]
)
def test_a_connection_that_sends_no_whole_head_is_let_go(server: Server, first: bytes) -> None:
    """A slow or idle client does not hold a connection slot past the keepalive."""
    with connect(server) as sock:
        assert closed_after(sock, first) >= KEEPALIVE_SECONDS - 1
    assert_server_answers(server)


def test_a_kept_alive_connection_serves_requests_until_it_idles(server: Server) -> None:
    """Requests a second apart for longer than the keepalive: the deadline is each head's,
    not the connection's."""
    url, path = created_stream(server)
    request = b"GET " + path + b"?offset=-1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with connect(server) as sock:
        for number in range(KEEPALIVE_SECONDS + 3):
            if number:
                time.sleep(1)
            sock.sendall(request)
            response = http.client.HTTPResponse(sock, method="GET")
            response.begin()
            assert response.status == 200, response.read()
            response.read()
        # Measured from the last answer: the deadline's second of margin is all its own.
        assert closed_after(sock, b"") >= KEEPALIVE_SECONDS - 1


def test_a_trusted_proxy_says_the_scheme_for_location(server: Server) -> None:
    """gunicorn.conf.py trusts loopback (gunicorn's forwarded_allow_ips): a TLS proxy there
    says https, and the Location of a new stream says it too."""
    url = server.stream_url(f"worker-{uuid.uuid4().hex[:12]}")
    forwarded = {"Content-Type": "text/plain", "X-Forwarded-Proto": "https"}
    response = requests.put(url, headers=forwarded, timeout=10)
    assert response.status_code == 201, response.content
    assert response.headers["Location"] == "https" + url.removeprefix("http"), response.headers
    plain = requests.put(url + "-plain", headers={"Content-Type": "text/plain"}, timeout=10)
    assert plain.headers["Location"] == url + "-plain"


def test_contradicting_scheme_headers_are_refused(server: Server) -> None:
    url = server.stream_url(f"worker-{uuid.uuid4().hex[:12]}")
    headers = {"Content-Type": "text/plain", "X-Forwarded-Proto": "https", "X-Forwarded-Ssl": "no"}
    response = requests.put(url, headers=headers, timeout=10)
    assert response.status_code == 400, response.content
    assert b"contradict" in response.content
    assert requests.head(url, timeout=10).status_code == 404


def test_an_untrusted_peer_cannot_say_https(start_server: StartServer) -> None:
    server = start_server(env={"GUNICORN_CMD_ARGS": "--forwarded-allow-ips=192.0.2.1"})
    url = server.stream_url(f"worker-{uuid.uuid4().hex[:12]}")
    forwarded = {"Content-Type": "text/plain", "X-Forwarded-Proto": "https"}
    response = requests.put(url, headers=forwarded, timeout=10)
    assert response.status_code == 201, response.content
    assert response.headers["Location"] == url


@pytest.mark.parametrize(
    ("target", "lines"),
    [
        (b"", [b"Host: 127.0.0.1"]),  # with send_head's own Host: two
        (b"", [b"Content-Type: text/plain"]),  # with send_head's own: two
        ("/caf\u00e9".encode(), []),  # raw UTF-8 in the target, not percent-encoded
    ],
    ids=["two hosts", "two content types", "raw non-ascii target"],
)
def test_heads_gunicorn_refused_are_still_refused(
    server: Server, target: bytes, lines: list[bytes]
) -> None:
    _, path = created_stream(server)
    head = (
        b"POST " + path + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: text/plain\r\nContent-Length: 5\r\n"
    )
    response = send_head(server, head + b"".join(line + b"\r\n" for line in lines), b"hello")
    assert response.status == 400, (response.status, response.body)
    assert not json_error_problem(response), json_error_problem(response)


def test_an_answer_to_a_request_asking_to_close_says_it_closes(server: Server) -> None:
    """A pooling client then opens a new connection for its next request, rather than
    sending it on one the server has closed (which fails with no answer)."""
    url, _ = created_stream(server)
    with requests.Session() as session:
        for _ in range(20):
            answer = session.post(
                url,
                data=b"x",
                headers={"Content-Type": "text/plain", "Connection": "close"},
                timeout=10,
            )
            assert answer.status_code == 204
            assert answer.headers["Connection"] == "close"
            read = session.get(f"{url}?offset=-1", headers={"Connection": "close"}, timeout=10)
            assert (read.status_code, read.headers["Connection"]) == (200, "close")
    kept_alive = requests.get(f"{url}?offset=-1", timeout=10)
    assert "Connection" not in kept_alive.headers


def test_every_answer_carries_the_current_date_once(server: Server) -> None:
    url, _ = created_stream(server)
    dates = []
    for _ in range(2):
        answers = [
            requests.post(url, data=b"x", headers={"Content-Type": "text/plain"}, timeout=10),
            requests.get(f"{url}?offset=-1", timeout=10),
            requests.get(f"{server.url}/v1/stream/worker-no-such-stream", timeout=10),
        ]
        for answer in answers:
            assert answer.raw.headers.getlist("Date") == [answer.headers["Date"]]
            sent = email.utils.parsedate_to_datetime(answer.headers["Date"])
            assert abs((datetime.now(UTC) - sent).total_seconds()) < 5
        dates.append(answers[0].headers["Date"])
        time.sleep(1.1)  # the worker formats the date once a second: it must move on
    assert dates[0] != dates[1]


def test_gunicorn_s_access_log_is_written_when_asked_for(start_server: StartServer) -> None:
    """The handler keeps both heads for this line alone, which reads them."""
    line_format = "'%(r)s %(s)s id=%({x-request-id}i)s'"
    server = start_server(
        env={"GUNICORN_CMD_ARGS": f"--access-logfile=- --access-logformat {line_format}"}
    )
    url, path = created_stream(server)
    request_id = f"worker-log-{uuid.uuid4().hex}"
    requests.post(
        url,
        data=b"x",
        headers={"Content-Type": "text/plain", "X-Request-Id": request_id},
        timeout=10,
    )
    deadline = time.monotonic() + 10
    while f"POST {path.decode()} HTTP/1.1 204 id={request_id}" not in server.managed.output():
        assert time.monotonic() < deadline, server.managed.output()[-2000:]
        time.sleep(0.05)


def answer_head(
    server: Server, version: str, target: bytes, headers: dict[str, str]
) -> list[bytes]:
    """The head of the answer to one POST of b"x", as sent: status line, then field lines."""
    lines = [b"POST " + target + b" " + version.encode(), b"Host: 127.0.0.1"]
    fields = {"Content-Type": "text/plain", "Content-Length": "1", **headers}
    lines += [f"{name}: {value}".encode() for name, value in fields.items()]
    with socket.create_connection(server_address(server), timeout=SOCKET_TIMEOUT_SECONDS) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\nx")
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            assert chunk, f"connection closed before a whole head: {received!r}"
            received += chunk
    return received.split(b"\r\n\r\n", 1)[0].split(b"\r\n")


def server_address(server: Server) -> tuple[str, int]:
    return "127.0.0.1", urlsplit(server.url).port or 80


@pytest.mark.parametrize(
    ("version", "connection"),
    [("HTTP/1.1", None), ("HTTP/1.1", "close"), ("HTTP/1.0", None), ("HTTP/1.0", "keep-alive")],
)
@pytest.mark.parametrize("producer", [False, True])
def test_a_fast_append_is_answered_with_the_bytes_flask_s_answer_has(
    server: Server, version: str, connection: str | None, producer: bool
) -> None:
    """The fast path sends its answer whole (send_whole_answer); through Flask (a query
    string sends an append there) pywsgi makes the head: the same lines, in the same order."""
    _, path = created_stream(server)
    heads = []
    for seq, target in enumerate((path, path + b"?through=flask")):
        headers = {"X-Request-Id": "same-id"}
        if connection is not None:
            headers["Connection"] = connection
        if producer:
            headers.update({"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": str(seq)})
        heads.append(answer_head(server, version, target, headers))
    fast, flask = (
        [line for line in head if not line.startswith((b"Date: ", b"Stream-Next-Offset: "))]
        for head in heads
    )
    assert fast == [
        line if not line.startswith(b"Producer-Seq: ") else b"Producer-Seq: 0" for line in flask
    ]
    assert fast[0] == (b"HTTP/1.1 200 OK" if producer else b"HTTP/1.1 204 NO CONTENT")
    expected_connection = {None: None, "close": b"close", "keep-alive": b"keep-alive"}[connection]
    if version == "HTTP/1.0" and connection is None:
        expected_connection = b"close"
    said = [line.split(b": ", 1)[1] for line in fast if line.startswith(b"Connection: ")]
    assert said == ([] if expected_connection is None else [expected_connection])
    assert [line for line in heads[0] if line.startswith(b"Date: ")] != []
