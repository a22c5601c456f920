"""PicoMQ's HTTP layer: the Durable Streams protocol over Flask.

Each view parses and validates its request (400 with a JSON message, never a 500),
makes one call on the stream store, and shapes the response in the protocol's words
(protocol.py). Nothing here touches paths, fsspec or byte layouts. Live reads
(long-poll, SSE) always end by a deadline so a graceful shutdown never has to kill
one. Plain appends, the most frequent request, are answered by fastpath.py before
Flask starts on them, with the same answer.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator

import orjson
from flask import Flask, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from auth import register_auth
from fanout import DIRECT_WRITER_ENVIRON_KEY, DirectWriter, Fanout, Follower
from fastpath import FastAppends
from limits import LiveConnections
from metrics import MeasuredObjectStore
from objectstore import ObjectCache
from ops import register_operations
from protocol import (
    CACHEABLE,
    CLOSED,
    COMMON_HEADERS,
    CURSOR,
    DEFAULT_CONTENT_TYPE,
    EARLIEST_OFFSET,
    EXPIRES_AT,
    FAST_APPEND_FAILURE,
    FORK_OFFSET,
    FORK_SUB_OFFSET,
    FORKED_FROM,
    NO_STORE,
    PRODUCER_HEADERS,
    PROTOCOL_HEADERS,
    RESERVED_PREFIX,
    RETENTION_AGE,
    RETENTION_BYTES,
    RETRY_AFTER_SECONDS,
    SSE_DATA_ENCODING,
    STREAM_PREFIX,
    STREAM_SEQ,
    TTL,
    UP_TO_DATE,
    BadRequest,
    Response,
    advanced_cursor,
    append_answer,
    code_of_reason,
    empty_body,
    error_response,
    etag_of,
    format_offset,
    is_reserved,
    next_cursor,
    parse_content_type,
    parse_expires_at,
    parse_fork_source,
    parse_number,
    parse_offset,
    parse_payload,
    parse_producer,
    parse_start_offset,
    parse_stream_path,
    read_up_to,
    storage_unavailable_response,
    store_error_response,
    stream_headers,
)
from settings import Settings
from storage import (
    MAX_STREAM_SEQ_BYTES,
    AppendRequest,
    CreateRequest,
    Payload,
    ReadResult,
    StorageUnavailable,
    StoreError,
    StoreSettings,
    StreamClosed,
    StreamConflict,
    StreamInfo,
    StreamStore,
    is_json_type,
)
from streamlocks import StreamLocks
from subscriptions import register_subscriptions
from wakeups import WaitsEnded, waits_ended

log = logging.getLogger("picomq")

SSE_CACHE_BYTES = 32 * 1024 * 1024  # formatted SSE event pairs shared by subscribers


class EventStreamResponse(Response):
    """An SSE answer whose generator the server iterates itself, with nothing between.

    Werkzeug hands the server a ClosingIterator over its `iter_encoded` generator: two
    more frames on the stack of every open SSE connection, 17 MiB at 10,000 subscribers
    (`bench/compare.py --only fanout-10000`: 308 → 291 MiB). The events are bytes already.
    """

    def get_app_iter(self, environ: dict) -> Iterable[bytes]:
        return GeneratorBody(self.response, self.close)

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        """Forget the headers once handed to the server: the body keeps this response
        until it closes, and 10,000 subscribers' copies held 5 MiB (scratch probe)."""
        body = super().__call__(environ, start_response)
        self.headers.clear()
        return body


class GeneratorBody:
    """Iterates as its generator itself; closing it closes the generator, then the response."""

    __slots__ = ("events", "close_response")

    def __init__(
        self, events: Generator[bytes, None, None], close_response: Callable[[], None]
    ) -> None:
        self.events, self.close_response = events, close_response

    def __iter__(self) -> Iterator[bytes]:
        return self.events

    def close(self) -> None:
        try:
            self.events.close()
        finally:
            self.close_response()


# -- reading the request ------------------------------------------------------------


