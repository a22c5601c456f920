"""PicoMQ's HTTP layer: the Durable Streams protocol over Flask.

Each view parses and validates its request (400 with a JSON message, never a 500),
makes one call on the stream store, and shapes the response. Nothing here touches
paths, fsspec or byte layouts; store outcomes become status codes in
`STATUS_OF_ERROR`. Live reads (long-poll, SSE) always end by a deadline so a
graceful shutdown never has to kill one. Plain appends, the most frequent request,
are answered by fastpath.py before Flask starts on them, with the same answer.
"""

from __future__ import annotations

import base64
import logging
import random
import re
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from datetime import datetime
from typing import IO

import msgspec
import orjson
from flask import Flask, request
from flask import Response as FlaskResponse
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from decimals import MAX_SAFE_INTEGER, parse_decimal
from fanout import DIRECT_WRITER_ENVIRON_KEY, DirectWriter, Fanout, Follower
from limits import LiveConnections, json_array_longer_than, json_nests_deeper_than
from logs import REQUEST_ID_HEADER
from metrics import MeasuredObjects
from objectstore import ObjectCache, StorageUnavailable
from settings import Settings
from storage import StreamStore, open_objects
from streamlocks import StreamLocks
from streams import (
    MAX_PRODUCER_ID_BYTES,
    MAX_STREAM_SEQ_BYTES,
    AppendRequest,
    AppendResult,
    CreateRequest,
    InvalidRequest,
    OffsetTrimmed,
    Payload,
    Producer,
    ProducerFenced,
    ProducerGap,
    ReadResult,
    StoreError,
    StoreSettings,
    StreamClosed,
    StreamConflict,
    StreamGone,
    StreamInfo,
    StreamNotFound,
    is_json_type,
)
from wakeups import WaitsEnded, waits_ended

log = logging.getLogger("picomq")

STREAM_PREFIX = "/v1/stream/"
RESERVED_PREFIX = "__ds"
MAX_PATH_BYTES = 1024
MAX_PATH_DEPTH = 32
DEFAULT_CONTENT_TYPE = "application/octet-stream"
CURSOR_EPOCH = datetime.fromisoformat("2024-10-09T00:00:00+00:00").timestamp()
CURSOR_INTERVAL_SECONDS = 20
RETRY_AFTER_SECONDS = "1"
SSE_CACHE_BYTES = 32 * 1024 * 1024  # formatted SSE event pairs shared by subscribers

NEXT_OFFSET = "Stream-Next-Offset"
UP_TO_DATE = "Stream-Up-To-Date"
CLOSED = "Stream-Closed"
CURSOR = "Stream-Cursor"
TTL = "Stream-TTL"
EXPIRES_AT = "Stream-Expires-At"
STREAM_SEQ = "Stream-Seq"
FORKED_FROM = "Stream-Forked-From"
FORK_OFFSET = "Stream-Fork-Offset"
FORK_SUB_OFFSET = "Stream-Fork-Sub-Offset"
RETENTION_AGE = "Stream-Retention-Age"
RETENTION_BYTES = "Stream-Retention-Bytes"
EARLIEST_OFFSET = "Stream-Earliest-Offset"
PRODUCER_ID = "Producer-Id"
PRODUCER_EPOCH = "Producer-Epoch"
PRODUCER_SEQ = "Producer-Seq"
PRODUCER_EXPECTED_SEQ = "Producer-Expected-Seq"
PRODUCER_RECEIVED_SEQ = "Producer-Received-Seq"
SSE_DATA_ENCODING = "Stream-SSE-Data-Encoding"

PROTOCOL_HEADERS = (
    NEXT_OFFSET, UP_TO_DATE, CLOSED, CURSOR, TTL, EXPIRES_AT, STREAM_SEQ, FORKED_FROM,
    FORK_OFFSET, FORK_SUB_OFFSET, RETENTION_AGE, RETENTION_BYTES, EARLIEST_OFFSET,
    PRODUCER_ID, PRODUCER_EPOCH, PRODUCER_SEQ, PRODUCER_EXPECTED_SEQ, PRODUCER_RECEIVED_SEQ,
    SSE_DATA_ENCODING, "ETag", "Location",
    "Content-Type", "If-None-Match", "Authorization", "Retry-After", REQUEST_ID_HEADER,
)  # fmt: skip
CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, PUT, DELETE, HEAD, OPTIONS",
    "Access-Control-Expose-Headers": ", ".join(PROTOCOL_HEADERS),
}
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Resource-Policy": "cross-origin",
}
COMMON_HEADERS = (*SECURITY_HEADERS.items(), *CORS_HEADERS.items())  # on every response
PRODUCER_HEADERS = (PRODUCER_ID, PRODUCER_EPOCH, PRODUCER_SEQ)  # parse_producer's arguments
# fastpath.py hands a plain append whose store call failed to the view under this key.
FAST_APPEND_FAILURE = "picomq.fast_append_failure"
# A stream's bytes are whatever its writers sent (text/html, SVG, ...), served from this
# origin, where read links may carry a token: a browser that opens one as a page runs
# none of it, gives it an origin of its own, and loads nothing for it.
STREAM_BODY_POLICY = "default-src 'none'; sandbox"
CACHEABLE = "public, max-age=60, stale-while-revalidate=300"
NO_STORE = "no-store"

