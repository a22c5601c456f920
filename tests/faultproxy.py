"""A small HTTP proxy for S3 traffic that can count requests and inject faults.

It sits on 127.0.0.1 between PicoMQ (AWS_ENDPOINT_URL points at the proxy) and
moto_server, forwards each request as it came (headers, SigV4 signature and all) and
records it. Faults are switched at run time with `FaultProxy.set_faults`:

- delay every request by some milliseconds;
- answer 500 or 503 with an S3 error body to a fraction of requests, either before the
  request reaches moto (nothing happened) or after moto answered (the write happened,
  the client is told it failed — the ambiguous case real networks produce);
- drop the connection (TCP reset, no response) for a fraction of requests, again before
  or after forwarding;
- `go_down()`: close the listening socket (new connections are refused) and reset every
  request on open connections, as if S3 were unreachable; `come_up()` listens again on
  the same port.

Requests are counted by method whatever happens to them; `log()` lists
(method, path, status, query) for each, status 0 for a dropped connection, and when
each began and ended in one sequence of events, so a test can tell which overlapped.
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

UPSTREAM_TIMEOUT_SECONDS = 30.0
HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
ERROR_CODES = {500: "InternalError", 503: "SlowDown"}


@dataclass(frozen=True)
class Faults:
    """What the proxy does to each request; the default forwards everything untouched.

    `methods` limits failures and drops to those HTTP methods (None: every method), and
    `path_contains` to request paths containing that text. `after_forward` makes failures
    and drops happen after moto has handled the request. `limit` stops injecting after
    that many faults (None: no limit), for a fault that must happen exactly once.
    """

    delay_ms: float = 0.0
    fail_fraction: float = 0.0
    fail_status: int = 503
    drop_fraction: float = 0.0
    after_forward: bool = False
    methods: frozenset[str] | None = None
    path_contains: str | None = None
    limit: int | None = None


@dataclass(frozen=True)
class Record:
    method: str
    path: str
    status: int
    query: str = ""
    began: int = 0  # event numbers: two requests overlapped if each began before the
    ended: int = 0  # other ended


@dataclass
class _Shared:
    """State the handler threads share with the test, under one lock."""

    upstream_host: str
    upstream_port: int
    faults: Faults = field(default_factory=Faults)
    down: bool = False
    random: random.Random = field(default_factory=lambda: random.Random(1234))
    records: list[Record] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    events: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_event(self) -> int:
        with self.lock:
            self.events += 1
            return self.events

    def decide(self, method: str, path: str) -> tuple[Faults, bool, bool, bool]:
        """(faults, down, fail this one, drop this one), decided once per request."""
        with self.lock:
            faults, down = self.faults, self.down
            eligible = (
                (faults.methods is None or method in faults.methods)
                and (faults.path_contains is None or faults.path_contains in path)
                and (faults.limit is None or faults.limit > 0)
            )
            fail = eligible and self.random.random() < faults.fail_fraction
            drop = eligible and not fail and self.random.random() < faults.drop_fraction
            if (fail or drop) and faults.limit is not None:
                self.faults = replace(faults, limit=faults.limit - 1)
            return faults, down, fail, drop

    def record(
        self, method: str, target: str, status: int, began: int, injected: str | None = None
    ) -> None:
        parts = urlsplit(target)
        with self.lock:
            self.events += 1
            self.records.append(Record(method, parts.path, status, parts.query, began, self.events))
            if injected:
                self.injected[injected] += 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # quiet: the test reports
        pass

    def do_GET(self) -> None:
        self.relay()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def relay(self) -> None:
        shared = self.server.shared
        body = self.read_body()
        self.began = shared.next_event()
        path = self.path
        faults, down, fail, drop = shared.decide(self.command, urlsplit(path).path)
        if down:
            shared.record(self.command, path, 0, self.began, "down")
            return self.drop_connection()
        if faults.delay_ms:
            time.sleep(faults.delay_ms / 1000)
        if (fail or drop) and not faults.after_forward:
            return self.inject(path, faults, fail)
        try:
            status, reason, headers, response_body = self.forward(body)
        except OSError:
            shared.record(self.command, path, 0, self.began, "upstream-error")
            return self.drop_connection()
        if fail or drop:
            return self.inject(path, faults, fail)
        shared.record(self.command, path, status, self.began)
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response_body)

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        connection = self.upstream()
        headers = {
            name: value
            for name, value in self.headers.items()
            if name.lower() not in HOP_BY_HOP_HEADERS and name.lower() != "content-length"
        }
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        try:
            connection.request(self.command, self.path, body=body or None, headers=headers)
            response = connection.getresponse()
            response_body = response.read()
        except (OSError, http.client.HTTPException) as error:
            self.close_upstream()
            raise OSError(f"upstream failed: {error}") from error
        if response.will_close:
            self.close_upstream()
        kept = [
            (name, value)
            for name, value in response.getheaders()
            if name.lower() not in HOP_BY_HOP_HEADERS
            and not (name.lower() == "content-length" and self.command != "HEAD")
        ]
        if self.command != "HEAD":
            kept.append(("Content-Length", str(len(response_body))))
        return response.status, response.reason, kept, response_body

    def upstream(self) -> http.client.HTTPConnection:
        connection = getattr(self, "_upstream", None)
        if connection is None:
            shared = self.server.shared
            connection = http.client.HTTPConnection(
                shared.upstream_host, shared.upstream_port, timeout=UPSTREAM_TIMEOUT_SECONDS
            )
            self._upstream = connection
        return connection

    def close_upstream(self) -> None:
        connection = getattr(self, "_upstream", None)
        if connection is not None:
            connection.close()
            self._upstream = None

    def inject(self, path: str, faults: Faults, fail: bool) -> None:
        shared = self.server.shared
        if not fail:
            shared.record(self.command, path, 0, self.began, "drop")
            return self.drop_connection()
        status = faults.fail_status
        shared.record(self.command, path, status, self.began, f"fail-{status}")
        code = ERROR_CODES.get(status, "InternalError")
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by faultproxy</Message></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def drop_connection(self) -> None:
        """Reset the client's connection: no response, and no graceful FIN either."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.close_upstream()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    def __init__(self, port: int, shared: _Shared) -> None:
        self.shared = shared
        super().__init__(("127.0.0.1", port), _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up mid-request is normal here


class FaultProxy:
    """A running proxy to `upstream_url` on a free 127.0.0.1 port; stop it with `stop()`."""

    def __init__(self, upstream_url: str, *, seed: int = 1234) -> None:
        upstream = urlsplit(upstream_url)
        assert upstream.hostname and upstream.port, upstream_url
        self._shared = _Shared(upstream.hostname, upstream.port, random=random.Random(seed))
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._listen()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        self._server = _Server(self.port, self._shared)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def _close_listener(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join(timeout=5)
            self._server = self._thread = None

    def stop(self) -> None:
        self._close_listener()
        with self._shared.lock:
            self._shared.down = True  # handler threads still on open connections drop them

    # -- faults ---------------------------------------------------------------------

    def set_faults(self, **changes: object) -> Faults:
        """Change some fields of the current `Faults` (see its fields); returns the new one."""
        with self._shared.lock:
            self._shared.faults = replace(self._shared.faults, **changes)  # type: ignore[arg-type]
            return self._shared.faults

    def heal(self) -> None:
        """Forward everything again, untouched (listening again if the proxy was down)."""
        with self._shared.lock:
            self._shared.faults = Faults()
        self.come_up()

    def go_down(self) -> None:
        """Refuse new connections and reset every request on open ones."""
        with self._shared.lock:
            self._shared.down = True
        self._close_listener()

    def come_up(self) -> None:
        with self._shared.lock:
            self._shared.down = False
        if self._server is None:
            self._listen()

    # -- counting -------------------------------------------------------------------

    def log(self) -> list[Record]:
        with self._shared.lock:
            return list(self._shared.records)

    def count(self) -> int:
        with self._shared.lock:
            return len(self._shared.records)

    def counts(self, since: int = 0) -> Counter[str]:
        """Requests by HTTP method, from record number `since` on."""
        return Counter(record.method for record in self.log()[since:])

    def injected(self) -> Counter[str]:
        """How many faults of each kind were injected ("fail-503", "drop", "down", ...)."""
        with self._shared.lock:
            return Counter(self._shared.injected)