def parse_optional_number(name: str) -> int | None:
    text = request.headers.get(name)
    return None if text is None else parse_number(name, text.strip())


def parse_flag(name: str) -> bool:
    """Protocol flags count only when their value is 'true'; anything else is absent."""
    return request.headers.get(name, "").strip().lower() == "true"


def read_body() -> bytes:
    """The request body; 413 past the limit, 400 if the client hangs up before its end
    or does not send it whole within PICOMQ_BODY_TIMEOUT (worker.py ends the read).

    A body of declared length is read straight from gunicorn's reader, in one piece:
    werkzeug's wrapper would copy it through 64 KiB chunks and a bytearray (6 % of the
    batch load's throughput). A chunked body goes through werkzeug, which stops at the
    limit; one more byte waiting means it was too large.
    """
    length = request.content_length
    limit = request.max_content_length
    if length is not None:
        if limit is not None and length > limit:
            raise RequestEntityTooLarge()
        body = read_up_to(request.environ["wsgi.input"], length)
        if len(body) < length:
            raise BadRequest(
                f"the body ended after {len(body)} of its {length} bytes"
                " (the client hung up, or did not send it within the body deadline)"
            )
        return body
    body = request.get_data()
    if limit is not None and len(body) >= limit and request.input_stream.read(1):
        raise RequestEntityTooLarge()
    return body


def parse_read_offset() -> str | None:
    """The raw `offset` query value: None when absent; one value only, never empty."""
    values = request.args.getlist("offset")
    if len(values) > 1:
        raise BadRequest("give offset once")
    if not values:
        return None
    if values[0] in ("-1", "now"):
        return values[0]
    parse_offset(values[0])
    return values[0]


# -- the app ----------------------------------------------------------------------


def create_store(settings: Settings) -> StreamStore:
    """Object stores bill per request: check them less often than a local disk.

    Several workers take turns at a stream's commits; one worker needs no lock for it.
    """
    objects = MeasuredObjectStore(settings.storage_url)
    local = objects.is_local
    store_settings = StoreSettings(
        max_read_bytes=settings.max_read_bytes,
        cache_bytes=settings.cache_bytes,
        index_cache_bytes=settings.index_cache_bytes // 2,
        handle_cache_bytes=settings.index_cache_bytes // 2,
        poll_interval=settings.poll_interval or (0.05 if local else 1.0),
        watched_poll_interval=settings.poll_interval or 1.0,
        recheck_interval=0.0 if local else 1.0,
        linger_fraction=0.0 if local else 0.5,
        index_max_age=settings.index_max_age,
        # A sweep reads every stream: cheap on disk, a bucket listing on object stores.
        sweep_interval=(3600.0 if local else 0.0)
        if settings.sweep_interval is None
        else settings.sweep_interval,
        retention_age=settings.retention_age,
        retention_bytes=settings.retention_bytes,
    )
    writer_locks = StreamLocks.for_storage(objects.root, local) if settings.workers > 1 else None
    return StreamStore(objects, store_settings, writer_locks)


class StreamApp(Flask):
    """Flask, with a first look at each request for an answer that needs none of Flask.

    In `__call__`, in place of Flask's own, so live reads and every other request run
    no deeper than before: one more frame in the WSGI call chain costs each open SSE
    connection about 4 KiB (10,000 subscribers: 298 → 321 MiB).
    """

    fast_path: Callable[[dict, Callable], Iterable[bytes] | None] | None = None

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if self.fast_path is not None:
            answer = self.fast_path(environ, start_response)
            if answer is not None:
                return answer
        return self.wsgi_app(environ, start_response)