OFFSET_PATTERN = re.compile(r"0{16}_([0-9]{16})")
CONTENT_TYPE_PATTERN = re.compile(r"[\w.+-]+/[\w.+-]+\s*(;.*)?", re.ASCII)
STARTS_AS_ARRAY = re.compile(rb"[ \t\r\n]*\[")
JSON_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
JSON_VALUE = msgspec.json.Decoder(msgspec.Raw)
FORBIDDEN_PATH_CHARACTERS = re.compile(r"[\x00-\x1f\x7f\\\ufffd]")

STATUS_OF_ERROR: dict[type[Exception], int] = {
    InvalidRequest: 400,
    ProducerFenced: 403,
    StreamNotFound: 404,
    StreamConflict: 409,
    StreamClosed: 409,
    ProducerGap: 409,
    StreamGone: 410,
    OffsetTrimmed: 410,
    StorageUnavailable: 503,
}


class Response(FlaskResponse):
    """No made-up Content-Type on empty answers: 204s and HEADs carry only what we set."""

    default_mimetype = None


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


class BadRequest(Exception):
    """Input the protocol rejects before it reaches the store (400)."""


# -- parsing and formatting at the HTTP edge ----------------------------------------


def format_offset(position: int) -> str:
    return f"{0:016d}_{position:016d}"


def parse_offset(text: str) -> int:
    match = OFFSET_PATTERN.fullmatch(text)
    if match is None:
        raise BadRequest(f"malformed offset {text!r}")
    return int(match.group(1))


def parse_start_offset(text: str | None) -> int | None:
    """A read's offset; -1 (or none) is the start: None."""
    return None if text in (None, "-1") else parse_offset(text)


def parse_stream_path(path: str) -> str:
    """Accept only paths that cannot escape the namespace or the data directory."""
    segments = path.split("/")
    if (
        len(path.encode()) > MAX_PATH_BYTES
        or len(segments) > MAX_PATH_DEPTH
        or FORBIDDEN_PATH_CHARACTERS.search(path)
        or any(segment in ("", ".", "..") for segment in segments)
    ):
        raise BadRequest(
            f"invalid stream path: at most {MAX_PATH_BYTES} bytes and {MAX_PATH_DEPTH} segments,"
            " no empty, '.' or '..' segments, no control characters or backslashes"
        )
    return path


def parse_number(name: str, text: str, maximum: int = MAX_SAFE_INTEGER) -> int:
    """The numeric header or query parameter `name` (decimals.py says what passes)."""
    try:
        return parse_decimal(text, maximum)
    except ValueError as error:
        raise BadRequest(f"{name} {error}") from None


def parse_optional_number(name: str) -> int | None:
    text = request.headers.get(name)
    return None if text is None else parse_number(name, text.strip())


def parse_flag(name: str) -> bool:
    """Protocol flags count only when their value is 'true'; anything else is absent."""
    return request.headers.get(name, "").strip().lower() == "true"


