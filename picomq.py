"""PicoMQ's HTTP layer: the Durable Streams protocol over Flask.

Each view parses and validates its request (400 with a JSON message, never a 500),
makes one call on the stream store, and shapes the response in the protocol's words
(protocol.py). Nothing here touches paths, fsspec or byte layouts. Live reads
(long-poll, SSE) always end by a deadline so a graceful shutdown never has to kill
one.

These views are the reference: on any WSGI server they answer every request
completely. Two accelerators stand in front and must answer as they do: fastpath.py
answers plain appends, the most frequent request, before Flask starts on them, and
PicoMQ's gunicorn worker (worker.py) serves connections faster and lets the SSE
fan-out (live.py) write to subscribers at the tail. The tests that hold them equal
are named in those modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from flask import Flask, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from auth import refusal, register_auth, token_revoked, watch_request_token
from fastpath import FastAppends
from forwarding import Forwarder
from live import EventStreams, LiveConnections, LiveRead, LiveReadEnded, live_wait
from members import Membership, partition_of
from metrics import MeasuredObjects, get_metrics
from objectstore import StorageUnavailable
from ops import register_operations
from peers import Peers
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
    IF_MATCH,
    NO_STORE,
    PRODUCER_HEADERS,
    PROTOCOL_HEADERS,
    RESERVED_PREFIX,
    RETENTION_AGE,
    RETENTION_BYTES,
    RETRY_AFTER_SECONDS,
    STREAM_PREFIX,
    STREAM_SEQ,
    TTL,
    UP_TO_DATE,
    BadRequest,
    Response,
    append_answer,
    empty_body,
    error_response,
    etag_of,
    format_offset,
    is_reserved,
    next_cursor,
    parse_content_type,
    parse_expires_at,
    parse_fork_source,
    parse_if_match,
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
from storage import StreamStore, open_objects
from streamlocks import StreamLocks
from streams import (
    MAX_STREAM_SEQ_BYTES,
    AppendRequest,
    CreateRequest,
    Payload,
    ReadResult,
    StoreError,
    StoreSettings,
    StreamClosed,
    StreamConflict,
    is_json_type,
)
from subscriptions import register_subscriptions
from wire import DIRECT_WRITER_ENVIRON_KEY, code_of_reason

log = logging.getLogger("picomq")


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
    werkzeug's wrapper would copy it through 64 KiB chunks and a bytearray, which
    batched appends felt (figures: bench/README.md). A chunked body goes through
    werkzeug, which stops at the limit; one more byte waiting means it was too large.
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


def _either(value: float | None, default: float) -> float:
    """A setting given, or its `auto` default."""
    return default if value is None else value


def create_store(settings: Settings) -> StreamStore:
    """Object stores bill per request: check them less often than a local disk.

    Several workers take turns at a stream's commits; one worker needs no lock for it.
    """
    objects = MeasuredObjects(open_objects(settings.storage_url))
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
        sweep_interval=_either(settings.sweep_interval, 3600.0 if local else 0.0),
        retention_age=settings.retention_age,
        retention_bytes=settings.retention_bytes,
        log_linger=(0.0 if local else 0.005)
        if settings.log_linger is None
        else settings.log_linger,
        rewrite_seconds=settings.rewrite_seconds,
        held_bytes=settings.log_held_bytes,
    )
    writer_locks = StreamLocks.for_storage(objects.root, local) if settings.workers > 1 else None
    return StreamStore(objects, store_settings, writer_locks)


class StreamApp(Flask):
    """Flask, with a first look at each request for an answer that needs none of Flask.

    In `__call__`, in place of Flask's own, so live reads and every other request run
    no deeper than before: each frame of the WSGI call chain stays on the stack of an
    open SSE connection for as long as it is open (figures: bench/README.md).
    """

    fast_path: Callable[[dict, Callable], Iterable[bytes] | None] | None = None
    forwarder: Forwarder | None = None

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if self.forwarder is not None:  # a stream another member serves goes there
            answer = self.forwarder(environ, start_response)
            if answer is not None:
                return answer
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
    store = store or create_store(settings)
    verifier = register_auth(app, settings, store.objects)
    app.extensions["picomq.store"] = store
    views = StreamViews(store, settings)
    app.add_url_rule(
        f"{STREAM_PREFIX}<path:path>",
        "stream",
        views.dispatch,
        methods=["GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS"],
    )
    membership, app.forwarder = serve_as_member(app, store, settings)
    peers = Peers(membership, app.forwarder, store.objects)
    subscriptions = register_subscriptions(app, store, settings, membership, peers)
    # Beat while live reads wait, wakes are out, or the log holds what is not rewritten.
    membership.busy = lambda: (
        views.live_connections.busy() or subscriptions.busy() or bool(store.rewrites.holding)
    )
    register_operations(app, store, settings)
    register_common_answers(app)
    app.fast_path = FastAppends(store, settings, verifier)
    return app


def serve_as_member(
    app: StreamApp, store: StreamStore, settings: Settings
) -> tuple[Membership, Forwarder]:
    """Serve only the streams and subscriptions this process owns, forwarding the others
    (members.py). While live reads or wakes are out, the member keeps its heartbeat.

    The membership starts when the worker knows its peer address (gunicorn.conf.py's
    post_worker_init); until then, as under another WSGI server, this process serves
    every stream and keeps looking for others' appends as it always did.
    """
    membership = Membership(store.objects, settings.lease_seconds)
    app.extensions["picomq.membership"] = membership
    store.serves_alone = membership.serves
    membership.on_change.append(
        lambda partition, ours: store.forget_streams(
            lambda path: partition_of(path) == partition, moved=not ours
        )
    )
    # The log: written as the member's id, fenced or given up with it, replayed by the next.
    membership.on_identity.append(store.log.begin)
    store.log.on_fenced.append(membership.retire)
    membership.replay = store.replay
    membership.log_fenced = store.log.is_fenced
    live_seconds = max(settings.long_poll_timeout, settings.sse_max_duration)
    asked = {"settle": store.settle, "recheck": store.recheck}
    forwarder = Forwarder(membership, settings.max_request_bytes, live_seconds, asked)
    store.ask_owner = forwarder.ask
    return membership, forwarder


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
        live_gauge = get_metrics().live_connections
        self.live_connections = LiveConnections(settings.max_live_connections, live_gauge)
        self.event_streams = EventStreams(store, settings)

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
        if_match = request.headers.get(IF_MATCH)
        tail = parse_if_match(if_match) if if_match is not None else None
        result = self.store.append(
            path, AppendRequest(content_type, payload, close, producer, stream_seq, tail)
        )
        produced = producer is not None and payload is not None
        status, headers = append_answer(result, produced, conditional=tail is not None)
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
        if not self.live_connections.admit(live):
            return error_response(
                503, "too_many_live_connections", "this worker serves its most live reads; retry",
                {"Retry-After": RETRY_AFTER_SECONDS},
            )  # fmt: skip
        live_read = LiveRead()
        stop_watching = watch_request_token(live_read.end)  # ends it if the token is revoked
        try:
            view = self.long_poll if live == "long-poll" else self.sse
            response = view(path, offset_text, live_read)
        except BaseException:
            stop_watching()  # no response will be closed to release the slot and the watch
            self.live_connections.release(live)
            raise
        response.call_on_close(stop_watching)
        return self.live_connections.hold_until_closed(response, live)

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

    def long_poll(self, path: str, offset_text: str, live_read: LiveRead) -> Response:
        position, incarnation = self.start_of_live_read(path, offset_text)
        cursor = {CURSOR: next_cursor(request.args.get("cursor"))}
        timeout = self.settings.long_poll_timeout
        try:
            with live_read.interruptible():
                info = live_wait(self.store, path, position, timeout, incarnation)
        except LiveReadEnded:
            return refusal(token_revoked())
        if info.tail > position:
            result = self.store.read(path, position, incarnation=info.incarnation, after_wait=True)
            return self.read_response(result, cursor)
        headers = stream_headers(info)
        headers.update({UP_TO_DATE: "true", "Cache-Control": NO_STORE, **cursor})
        return Response(status=204, headers=headers)

    def sse(self, path: str, offset_text: str, live_read: LiveRead) -> Response:
        requested, incarnation = self.start_of_live_read(path, offset_text)
        # A bad offset is a 400, before the 200; one inside an append starts at the append.
        # The response's first event is made of this read.
        first = self.store.read(path, requested, incarnation=incarnation)
        cursor = next_cursor(request.args.get("cursor"))  # a malformed one: 400, before the 200
        writer = request.environ.get(DIRECT_WRITER_ENVIRON_KEY)
        return self.event_streams.response(path, first, cursor, writer, live_read)


if __name__ == "__main__":  # `python -m picomq <command>`: the operator commands in cli.py
    from cli import main

    main(prog_name="python -m picomq")
