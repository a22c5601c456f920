"""The gunicorn worker PicoMQ runs: gevent's pywsgi worker, with a one-call send for small
writes, a small read buffer, gunicorn's limits on the request head and JSON refusals.

An accelerator, not the reference: PicoMQ's answers are its Flask app's (picomq.py),
which serves them complete on any WSGI server; this worker serves them faster, and
holds clients to deadlines, and must change no answer. What holds it to that:
tests/test_worker.py (the heads gunicorn's parser refused are still refused, in JSON;
a fast append's answer has the bytes of Flask's), tests/test_fanout.py (subscribers
whose events the fan-out writes through this worker get every event once, framed as
their own response frames them), and every test that starts a server, as all run it.

Why pywsgi rather than gunicorn's own gevent worker: gunicorn's worker parses each
request head in Python through its own buffer class; pywsgi reads its lines from a C
buffered file, and RequestHeaders below splits each header line with one regular
expression (pywsgi's own header parse, through the email package, was the largest
cost left in a single append). On one core it serves markedly more single appends
than gunicorn's worker (figures: bench/README.md, "Figures behind the code").

What gunicorn's parser did that pywsgi does not, this module does: the request line,
header count and header line limits of gunicorn.conf.py (414, 431), a time limit on
reading a request head (`keepalive`), and a refusal (400) of heads that a proxy in front
could read differently: a target that is not a path of printable ASCII, a malformed or
repeated Content-Length, Content-Length beside Transfer-Encoding, a transfer coding
other than chunked, Host or Content-Type given twice, folded header lines, header names
that are not tokens, control characters in values, and (pywsgi's own rule) a HEAD with
a body. Every refusal is JSON, in the shape of PicoMQ's other errors, and closes the
connection. And as gunicorn's workers, it takes the scheme (wsgi.url_scheme, on which
Location is built) from a trusted proxy's X-Forwarded-Proto and the like
(`secure_scheme_headers` from a peer in `forwarded_allow_ips`), and ends keep-alive
once the worker is stopping.

What neither worker does, this one does: it bounds the time a client holds a connection.
A request body must arrive whole within PICOMQ_BODY_TIMEOUT of its head, each write
that waits for a client must be taken within PICOMQ_WRITE_TIMEOUT, and the unread body
of a request answered without it (a 401, a 413) is not waited for: the connection
closes after the answer. Without them, a client that sent a head and then nothing, or
stopped reading its answer, held its connection and greenlet for good, and a few
thousand such took every connection the worker had.

And it stops at once: on SIGTERM it stops accepting, closes idle kept-alive
connections, ends every live read with what it has (wakeups.py), lets the requests in
flight finish, and exits when the last connection has gone, where gunicorn's worker
waited a second to look, then for every long-poll and SSE response to reach its own
deadline: a minute for SSE, during which nobody could connect.

Before every write, gevent's `sendall` asks the kernel for the socket's send-buffer
size (to size its chunks) and reads the clock (for its timeout), then sends. An SSE
fan-out writes one small event to each of thousands of sockets per message, so that
preamble sat on the hottest path PicoMQ has. Here a write is first offered to the
kernel once, without blocking; only what the kernel does not take at once goes through
gevent's `sendall`, which waits for the socket to drain. The handler also offers its
connection to the app, in the environ (wire.DIRECT_WRITER_ENVIRON_KEY): as live.py's
DirectWriter, through which the SSE fan-out writes events to parked subscribers between
the app's own writes, framed as pywsgi frames what the app yields; and as fastpath.py's
AnswerWriter, through which a plain append's answer goes out as one piece.

pywsgi reads each connection through a buffered file of 8 KiB, allocated when the
connection opens, though an SSE subscriber reads nothing after its request:
READ_BUFFER_BYTES holds a typical request head; a larger body is read straight from
the socket. For the same subscribers' sake, the handler lets go of what pywsgi would
keep until the next request: the parsed request head once the environ holds it, and
the encoded answer head once it is sent (unless gunicorn's own access line, which reads
both, is on).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import queue
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gevent
from gevent import socket as gevent_socket
from gevent.pywsgi import Input, format_date_time
from gunicorn.workers.ggevent import GeventPyWSGIWorker, PyWSGIHandler, PyWSGIServer

from decimals import DECIMAL_PATTERN
from settings import Settings
from wakeups import end_waits
from wire import DIRECT_WRITER_ENVIRON_KEY, PEER_ENVIRON_KEY, code_of_reason, error_body

if TYPE_CHECKING:
    from greenlet import greenlet

READ_BUFFER_BYTES = 1024
PEER_BACKLOG = 2048
# What gunicorn's worker stops on: SIGTERM gracefully, SIGINT and SIGQUIT at once.
EARLY_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
# A header line (RFC 9110 5.1, 5.5): a token, a colon, a value without control
# characters (a lone CR among them: some proxies end a line there), optional whitespace.
HEADER_LINE = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*?)[ \t]*\r?\n"
)
TARGET_OUTSIDE_ASCII = re.compile(r"[^\x21-\x7e]")  # RFC 9112 3.2, as gunicorn refuses


class WriteTimedOut(TimeoutError):
    """A client did not take a whole write within PICOMQ_WRITE_TIMEOUT: the connection
    is shut, and pywsgi lets it go as it does one the client reset (ETIMEDOUT)."""

    def __init__(self) -> None:
        super().__init__(errno.ETIMEDOUT, "the client did not take a write in time")


class EagerSendSocket(gevent_socket.socket):
    """A gevent socket whose `sendall` tries one plain send first, and waits for the
    rest within a deadline.

    Same slots as its base, so an accepted socket can take this class in place. The
    wrapped OS socket is always non-blocking under gevent, so the first send never
    waits: it takes what fits in the kernel's buffer, or raises BlockingIOError.
    """

    __slots__ = ()
    write_seconds: float | None = None  # PICOMQ_WRITE_TIMEOUT, set by PicoMQWorker

    def sendall(self, data: bytes, flags: int = 0) -> None:
        sent = self.send_now(data, flags)
        if sent < len(data):
            self.send_rest(memoryview(data)[sent:], flags)

    def send_now(self, data: bytes, flags: int = 0) -> int:
        """What the kernel takes at once, without waiting for the socket to drain."""
        try:
            return self._sock.send(data, flags)
        except BlockingIOError:
            return 0

    def send_rest(self, data: memoryview, flags: int) -> None:
        """Wait for the socket to drain, all of `data` within `write_seconds` in total:
        a client that stops reading, or reads a byte at a time, would otherwise hold its
        connection and greenlet for good. Past the deadline the connection is shut both
        ways, so that the response's next write fails at once too (EPIPE).

        A Timeout only for a write that waits: one for every request showed in a plain
        append's profile (see PicoMQHandler's head deadline)."""
        try:
            with gevent.Timeout(self.write_seconds, WriteTimedOut):
                super().sendall(data, flags)
        except WriteTimedOut:
            self.shut(socket.SHUT_RDWR)
            raise

    def stop_reading(self) -> None:
        """A read waiting on this connection returns what came and then end of file, as
        if the client had hung up; so does every later read.

        Through the OS socket, whose shutdown wakes the reader: gevent's own would raise
        in it instead, and lose the bytes its buffered read had taken so far."""
        self.shut(socket.SHUT_RD)

    def shut(self, how: int) -> None:
        try:
            self._sock.shutdown(how)
        except OSError:
            pass  # the client is gone already


@dataclass(frozen=True)
class HeadLimits:
    """gunicorn.conf.py's limits on a request head, and how long reading one may take."""

    request_line_bytes: int
    header_count: int
    header_line_bytes: int
    read_seconds: float