def parse_expires_at(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as error:
        raise BadRequest(f"{EXPIRES_AT} must be an RFC 3339 timestamp") from error
    if moment.tzinfo is None:
        raise BadRequest(f"{EXPIRES_AT} must include a time zone")
    return moment


def parse_content_type(content_type: str | None, required: bool) -> str | None:
    """The request's Content-Type header, checked; None when absent and not `required`."""
    if content_type is None or not content_type.strip():
        if required:
            raise BadRequest("Content-Type is required with a body")
        return None
    if CONTENT_TYPE_PATTERN.fullmatch(content_type.strip()) is None:
        raise BadRequest(f"malformed Content-Type {content_type!r}")
    return content_type.strip()


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


def read_up_to(stream: IO[bytes], length: int) -> bytes:
    """`length` bytes, or fewer if the client hangs up first."""
    chunks: list[bytes] = []
    received = 0
    while received < length:
        try:
            chunk = stream.read(length - received)
        except (OSError, ValueError):
            chunk = b""
        if not chunk:
            break
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def parse_json_payload(
    body: bytes, *, allow_empty: bool, max_depth: int, max_messages: int
) -> Payload:
    """One message per top-level array item (one level of flattening), or the value.

    Each message is kept byte for byte as sent: msgspec validates the whole text and
    hands back each item as a view of the body, so no message becomes a Python object
    and is serialised again: 0.2 ms instead of 1.4 ms for a batch of 1,000 messages.
    Numbers stay exact at any width, and whitespace inside a message stays. An array
    of more than `max_messages` items is refused (413) before it is parsed: each item
    costs a view object, and tiny ones cost far more than their bytes.

    Every level of nesting takes a pair of brackets, so a message of n bytes nests at
    most n // 2 deep: a batch of short messages cannot pass the depth limit and skips
    the bracket scan (0.09 ms of a 100 KB batch's 1.1 ms). msgspec itself stops at
    Python's recursion limit, far deeper than ours, so it parses first.
    """
    if not body.isascii():
        try:
            body.decode()  # msgspec does not check the UTF-8 of the items it skips over
        except UnicodeDecodeError as error:
            raise BadRequest("body is not valid UTF-8") from error
    is_array = STARTS_AS_ARRAY.match(body) is not None
    if is_array and len(body) > 2 * max_messages:  # else too short to hold that many
        if json_array_longer_than(body, max_messages, max_depth):
            raise too_many_messages(max_messages)
    try:
        if is_array:
            messages, outer_levels = JSON_ITEMS.decode(body), 1
        else:
            messages, outer_levels = [JSON_VALUE.decode(body)], 0
    except msgspec.DecodeError as error:
        raise BadRequest(f"body is not valid JSON: {error}") from error
    except RecursionError:
        raise too_deep(max_depth) from None
    if len(messages) > max_messages:
        raise too_many_messages(max_messages)
    payload = Payload.from_messages(messages, body if is_array else None)
    deepest_possible = outer_levels + max(payload.message_lengths, default=0) // 2
    if deepest_possible > max_depth and json_nests_deeper_than(body, max_depth):
        raise too_deep(max_depth)
    if not messages and not allow_empty:
        raise BadRequest("an empty JSON array appends nothing")
    return payload


def too_many_messages(max_messages: int) -> RequestEntityTooLarge:
    return RequestEntityTooLarge(f"a JSON append holds at most {max_messages} messages")


def too_deep(max_depth: int) -> BadRequest:
    return BadRequest(f"body is not valid JSON or nests deeper than {max_depth} levels")


def parse_producer(producer_id: str | None, epoch: str | None, seq: str | None) -> Producer | None:
    """The idempotent producer of an append, from its three headers' values (or none)."""
    if producer_id is None and epoch is None and seq is None:
        return None
    if producer_id is None or epoch is None or seq is None:
        raise BadRequest("Producer-Id, Producer-Epoch and Producer-Seq go together")
    if not producer_id.strip():
        raise BadRequest("Producer-Id must not be empty")
    if len(producer_id.encode()) > MAX_PRODUCER_ID_BYTES:
        raise BadRequest(f"Producer-Id is longer than {MAX_PRODUCER_ID_BYTES} bytes")
    return Producer(
        producer_id, parse_number(PRODUCER_EPOCH, epoch), parse_number(PRODUCER_SEQ, seq)
    )


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


def next_cursor(client_cursor: str | None) -> str:
    """The protocol's cache-collapsing cursor: an interval number that never repeats back.

    BadRequest for a client's cursor that is not a number: ours always are.
    """
    interval = current_interval()
    given = None if client_cursor is None else parse_number("cursor", client_cursor)
    if given is not None and given >= interval:
        jitter_seconds = random.randint(1, 3600)
        interval = given + max(1, jitter_seconds // CURSOR_INTERVAL_SECONDS)
    return str(interval)


def current_interval() -> int:
    return int((time.time() - CURSOR_EPOCH) // CURSOR_INTERVAL_SECONDS)


def advanced_cursor(cursor: str) -> str:
    """An SSE connection's cursor, moved on only once the clock's interval passes it."""
    interval = current_interval()
    return cursor if int(cursor) >= interval else str(interval)


def etag_of(result: ReadResult) -> str:
    closed = ":c" if result.info.closed and result.end == result.info.tail else ""
    return f'"{result.info.incarnation}:{result.start}:{result.end}{closed}"'


def stream_headers(info: StreamInfo, tail: int | None = None) -> dict[str, str]:
    """Content-Type, with the policy that keeps a browser from running the body, and
    Stream-Next-Offset, plus Stream-Closed once the reader is at the end."""
    position = info.tail if tail is None else tail
    headers = {
        "Content-Type": info.content_type,
        "Content-Security-Policy": STREAM_BODY_POLICY,
        NEXT_OFFSET: format_offset(position),
    }
    if info.closed and position == info.tail:
        headers[CLOSED] = "true"
    return headers


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    return Response(body, status, headers or {}, mimetype="application/json")


def append_answer(result: AppendResult, produced_data: bool) -> tuple[int, dict[str, str]]:
    """Status and headers of an append that succeeded; 200 only for new producer data."""
    info = result.info
    headers = {NEXT_OFFSET: format_offset(info.tail)}
    if info.closed:
        headers[CLOSED] = "true"
    if result.producer is not None:
        headers[PRODUCER_EPOCH] = str(result.producer.epoch)
        headers[PRODUCER_SEQ] = str(result.producer.seq)
        if result.duplicate:
            del headers[NEXT_OFFSET]
    return (200 if produced_data and not result.duplicate else 204), headers


def empty_body(info: StreamInfo) -> bytes:
    return b"[]" if is_json_type(info.content_type) else b""


# -- the app ----------------------------------------------------------------------


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
    app = StreamApp(__name__)
    app.response_class = Response
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.url_map.merge_slashes = False
    app.url_map.strict_slashes = False
    from auth import register_auth  # here: it builds on this module; first, so it runs first

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
    from subscriptions import register_subscriptions  # here: it builds on this module

    register_subscriptions(app, store, settings)
    from ops import register_operations  # its hooks run after add_common_headers below

    register_operations(app, store, settings)

    @app.after_request
    def add_common_headers(response: Response) -> Response:
        response.headers.update(COMMON_HEADERS)
        return response

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> Response:
        code = (error.name or "error").lower().replace(" ", "_")
        return error_response(error.code or 500, code, error.description or error.name)

    @app.errorhandler(Exception)
    def unexpected_error(error: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal_error", "internal server error")

    from fastpath import FastAppends  # here: it builds on this module

    app.fast_path = FastAppends(views, settings.max_request_bytes, verifier)
    return app


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
        if path.split("/", 1)[0] == RESERVED_PREFIX:
            return error_response(404, "not_found", f"{RESERVED_PREFIX}/ paths are reserved")
        try:
            return handlers[request.method](parse_stream_path(path))
        except BadRequest as error:
            return error_response(400, "bad_request", str(error))
        except StoreError as error:
            return self.store_error(error)
        except StorageUnavailable as error:
            log.warning("storage unavailable: %s", error)
            return error_response(
                503, "storage_unavailable", "storage is unavailable; retry",
                {"Retry-After": RETRY_AFTER_SECONDS},
            )  # fmt: skip

    @staticmethod
    def store_error(error: StoreError) -> Response:
        headers: dict[str, str] = {}
        if isinstance(error, StreamClosed):
            headers = {CLOSED: "true", NEXT_OFFSET: format_offset(error.tail)}
        elif isinstance(error, OffsetTrimmed):
            headers = {EARLIEST_OFFSET: format_offset(error.earliest)}
        elif isinstance(error, ProducerFenced):
            headers = {PRODUCER_EPOCH: str(error.current_epoch)}
        elif isinstance(error, ProducerGap):
            headers = {
                PRODUCER_EXPECTED_SEQ: str(error.expected),
                PRODUCER_RECEIVED_SEQ: str(error.received),
            }
        status = STATUS_OF_ERROR[type(error)]
        code = re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()
        return error_response(status, code, str(error), headers)

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
        if is_json_type(content_type):
            return parse_json_payload(
                body,
                allow_empty=allow_empty,
                max_depth=self.settings.max_json_depth,
                max_messages=self.settings.max_append_messages,
            )
        return Payload(body)

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


def parse_fork_source(text: str) -> str:
    """The suite sends the source as the stream's URL path; accept that or a bare path."""
    source = text.strip()
    if source.startswith(STREAM_PREFIX):
        source = source[len(STREAM_PREFIX) :]
    return parse_stream_path(source)


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
