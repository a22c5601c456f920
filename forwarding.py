"""Forwarding: a stream request that another member serves goes to it, and back, whole.

Every stream has one member that serves it (members.py). A request that reaches any
other worker or node is sent on to that member's peer listener unchanged (method,
target, headers, body), so it is never sent on again, and its answer comes back
as the owner gave it: status, headers, and a body streamed as it comes, so SSE and
long-poll reads work through any node. Clients need no redirect to follow: the Python
client follows none.

When the owner does not answer, its heartbeat decides: a dead owner's partition is
claimed here and the request served here; a live one unreachable is a 503 with
Retry-After. An owner that no longer owns the partition answers 421, and the claims
are read again once.

Requests that come to the peer listener (worker.py marks them; no header a client
sends can) are served only by the owner, never sent on again. Members also ask an
owner to act on a stream it serves (`ask`): before a fork is made, to rewrite what it
holds of the source into its segments, where the fork will read it ("settle"); after
a fork's delete erased its soft-deleted source, to look at storage again ("recheck"),
for an owner trusts what it holds of its streams.

A subscription (`__ds/subscriptions/<id>/...`) is served as a stream is, by the member
that serves its key (protocol.subscription_key): its wakes, leases and tokens live in
that one process (subscriptions.py).
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from urllib.parse import quote

import urllib3
from urllib3.connection import HTTPConnection

from members import Membership, Owner
from objectstore import StorageUnavailable
from protocol import RETRY_AFTER_SECONDS, STREAM_PREFIX, is_reserved, reserved_route_key
from streams import StoreError
from wakeups import when_waits_end
from wire import PEER_ENVIRON_KEY, error_body

log = logging.getLogger("picomq.forwarding")

ASK_HEADER = "X-PicoMQ-Ask"  # honoured on the peer listener only
ASK_KEY = "HTTP_X_PICOMQ_ASK"
MISDIRECTED = 421
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
QUICK_LEASES = 2  # an answer that is no live read comes within this many leases
# Failures before the request left: the owner never saw it.
NEVER_SENT = (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError)
CONNECT_SECONDS = 2.0
# A pooled connection to a peer is not reused after this long idle: well under the
# `keepalive` of gunicorn.conf.py (5 s), after which the peer ends it (`PeerPool`).
PEER_IDLE_SECONDS = 2.0
READ_MARGIN_SECONDS = 30.0  # past the longest quiet spell of a live answer
POOL_CONNECTIONS = 64
STREAM_CHUNK_BYTES = 64 * 1024
# Headers of one connection, not of the request or answer (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade"}
)  # fmt: skip


class Forwarder:
    """The WSGI answer to stream requests another member serves; None for the others."""

    def __init__(
        self,
        membership: Membership,
        max_body_bytes: int,
        live_seconds: float,
        asked: dict[str, Callable[[str], None]],
    ) -> None:
        """`asked[action](path)` does what another member asks of a stream served here."""
        self.membership = membership
        self.asked = asked
        self.max_body_bytes = max_body_bytes
        self.live_timeout = urllib3.Timeout(
            connect=CONNECT_SECONDS, read=live_seconds + READ_MARGIN_SECONDS
        )
        self.quick_timeout = urllib3.Timeout(
            connect=CONNECT_SECONDS, read=QUICK_LEASES * membership.lease_seconds
        )
        self.pools: dict[str, urllib3.HTTPConnectionPool] = {}
        self.open: set[urllib3.BaseHTTPResponse] = set()  # answers being relayed
        when_waits_end(self.end_relays)

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes] | None:
        if not self.membership.started:
            return None  # served alone
        path_info = environ.get("PATH_INFO", "")
        if not path_info.startswith(STREAM_PREFIX):
            return None
        path = path_info[len(STREAM_PREFIX) :]
        key = reserved_route_key(path) if is_reserved(path) else path
        if key is None:
            return None  # answered alike by every member
        try:
            owner = self.membership.owner_for(key)
        except StorageUnavailable as error:
            return unavailable(start_response, f"who serves this stream is unknown: {error}")
        from_peer = environ.get(PEER_ENVIRON_KEY, False)
        if owner is None:
            if from_peer and ASK_KEY in environ:
                return self._do_asked(environ[ASK_KEY], path, start_response)
            return None
        if from_peer:  # the member that sent it thinks we serve it: it looks again
            return misdirected(start_response)
        return self.forward(environ, start_response, key, owner)

    def _do_asked(self, action: str, path: str, start_response: Callable) -> list[bytes]:
        do = self.asked.get(action)
        if do is None:
            return answer_empty(start_response, "400 Bad Request")
        try:
            do(path)
        except StorageUnavailable as error:
            return unavailable(start_response, f"could not {action} the stream: {error}")
        except StoreError:
            pass  # gone, or never there: the asker's own look says so
        return answer_empty(start_response, "204 No Content")

    def ask(self, path: str, action: str) -> None:
        """Have the member serving `path`'s stream do `action` (a key of `asked`) to it,
        here if this process serves it. Raises StorageUnavailable if that cannot be
        done now."""
        for _ in range(2):
            owner = self.membership.owner_for(path)
            if owner is None:
                self.asked[action](path)
                return
            environ = {"REQUEST_METHOD": "POST", "PATH_INFO": f"{STREAM_PREFIX}{path}"}
            try:
                answer = self._send(environ, b"", owner, {ASK_HEADER: action})
            except urllib3.exceptions.HTTPError as error:
                raise StorageUnavailable(f"the stream's server is unreachable: {error}") from None
            answer.drain_conn()
            answer.release_conn()
            if answer.status == 204:
                return
            if answer.status != MISDIRECTED:
                raise StorageUnavailable(f"the stream's server answered {answer.status}")
            self.membership.forget_owner(path)
        raise StorageUnavailable("the stream's server keeps moving; retry")

    def forward(
        self, environ: dict, start_response: Callable, path: str, owner: Owner
    ) -> Iterable[bytes] | None:
        body = read_body(environ, self.max_body_bytes)
        for _ in range(2):
            reached = False  # whether the owner may have acted on the request
            try:
                answer = self._send(environ, body, owner)
            except urllib3.exceptions.HTTPError as error:
                if not self.membership.owner_is_dead(owner):
                    log.warning("owner %s of %s unreachable: %s", owner.member, path, error)
                    return unavailable(start_response, "the stream's server is unreachable")
                answer, reached = None, not isinstance(error, NEVER_SENT)
            if answer is not None and answer.status != MISDIRECTED:
                return self._relay(answer, start_response)
            if answer is not None:
                answer.release_conn()
            self.membership.forget_owner(path)
            try:
                owner = self.membership.owner_for(path)
            except StorageUnavailable as error:
                return unavailable(start_response, f"who serves this stream is unknown: {error}")
            if owner is None and reached and environ["REQUEST_METHOD"] not in SAFE_METHODS:
                # The dead owner may have stored it: the client's retry decides (producers'
                # retries are deduplicated), not ours.
                return unavailable(start_response, "the stream's server stopped; retry")
            if owner is None:  # ours now: served here, with the body put back
                environ["wsgi.input"] = io.BytesIO(body)
                environ["CONTENT_LENGTH"] = str(len(body))
                environ.pop("HTTP_TRANSFER_ENCODING", None)
                return None
        return unavailable(start_response, "the stream's server keeps moving; retry")

    def _send(
        self, environ: dict, body: bytes, owner: Owner, extra: dict[str, str] | None = None
    ) -> urllib3.BaseHTTPResponse:
        """Send the request to `owner`. A live read may stay quiet for as long as it
        lasts; any other answer comes within `quick_seconds`, or the owner's heartbeat
        is looked at: a paused owner holds no client for longer."""
        headers = {**request_headers(environ, len(body)), **(extra or {})}
        timeout = self.live_timeout if is_live(environ) else self.quick_timeout
        return self.send(owner, environ["REQUEST_METHOD"], target(environ), headers, body, timeout)

    def send(
        self,
        owner: Owner,
        method: str,
        request_target: str,
        headers: dict[str, str],
        body: bytes,
        timeout: urllib3.Timeout,
    ) -> urllib3.BaseHTTPResponse:
        """One request to `owner`'s peer listener, on a kept-alive connection; the answer
        unread. Raises urllib3's HTTPError when it cannot be sent or answered in time."""
        pool = self.pools.get(owner.address)
        if pool is None:
            host, _, port = owner.address.rpartition(":")
            pool = PeerPool(host, int(port), maxsize=POOL_CONNECTIONS, block=False)
            self.pools[owner.address] = pool
        return pool.urlopen(
            method, request_target, body=body or None, headers=headers, retries=False,
            redirect=False, timeout=timeout, preload_content=False, decode_content=False,
        )  # fmt: skip

    def _relay(self, answer: urllib3.BaseHTTPResponse, start_response: Callable) -> Iterator[bytes]:
        headers = [
            (name, value)
            for name, value in answer.headers.items()
            if name.lower() not in HOP_BY_HOP
        ]
        start_response(f"{answer.status} {answer.reason}", headers)
        self.open.add(answer)
        return self._body(answer)

    def _body(self, answer: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
        """The owner's body as it comes: each chunk of a chunked answer at once."""
        try:
            yield from answer.stream(STREAM_CHUNK_BYTES, decode_content=False)
        except (urllib3.exceptions.HTTPError, OSError) as error:
            log.info("relay ended: %s", error)
        finally:
            self.open.discard(answer)
            answer.release_conn()

    def end_relays(self) -> None:
        """The worker is stopping: end the live answers being relayed (their clients
        resume from their offsets, as after any stop)."""
        for answer in list(self.open):
            answer.shutdown()


class PeerPool(urllib3.HTTPConnectionPool):
    """Kept-alive connections to one peer listener, none reused once idle for
    PEER_IDLE_SECONDS.

    The peer ends a connection that brings no request head within `keepalive` seconds
    (worker.py). urllib3 leaves out a connection whose end has arrived, but a request
    sent as the peer's deadline fires is lost with the connection, unread; this side
    cannot tell that from an owner that stopped mid-request, and answers 503 (one of
    16 racing DELETEs through 4 workers did, once in a full test run). A connection
    retired well before the peer's deadline never meets it."""

    def _put_conn(self, conn: HTTPConnection | None) -> None:
        if conn is not None:
            conn.idle_since = time.monotonic()  # type: ignore[attr-defined]
        super()._put_conn(conn)

    def _get_conn(self, timeout: float | None = None) -> HTTPConnection:
        conn = super()._get_conn(timeout)
        idle_since = getattr(conn, "idle_since", None)
        if idle_since is not None and time.monotonic() - idle_since > PEER_IDLE_SECONDS:
            conn.close()  # reconnects when next used, as a dropped connection does
        return conn


def target(environ: dict) -> str:
    """The request's target as the client sent it (the path is decoded in PATH_INFO)."""
    path = quote(environ["PATH_INFO"].encode("latin-1"), safe="/")
    query = environ.get("QUERY_STRING")
    return f"{path}?{query}" if query else path


def is_live(environ: dict) -> bool:
    """A long-poll or SSE read: its answer may be quiet for as long as it lasts."""
    return "live=" in environ.get("QUERY_STRING", "")


def request_headers(environ: dict, length: int) -> dict[str, str]:
    headers = {
        key[5:].replace("_", "-").title(): value
        for key, value in environ.items()
        if key.startswith("HTTP_") and key[5:].replace("_", "-").lower() not in HOP_BY_HOP
    }
    if environ.get("CONTENT_TYPE"):
        headers["Content-Type"] = environ["CONTENT_TYPE"]
    headers["Content-Length"] = str(length)
    return headers


def read_body(environ: dict, most: int) -> bytes:
    """The whole body, or its first `most` + 1 bytes: the owner answers 413 past `most`."""
    stream = environ["wsgi.input"]
    chunks, received = [], 0
    while received <= most:
        chunk = stream.read(min(STREAM_CHUNK_BYTES, most + 1 - received))
        if not chunk:
            break
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def answer_empty(start_response: Callable, status: str) -> list[bytes]:
    start_response(status, [("Content-Length", "0")])
    return []


def misdirected(start_response: Callable) -> list[bytes]:
    """421: this member does not serve the request's stream or subscription (any more);
    the member that forwarded it reads the claims again and sends it to the one that does."""
    body = error_body("misdirected", "another member serves this; ask again")
    start_response(
        "421 MISDIRECTED REQUEST",
        [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
    )
    return [body]


def unavailable(start_response: Callable, message: str) -> list[bytes]:
    body = error_body("storage_unavailable", message)
    start_response(
        "503 SERVICE UNAVAILABLE",
        [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
         ("Retry-After", RETRY_AFTER_SECONDS)],
    )  # fmt: skip
    return [body]