def create_app(settings: Settings, store: StreamStore | None = None) -> StreamApp:
    """The app: the stream routes, then the subscription and operator routes beside them.

    Flask runs `before_request` hooks in the order they were added and `after_request`
    hooks in the reverse order, so the order of the calls below is the order of the hooks:
    before a view, the token check (auth.py: a refused request runs no other hook), then
    the request id and metrics (ops.py); after it, the common headers, then the metrics
    and access line (ops.py), then the private cache policy of a token's answer (auth.py).
    """
    app = StreamApp(__name__)
    app.response_class = Response
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.url_map.merge_slashes = False
    app.url_map.strict_slashes = False
    verifier = register_auth(app, settings)
    store = store or create_store(settings)
    app.extensions["picomq.store"] = store
    views = StreamViews(store, settings)
    app.add_url_rule(
        f"{STREAM_PREFIX}<path:path>",
        "stream",
        views.dispatch,
        methods=["GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS"],
    )
    register_subscriptions(app, store, settings)
    register_operations(app, store, settings)
    register_common_answers(app)
    app.fast_path = FastAppends(store, settings, verifier)
    return app


def register_common_answers(app: Flask) -> None:
    """The headers every answer carries, and JSON errors for what no view answered."""

    @app.after_request
    def add_common_headers(response: Response) -> Response:
        response.headers.update(COMMON_HEADERS)
        return response

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> Response:
        code = code_of_reason(error.name or "error")
        return error_response(error.code or 500, code, error.description or error.name)

    @app.errorhandler(Exception)
    def unexpected_error(error: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal_error", "internal server error")


class StreamViews:
    """One method per protocol operation on `/v1/stream/<path>`."""

    def __init__(self, store: StreamStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.live_connections = LiveConnections(settings.max_live_connections)
        self.sse_cache = ObjectCache(SSE_CACHE_BYTES)
        self.fanout = Fanout(store, self.sse_event, advanced_cursor, settings.long_poll_timeout)

    def dispatch(self, path: str) -> Response:
        handlers = {
            "GET": self.read,
            "HEAD": self.head,
            "PUT": self.create,
            "POST": self.append,
            "DELETE": self.delete,
            "OPTIONS": self.preflight,
        }
        if is_reserved(path):
            return error_response(404, "not_found", f"{RESERVED_PREFIX}/ paths are reserved")
        try:
            return handlers[request.method](parse_stream_path(path))
        except BadRequest as error:
            return error_response(400, "bad_request", str(error))
        except StoreError as error:
            return store_error_response(error)
        except StorageUnavailable as error:
            log.warning("storage unavailable: %s", error)
            return storage_unavailable_response()

    # -- PUT ------------------------------------------------------------------------

    def create(self, path: str) -> Response:
        create_request = self.parse_create()
        created, info = self.store.create(path, create_request)
        headers = stream_headers(info)
        if created:
            headers["Location"] = request.base_url
        return Response(status=201 if created else 200, headers=headers)

    def parse_create(self) -> CreateRequest:
        headers = request.headers
        ttl_text, expires_text = headers.get(TTL), headers.get(EXPIRES_AT)
        if ttl_text is not None and expires_text is not None:
            raise BadRequest(f"give {TTL} or {EXPIRES_AT}, not both")
        fork_source = headers.get(FORKED_FROM)
        fork_offset = headers.get(FORK_OFFSET)
        sub_offset = headers.get(FORK_SUB_OFFSET)
        if fork_source is None and (fork_offset is not None or sub_offset is not None):
            raise BadRequest(f"{FORK_OFFSET} and {FORK_SUB_OFFSET} need {FORKED_FROM}")
        content_type = parse_content_type(request.headers.get("Content-Type"), required=False)
        if fork_source is None:
            content_type = content_type or DEFAULT_CONTENT_TYPE
        body = read_body()
        payload = None
        if body:
            if content_type is None:
                raise BadRequest("Content-Type is required with a body")
            payload = self.parse_payload(content_type, body, allow_empty=True)
        return CreateRequest(
            content_type=content_type or "",
            ttl=parse_number(TTL, ttl_text.strip()) if ttl_text is not None else None,
            expires_at=parse_expires_at(expires_text) if expires_text is not None else None,
            closed=parse_flag(CLOSED),
            payload=payload,
            fork_source=parse_fork_source(fork_source) if fork_source is not None else None,
            fork_offset=parse_offset(fork_offset.strip()) if fork_offset is not None else None,
            fork_sub_offset=(
                parse_number(FORK_SUB_OFFSET, sub_offset.strip()) if sub_offset is not None else 0
            ),
            retention_age=parse_optional_number(RETENTION_AGE),
            retention_bytes=parse_optional_number(RETENTION_BYTES),
        )

    def parse_payload(self, content_type: str, body: bytes, *, allow_empty: bool) -> Payload:
        return parse_payload(
            content_type,
            body,
            allow_empty=allow_empty,
            max_depth=self.settings.max_json_depth,
            max_messages=self.settings.max_append_messages,
        )

    # -- POST -----------------------------------------------------------------------

    def append(self, path: str) -> Response:
        failure = request.environ.get(FAST_APPEND_FAILURE)
        if failure is not None:  # the fast path's store call failed: answer as if it were ours
            raise failure
        close = parse_flag(CLOSED)
        body = read_body()
        if not body and not close:
            raise BadRequest("an append needs a body (or Stream-Closed: true to close)")
        payload = None
        content_type = parse_content_type(request.headers.get("Content-Type"), bool(body))
        if body:
            try:
                payload = self.parse_payload(content_type, body, allow_empty=False)
            except BadRequest:
                self.raise_conflict_before_bad_body(path, content_type)
                raise
        producer = parse_producer(*(request.headers.get(name) for name in PRODUCER_HEADERS))
        stream_seq = request.headers.get(STREAM_SEQ)
        if stream_seq is not None and len(stream_seq.encode()) > MAX_STREAM_SEQ_BYTES:
            raise BadRequest(f"{STREAM_SEQ} is longer than {MAX_STREAM_SEQ_BYTES} bytes")
        result = self.store.append(
            path, AppendRequest(content_type, payload, close, producer, stream_seq)
        )
        status, headers = append_answer(result, producer is not None and payload is not None)
        return Response(status=status, headers=headers)

    def raise_conflict_before_bad_body(self, path: str, content_type: str | None) -> None:
        """A closed stream or a type mismatch outranks a malformed body (409 before 400)."""
        info = self.store.head(path)
        if info.closed:
            raise StreamClosed(info.tail)
        if not is_json_type(info.content_type) or not is_json_type(content_type or ""):
            raise StreamConflict("Content-Type does not match the stream's content type")

    # -- HEAD, DELETE, OPTIONS --------------------------------------------------------

    def head(self, path: str) -> Response:
        info = self.store.head(path)
        headers = stream_headers(info)
        headers["Cache-Control"] = NO_STORE
        if info.ttl is not None:
            headers[TTL] = str(info.ttl)
        if info.expires_at is not None:
            headers[EXPIRES_AT] = info.expires_at
        if info.retention_age is not None:
            headers[RETENTION_AGE] = str(info.retention_age)
        if info.retention_bytes is not None:
            headers[RETENTION_BYTES] = str(info.retention_bytes)
        headers[EARLIEST_OFFSET] = format_offset(info.earliest)
        return Response(status=200, headers=headers)

    def delete(self, path: str) -> Response:
        self.store.delete(path)
        return Response(status=204)

    @staticmethod
    def preflight(path: str) -> Response:
        requested = request.headers.get("Access-Control-Request-Headers", "")
        allowed = ", ".join(filter(None, (requested, *PROTOCOL_HEADERS)))
        headers = {"Access-Control-Allow-Headers": allowed, "Access-Control-Max-Age": "86400"}
        return Response(status=204, headers=headers)

    # -- GET --------------------------------------------------------------------------

    def read(self, path: str) -> Response:
        live = request.args.get("live")
        offset_text = parse_read_offset()
        if live is None:
            return self.catch_up(path, offset_text)
        if offset_text is None:
            raise BadRequest("live reads need an offset")
        if live not in ("long-poll", "sse"):
            raise BadRequest("live must be 'long-poll' or 'sse'")
        if not self.live_connections.admit():
            return error_response(
                503, "too_many_live_connections", "this worker serves its most live reads; retry",
                {"Retry-After": RETRY_AFTER_SECONDS},
            )  # fmt: skip
        try:
            view = self.long_poll if live == "long-poll" else self.sse
            return self.live_connections.hold_until_closed(view(path, offset_text))
        except BaseException:
            self.live_connections.release()  # no response will be closed to release it
            raise

    def start_of_live_read(self, path: str, offset_text: str) -> tuple[int, str | None]:
        """Where a live read starts, and the incarnation it must stay on, if known.

        'now' is the tail of the stream as it is at request time; the read then keeps
        to that stream, so one deleted and created again meanwhile is a 404, never a
        400 for an offset past the new one's end or bytes of the new one.
        """
        if offset_text == "now":
            info = self.store.touch(path)
            return info.tail, info.incarnation
        return parse_start_offset(offset_text) or 0, None

    def catch_up(self, path: str, offset_text: str | None) -> Response:
        if offset_text == "now":
            info = self.store.touch(path)
            headers = stream_headers(info)
            headers.update({UP_TO_DATE: "true", "Cache-Control": NO_STORE})
            return Response(empty_body(info), 200, headers)
        result = self.store.read(path, parse_start_offset(offset_text))
        return self.read_response(result)

    def read_response(self, result: ReadResult, extra: dict[str, str] | None = None) -> Response:
        info = result.info
        headers = stream_headers(info, result.end)
        etag = etag_of(result)
        at_open_tail = result.start == result.end and not info.closed
        headers.update({"ETag": etag, "Cache-Control": NO_STORE if at_open_tail else CACHEABLE})
        if result.up_to_date:
            headers[UP_TO_DATE] = "true"
        headers.update(extra or {})
        if etag in request.headers.get("If-None-Match", ""):
            return Response(status=304, headers=headers)
        return Response(result.chunks, 200, headers)

    def long_poll(self, path: str, offset_text: str) -> Response:
        position, incarnation = self.start_of_live_read(path, offset_text)
        cursor = {CURSOR: next_cursor(request.args.get("cursor"))}
        timeout = self.settings.long_poll_timeout
        info = self.live_wait(path, position, timeout, incarnation)
        if info.tail > position:
            result = self.store.read(path, position, incarnation=info.incarnation, after_wait=True)
            return self.read_response(result, cursor)
        headers = stream_headers(info)
        headers.update({UP_TO_DATE: "true", "Cache-Control": NO_STORE, **cursor})
        return Response(status=204, headers=headers)

    def live_wait(
        self, path: str, offset: int, timeout: float, incarnation: str | None
    ) -> StreamInfo:
        """The store's wait, cut short when the worker stops: then the stream as it is,
        so the live read answers at once with what it has, and its client resumes from
        Stream-Next-Offset on the next server instead of holding the stop."""
        try:
            return self.store.wait(path, offset, timeout, incarnation=incarnation)
        except WaitsEnded:
            return self.store.wait(path, offset, 0.0, incarnation=incarnation)

    def sse(self, path: str, offset_text: str) -> Response:
        requested, incarnation = self.start_of_live_read(path, offset_text)
        # A bad offset is a 400, before the 200; one inside an append starts at the append.
        result = self.store.read(path, requested, incarnation=incarnation)
        info, offset = result.info, result.start
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if not is_json_type(info.content_type) and not info.content_type.startswith("text/"):
            headers[SSE_DATA_ENCODING] = "base64"
        cursor = request.args.get("cursor")
        next_cursor(cursor)  # only to refuse a malformed one (400) before the 200
        writer = request.environ.get(DIRECT_WRITER_ENVIRON_KEY)
        base64_data = SSE_DATA_ENCODING in headers
        events = self.sse_events(path, info.incarnation, offset, cursor, base64_data, writer)
        return EventStreamResponse(events, 200, headers)

    def sse_event(
        self, path: str, info: StreamInfo, offset: int, cursor: str, base64_data: bool
    ) -> tuple[int, bytes]:
        """The data event from `offset` (if any) and its control event, built once.

        Stream bytes never change, so what one subscriber is sent for a place in the
        stream (offset, tail, closed, cursor) is right for every subscriber there: a
        message to 10,000 subscribers is read and formatted once, then only written.
        The data may end before the tail (the read cap); the next pass goes on from it.
        """
        key = (info.incarnation, offset, info.tail, info.closed, cursor, base64_data)
        cached = self.sse_cache.get(key)
        if cached is not None:
            return int.from_bytes(cached[:8], "big"), cached[8:]
        end, data_event = offset, b""
        if info.tail > offset:
            result = self.store.read(path, offset, incarnation=info.incarnation, after_wait=True)
            end, data_event = result.end, format_data_event(b"".join(result.chunks), base64_data)
        # One write per pair: a reader never sees a data event without its control.
        event = data_event + format_control_event(info, end, cursor)
        self.sse_cache.put(key, end.to_bytes(8, "big") + event)
        return end, event

    def sse_events(
        self,
        path: str,
        incarnation: str,
        offset: int,
        client_cursor: str | None,
        base64_data: bool,
        writer: DirectWriter | None,
    ) -> Generator[bytes, None, None]:
        """Data events each followed by a control event, until closed, the deadline or
        the worker's stop.

        At the tail, with a server that offers its connection (`writer`), the stream's
        broadcaster writes the events (fanout.py) until it hands the connection back.
        The events come from one incarnation of the stream: when it is deleted the
        response ends, even if a new stream is created at the path.
        """
        deadline = time.monotonic() + self.settings.sse_max_duration
        timeout = 0.0  # the first pass answers at once: history, or where the tail is
        cursor = next_cursor(client_cursor)
        try:
            while True:
                info = self.live_wait(path, offset, timeout, incarnation)
                cursor = advanced_cursor(cursor)
                offset, event = self.sse_event(path, info, offset, cursor, base64_data)
                yield event
                at_end = info.closed and offset == info.tail
                if at_end or time.monotonic() >= deadline or waits_ended():
                    return
                timeout = min(self.settings.long_poll_timeout, deadline - time.monotonic())
                if writer is None or offset != info.tail:
                    continue
                follower = Follower(
                    writer, incarnation, offset, cursor, base64_data, writer.chunked
                )
                if not self.fanout.follow(path, follower, timeout):
                    continue
                if follower.failed:
                    return
                if follower.unsent:
                    writer.send_rest(follower.unsent)
                if follower.closed:
                    return
                offset, cursor = follower.offset, follower.cursor
                if follower.timed_out:
                    timeout = 0.0  # the pass that ends the response, or a control event
        except (StoreError, StorageUnavailable, OSError) as error:  # OSError: from send_rest
            log.info("SSE on %s ended: %s", path, error)


def format_data_event(data: bytes, base64_data: bool) -> bytes:
    """One `data:` field per line of the data (CR, LF and CRLF all end a line in SSE).

    SSE parsers drop one space after `data:`, so a line that starts with a space gets
    one more; other lines get none, as the conformance suite expects (`data:line1`).
    """
    text = base64.b64encode(data) if base64_data else data
    lines = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    fields = (b"data: " + line if line[:1] == b" " else b"data:" + line for line in lines)
    return b"event: data\n" + b"\n".join(fields) + b"\n\n"


def format_control_event(info: StreamInfo, offset: int, cursor: str) -> bytes:
    control: dict[str, object] = {"streamNextOffset": format_offset(offset)}
    at_tail = offset == info.tail
    if info.closed and at_tail:
        control["streamClosed"] = True
    else:
        control["streamCursor"] = cursor
    if at_tail:
        control["upToDate"] = True
    return b"event: control\ndata:" + orjson.dumps(control) + b"\n\n"


if __name__ == "__main__":  # `python -m picomq <command>`: the operator commands in cli.py
    from cli import main

    main(prog_name="python -m picomq")