@dataclass(frozen=True)
class Forwarding:
    """Which peers may say, in which headers, that the client came over https."""

    secure_scheme_headers: tuple[tuple[str, str], ...]  # (header in lower case, value: https)
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    trust_all: bool

    @classmethod
    def from_config(cls, cfg: Any) -> Forwarding:
        allowed = cfg.forwarded_allow_ips
        return cls(
            secure_scheme_headers=tuple(
                (name.lower(), value) for name, value in cfg.secure_scheme_headers.items()
            ),
            allowed_networks=tuple(ipaddress.ip_network(ip) for ip in allowed if ip != "*"),
            trust_all="*" in allowed,
        )

    def trusts(self, peer: Any) -> bool:
        """As gunicorn: a peer on a Unix socket, or one whose IP is allowed."""
        if not isinstance(peer, tuple) or self.trust_all:
            return True
        try:
            address = ipaddress.ip_address(peer[0])
        except ValueError:
            return False
        return any(address in network for network in self.allowed_networks)


class RefusedHead(ValueError):
    """A request head PicoMQ does not serve; the connection closes after the answer."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = str(status)
        self.answer = refusal(status, reason, message)


class HeadTimedOut(ValueError):
    """No complete request head within `keepalive` seconds: close without an answer."""


def refusal(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP response refusing a request, with the app's JSON error body."""
    body = error_body(code_of_reason(reason), message)
    head = (
        f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


class RequestHeaders:
    """A request's header fields, with the part of http.client's message pywsgi uses.

    pywsgi parses heads with http.client's parser, built on the email package: the
    largest cost left in a single append. These fields take one regular expression a line.
    """

    status = ""  # pywsgi's parser puts a parse error here; ours raises RefusedHead

    def __init__(self, fields: list[tuple[str, str]]) -> None:
        self.fields = fields
        self.by_name: dict[str, list[str]] = {}
        for name, value in fields:
            self.by_name.setdefault(name.lower(), []).append(value)

    def get_all(self, name: str) -> list[str]:
        return self.by_name.get(name.lower(), [])

    def get(self, name: str, default: str | None = None) -> str | None:
        values = self.by_name.get(name.lower())
        return values[0] if values else default

    getheader = get

    def __delitem__(self, name: str) -> None:
        name = name.lower()
        self.fields = [(field, value) for field, value in self.fields if field.lower() != name]
        self.by_name.pop(name, None)

    def items(self) -> list[tuple[str, str]]:
        return list(self.fields)

    @property
    def typeheader(self) -> str | None:
        return self.get("content-type")


def read_headers(rfile: Any, limits: HeadLimits) -> RequestHeaders:
    """The header fields of a request head, read up to and including its empty line."""
    fields: list[tuple[str, str]] = []
    while True:
        line = rfile.readline(limits.header_line_bytes + 3)
        if line in (b"\r\n", b"\n", b""):
            return RequestHeaders(fields)
        if not line.endswith(b"\n") or len(line.rstrip(b"\r\n")) > limits.header_line_bytes:
            raise RefusedHead(
                431,
                "Request Header Fields Too Large",
                f"a header line is longer than {limits.header_line_bytes} bytes",
            )
        if len(fields) == limits.header_count:
            raise RefusedHead(
                431,
                "Request Header Fields Too Large",
                f"more than {limits.header_count} header fields",
            )
        field = HEADER_LINE.fullmatch(line)
        if field is None:
            raise RefusedHead(400, "Bad Request", "malformed header line")
        fields.append((field[1].decode("latin-1"), field[2].decode("latin-1")))


class ShortReadInput(Input):
    """pywsgi's request body, except that a body the client cuts short reads short, as a
    file does (pywsgi raises instead, and drops the part that came: PicoMQ's 400 says
    how much of the body arrived), and that a body the app leaves unread is not read.

    pywsgi reads the rest of an unread body before the next request, as long as the
    client takes to send it: after a 401 or 413, a client could hold the connection
    with a body it never finishes. Here the answer says `Connection: close` instead
    (PicoMQHandler.ends_after_answer), and the connection closes after it.
    """

    __slots__ = ()

    @property
    def unread(self) -> bool:
        """Part of the body has not been read: the connection cannot carry another request."""
        if self.chunked_input:
            return self.chunk_length != 0 or self._chunked_input_error
        return self.position < (self.content_length or 0)

    def _discard(self) -> None:
        """Nothing: an unread body closes the connection (see the class)."""

    def _do_read(self, length: int | None = None, use_readline: bool = False) -> bytes:
        if use_readline or self.content_length is None:
            return super()._do_read(length, use_readline)
        left = self.content_length - self.position
        length = left if length is None else min(length, left)
        if length <= 0:
            return b""
        self._send_100_continue()
        data = self.rfile.read(length)
        self.position += len(data)
        return data


@functools.lru_cache(maxsize=1)
def http_date(second: int) -> bytes:
    """The Date header of answers in that second. pywsgi formats it for every answer
    (it showed in a single append's profile); this once a second."""
    return format_date_time(second)


class PicoMQHandler(PyWSGIHandler):
    """pywsgi's handler, reading heads within HeadLimits and refusing them in JSON, and
    bodies within PICOMQ_BODY_TIMEOUT."""

    # PicoMQWorker.init_process sets these from gunicorn's settings, and itself: a worker
    # process serves one handler class.
    limits: HeadLimits
    body_seconds: float  # PICOMQ_BODY_TIMEOUT
    forwarding: Forwarding
    worker: GeventPyWSGIWorker
    gunicorn_access_log: bool  # --access-logfile or a log config: gunicorn's line is wanted
    url_scheme: str | None = None
    body_deadline: Any = None  # a timer, made for the connection's first body
    # A connection's end is no error of the server's: pywsgi logs none of these.
    ignored_socket_errors = (*PyWSGIHandler.ignored_socket_errors, errno.ETIMEDOUT)
    # The greenlets of the connections waiting for their next request: a stop ends them.
    waiting_for_request: set[greenlet] = set()

    def __init__(self, sock: gevent_socket.socket, address: Any, server: Any) -> None:
        sock.__class__ = EagerSendSocket
        super().__init__(sock, address, server, sock.makefile("rb", READ_BUFFER_BYTES))
        # One timer a connection, rearmed for each head: a new gevent.Timeout per request
        # showed in the profile, and a restarted Timeout keeps its first deadline (libev), so
        # it would cut a busy kept-alive connection `read_seconds` after it opened.
        seconds = self.limits.read_seconds
        self.head_deadline = server.loop.timer(seconds, seconds)

    def handle_one_request(self) -> tuple[str, bytes] | bool | None:
        """End the connection after its answer when the answer said so: as gunicorn's
        workers do, once the worker is stopping (a kept-alive client would hold the stop
        to graceful_timeout), and when the body was left unread."""
        handled = super().handle_one_request()
        if self.body_deadline is not None:
            self.body_deadline.stop()
        return None if handled is True and self.ends_after_answer else handled

    def start_body_deadline(self) -> None:
        """The whole body must arrive within `body_seconds` of its head: a client that
        sends a head, then a body slowly or never (a byte every few seconds defeats a
        deadline on each read), would otherwise hold its connection for good. One timer
        a connection, as the head's."""
        if self.body_deadline is None:
            seconds = self.body_seconds
            self.body_deadline = self.server.loop.timer(seconds, seconds)
        self.body_deadline.again(self.end_body)

    def end_body(self) -> None:
        """At the body's deadline, stop reading the connection if any of the body is still
        to come: the app reads what came (and answers 400, a body cut short), and the
        connection closes after the answer."""
        self.body_deadline.stop()
        if self.wsgi_input is not None and self.wsgi_input.unread:
            self.close_connection = True
            self.socket.stop_reading()

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Any:
        """Say `Connection: close` whenever the connection ends after this answer: when
        the request asked for it (RFC 9112 9.6: the answer should say so; pywsgi says it
        only to HTTP/1.0) and once the worker is stopping. A client that pools its
        connections would otherwise send its next request on one the server closed, and
        get no answer."""
        if self.ends_after_answer:
            headers = [*headers, ("Connection", "close")]
        return super().start_response(status, headers, exc_info)

    @property
    def ends_after_answer(self) -> bool:
        """The connection closes after this answer: asked for, the worker is stopping, or
        the body was left unread (ShortReadInput)."""
        return self.close_connection or not self.worker.alive or self.wsgi_input.unread

    def log_request(self) -> None:
        """gunicorn's access line, only when its access log is on (PicoMQ writes its own):
        it builds two datetimes and a response record before asking."""
        if self.gunicorn_access_log:
            super().log_request()

    def _write_with_headers(self, data: bytes) -> None:
        super()._write_with_headers(data)
        if not self.gunicorn_access_log:  # its line reads both heads
            self.response_headers = None

    def finalize_headers(self) -> None:
        if self.provided_date is None:
            self.provided_date = http_date(int(time.time()))
            self.response_headers.append((b"Date", self.provided_date))
        super().finalize_headers()

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        environ[DIRECT_WRITER_ENVIRON_KEY] = self
        if not self.gunicorn_access_log:  # read_request parses the next head anew
            self.headers = None
        self.wsgi_input.__class__ = ShortReadInput
        if self.wsgi_input.unread:  # a body is to come
            self.start_body_deadline()
        if self.url_scheme is not None:
            environ["wsgi.url_scheme"] = self.url_scheme
        return environ

    # -- the connection as a DirectWriter (live.py): the SSE fan-out writes through it

    @property
    def chunked(self) -> bool:
        return self.response_use_chunked

    def send_now(self, data: bytes) -> int:
        sent = self.socket.send_now(data)
        self.response_length += sent
        return sent

    def send_rest(self, data: bytes) -> None:
        self._sendall(data)

    # -- and as fastpath.py's AnswerWriter

    def send_whole_answer(self, status: str, fields: bytes) -> None:
        """A bodiless answer in one write, the bytes start_response and the first write
        would send: status line, `fields` (whole header lines, checked by the caller:
        fastpath.header_lines), Connection when due, Date.

        pywsgi's start_response checks and encodes the headers one by one, and its first
        write joins them again, for offsets, ids matched by a pattern and fixed text.
        Sent whole, plain appends go faster (figures: bench/README.md).
        """
        if self.ends_after_answer:
            connection = b"Connection: close\r\n"
        elif self.request_version == "HTTP/1.0":  # as pywsgi says it to HTTP/1.0 clients
            connection = b"Connection: keep-alive\r\n"
        else:
            connection = b""
        date = http_date(int(time.time()))
        self.status, self._orig_status, self.code = status.encode(), status, int(status[:3])
        head = b"HTTP/1.1 %s\r\n%s%sDate: %s\r\n\r\n" % (self.status, fields, connection, date)
        self.response_headers = []
        self.headers_sent = True
        self._sendall(head)

    def handle(self) -> None:
        try:
            super().handle()
        finally:
            self.head_deadline.close()
            if self.body_deadline is not None:
                self.body_deadline.close()
            if self.environ is not None:  # the handler, in its own environ: a cycle
                self.environ.pop(DIRECT_WRITER_ENVIRON_KEY, None)

    def read_requestline(self) -> str:
        """The request line, cut short one byte past the limit (read_request refuses it);
        empty, which ends the connection, if none comes within `read_seconds`.

        The deadline runs on through read_request: the whole head must come in time.
        Meanwhile the connection is idle: a stop ends it (`end_idle_connections`)."""
        limit = self.limits.request_line_bytes
        current = gevent.getcurrent()
        self.head_deadline.again(current.throw, HeadTimedOut)
        self.waiting_for_request.add(current)
        try:
            return self.rfile.readline(limit + 2)[: limit + 1].decode("latin-1")
        except HeadTimedOut:
            self.head_deadline.stop()  # it repeats; the connection ends
            return ""
        finally:
            self.waiting_for_request.discard(current)

    @classmethod
    def end_idle_connections(cls) -> None:
        """End every connection waiting for its next request, as its head deadline would:
        an idle kept-alive connection (a proxy keeps several) would hold a stop up to
        `keepalive` seconds. Run by the event loop, as a timer's callback is."""
        for waiting in list(cls.waiting_for_request):
            waiting.throw(HeadTimedOut)

    def read_request(self, raw_requestline: str) -> bool:
        try:
            if len(raw_requestline.rstrip("\r\n")) > self.limits.request_line_bytes:
                raise RefusedHead(
                    414,
                    "Request-URI Too Long",
                    f"the request line is longer than {self.limits.request_line_bytes} bytes",
                )
            super().read_request(raw_requestline)
        finally:
            self.head_deadline.stop()
        if not self.path.startswith("/") or TARGET_OUTSIDE_ASCII.search(self.path):
            raise RefusedHead(400, "Bad Request", "the request target must be an ASCII path")
        self.url_scheme = self.forwarded_scheme()
        return True

    def forwarded_scheme(self) -> str | None:
        """The scheme a trusted proxy says the client used, as gunicorn's own workers take
        it: gunicorn's secure_scheme_headers (X-Forwarded-Proto: https, ...), from a peer
        in forwarded_allow_ips. PicoMQ's Location header is built on it."""
        trust = self.forwarding
        given = self.headers.by_name
        said = {
            "https" if value == secure else "http"
            for name, secure in trust.secure_scheme_headers
            if name in given
            for value in given[name]
        }
        if not said or not trust.trusts(self.client_address):
            return None
        if len(said) > 1:
            raise RefusedHead(400, "Bad Request", "the scheme headers contradict each other")
        return said.pop()

    @staticmethod
    def refuse_ambiguous_head(headers: RequestHeaders) -> None:
        """Refuse a head that two HTTP implementations could read apart: its body's
        length, or a field that admits one value only (RFC 9110 5.3) given twice."""
        given = headers.by_name  # by lower-case name
        if len(given.get("host", ())) > 1 or len(given.get("content-type", ())) > 1:
            raise RefusedHead(400, "Bad Request", "Host or Content-Type given twice")
        lengths = given.get("content-length", [])
        codings = given.get("transfer-encoding", [])
        if codings and (lengths or [c.strip().lower() for c in codings] != ["chunked"]):
            raise RefusedHead(
                400, "Bad Request", "Transfer-Encoding must be chunked, without Content-Length"
            )
        # Digits only, as decimals.py reads numbers: at most 16 (pywsgi's int() raises
        # past 4,300) and no leading zero.
        if len(lengths) > 1 or not all(DECIMAL_PATTERN.fullmatch(value) for value in lengths):
            raise RefusedHead(400, "Bad Request", "malformed Content-Length")

    def MessageClass(self, rfile: Any, *args: Any) -> RequestHeaders:  # noqa: N802 (pywsgi's)
        headers = read_headers(rfile, self.limits)
        self.refuse_ambiguous_head(headers)  # before pywsgi drops a length beside chunked
        return headers

    def _headers(self) -> Iterator[tuple[str, str]]:
        """The HTTP_ variables of the environ, as pywsgi makes them from its own parse:
        names with underscores dropped (else X_Id could pose as X-Id)."""
        for name, value in self.headers.fields:
            if "_" not in name:
                key = name.upper().replace("-", "_")
                if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                    yield "HTTP_" + key, value

    def _handle_client_error(self, ex: Exception) -> tuple[str, bytes] | None:
        """gunicorn logs refused heads at debug level, and so do we."""
        if isinstance(ex, HeadTimedOut):
            return None
        self.server.log.debug("refused a request from %s: %s", self.client_address, ex)
        if isinstance(ex, RefusedHead):
            return ex.status, ex.answer
        return "400", refusal(400, "Bad Request", f"malformed request: {str(ex)[:200]}")

    def _send_error_response_if_possible(self, error_code: int) -> None:
        """A JSON answer for an error raised outside the app (its errors are its own)."""
        self.close_connection = True
        if self.response_length:
            return
        reason = "Bad Request" if error_code == 400 else "Internal Server Error"
        self.status = f"{error_code} {reason}".encode("latin-1")  # for the access log
        try:
            self._sendall(refusal(error_code, reason, reason.lower()))
        except OSError:
            pass


class PicoMQServer(PyWSGIServer):
    """pywsgi's server without its reverse DNS lookup of the bound address at start."""

    serving: list[PicoMQServer] = []  # the worker's, one per listening socket
    peer_address: Any = None  # the peer listener's (PicoMQWorker.patch)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.serving.append(self)

    def update_environ(self) -> None:
        address = self.address
        host, port = address[:2] if isinstance(address, tuple) else ("", "")
        self.environ.setdefault("SERVER_NAME", str(host))
        self.environ.setdefault("SERVER_PORT", str(port))
        if address == self.peer_address:
            self.environ[PEER_ENVIRON_KEY] = True


class PicoMQWorker(GeventPyWSGIWorker):
    """gunicorn's gevent pywsgi worker, serving connections through PicoMQHandler."""

    server_class = PicoMQServer
    wsgi_handler = PicoMQHandler
    # Run once every connection has gone, before the process exits (gunicorn.conf.py).
    before_exit: list[Callable[[], None]]
    early_stop: int | None = None  # a stop signal that came before gunicorn's handlers

    def patch(self) -> None:
        """gevent's sockets, and one more: the peer listener, where the other workers and
        nodes forward requests for the streams this worker serves (forwarding.py)."""
        super().patch()
        settings = Settings.from_environment()  # gunicorn.conf.py has checked them
        peer = gevent_socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        peer.bind((settings.peer_host, 0))
        peer.listen(PEER_BACKLOG)
        self.sockets.append(peer)
        PicoMQServer.peer_address = peer.getsockname()
        self.peer_address = f"{settings.peer_host}:{peer.getsockname()[1]}"

    def init_process(self) -> None:
        settings = Settings.from_environment()  # gunicorn.conf.py has checked them
        self.before_exit = []
        PicoMQHandler.worker = self
        PicoMQHandler.forwarding = Forwarding.from_config(self.cfg)
        PicoMQHandler.gunicorn_access_log = self.log.access_log_enabled
        PicoMQHandler.limits = HeadLimits(
            request_line_bytes=self.cfg.limit_request_line,
            header_count=self.cfg.limit_request_fields,
            header_line_bytes=self.cfg.limit_request_field_size,
            read_seconds=self.cfg.keepalive,
        )
        PicoMQHandler.body_seconds = settings.body_timeout
        EagerSendSocket.write_seconds = settings.write_timeout
        super().init_process()

    def note_stops_from_now(self, master_queue: queue.SimpleQueue) -> None:
        """Called in the worker's process just after the fork (gunicorn.conf.py's
        post_fork). Until gunicorn sets the worker's handlers (`init_signals`), a stop
        signal would go to the master's handler, which the fork copied, and only join
        the copy of the master's queue: the worker would boot and serve until the
        master's kill, graceful_timeout after its stop began. From here each is noted,
        those already in that queue too, and acted on once the handlers are set."""
        for stop_signal in EARLY_STOP_SIGNALS:
            signal.signal(stop_signal, self.note_early_stop)
        while True:  # this process's copy: emptying it leaves the master's as it is
            try:
                queued = master_queue.get_nowait()
            except queue.Empty:
                return
            if queued in EARLY_STOP_SIGNALS:
                self.note_early_stop(queued, None)

    def note_early_stop(self, sig: int, frame: Any) -> None:
        self.early_stop = self.early_stop or sig

    def init_signals(self) -> None:
        """gunicorn's handlers, then the stop signal that came before them, if one did."""
        super().init_signals()
        if self.early_stop == signal.SIGTERM:
            self.handle_exit(self.early_stop, None)
        elif self.early_stop is not None:
            self.handle_quit(self.early_stop, None)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: stop now, not at gunicorn's next look (its loop sleeps a second)."""
        super().handle_exit(sig, frame)
        gevent.spawn(self.stop_serving)  # out of the signal handler, as gunicorn's quit

    def stop_serving(self) -> None:
        """Stop accepting, end idle connections and live reads, and exit once every
        connection has gone: within about a second where gunicorn's stop waited for
        every long-poll and SSE response to reach its own deadline (a minute for SSE).

        Live reads answer at once with what they have (wakeups.py's `end_waits`: SSE a
        last control event, long-poll its 204 or data); appends in flight finish and are
        answered, with `Connection: close` as every answer from now on. gunicorn's own
        loop stays the backstop: past graceful_timeout it ends whatever is left.
        """
        for server in PicoMQServer.serving:
            server.close()
        gevent.get_hub().loop.run_callback(PicoMQHandler.end_idle_connections)
        end_waits()
        deadline = time.monotonic() + self.cfg.graceful_timeout
        for server in PicoMQServer.serving:
            if not server.pool.join(timeout=max(0.0, deadline - time.monotonic())):
                return
        for hook in self.before_exit:
            try:
                hook()
            except Exception:  # what is left undone, the next member replays
                self.log.exception("stopping: %s failed", hook)
        sys.exit(0)  # as gunicorn's quick quit leaves a gevent worker
