"""The protocol's vocabulary at PicoMQ's HTTP edge: header names, offsets and cursors,
the `parse_*` / `format_*` pairs, and how a refusal or a store outcome is answered.

Every HTTP module speaks it (picomq.py's views, fastpath.py, auth.py, ops.py,
subscriptions.py, worker.py) and it imports none of them, so each imports it at the top
and no module needs another's insides. Nothing here reads the current request: the
functions take text and bytes and return values, or raise BadRequest (400); the views
read the request and call them.
"""

from __future__ import annotations

import random
import re
import time
from datetime import datetime
from typing import IO

import msgspec
import orjson
from flask import Response as FlaskResponse
from werkzeug.exceptions import RequestEntityTooLarge

from decimals import MAX_SAFE_INTEGER, parse_decimal
from limits import json_array_longer_than, json_nests_deeper_than
from logs import REQUEST_ID_HEADER
from streams import (
    MAX_PRODUCER_ID_BYTES,
    NO_TAIL,
    AppendResult,
    InvalidRequest,
    OffsetTrimmed,
    Payload,
    PreconditionFailed,
    Producer,
    ProducerFenced,
    ProducerGap,
    ReadResult,
    StoreError,
    StreamClosed,
    StreamConflict,
    StreamGone,
    StreamInfo,
    StreamMoved,
    StreamNotFound,
    is_json_type,
)
from wire import error_body

STREAM_PREFIX = "/v1/stream/"
RESERVED_PREFIX = "__ds"  # the first segment of paths the protocol keeps for itself
MAX_PATH_BYTES = 1024
MAX_PATH_DEPTH = 32
DEFAULT_CONTENT_TYPE = "application/octet-stream"
CURSOR_EPOCH = datetime.fromisoformat("2024-10-09T00:00:00+00:00").timestamp()
CURSOR_INTERVAL_SECONDS = 20
RETRY_AFTER_SECONDS = "1"

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
IF_MATCH = "If-Match"

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
QUOTED_OFFSET_PATTERN = re.compile(r'"0{16}_([0-9]{16})"')
CONTENT_TYPE_PATTERN = re.compile(r"[\w.+-]+/[\w.+-]+\s*(;.*)?", re.ASCII)
STARTS_AS_ARRAY = re.compile(rb"[ \t\r\n]*\[")
JSON_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
JSON_VALUE = msgspec.json.Decoder(msgspec.Raw)
FORBIDDEN_PATH_CHARACTERS = re.compile(r"[\x00-\x1f\x7f\\\ufffd]")
CAMEL_CASE_BOUNDARY = re.compile(r"(?<!^)(?=[A-Z])")

# Storage that fails (objectstore.StorageUnavailable) is no store outcome: its 503 is
# storage_unavailable_response.
STATUS_OF_ERROR: dict[type[StoreError], int] = {
    InvalidRequest: 400,
    ProducerFenced: 403,
    StreamNotFound: 404,
    StreamConflict: 409,
    StreamClosed: 409,
    ProducerGap: 409,
    StreamGone: 410,
    OffsetTrimmed: 410,
    PreconditionFailed: 412,
    StreamMoved: 503,
}


class Response(FlaskResponse):
    """No made-up Content-Type on empty answers: 204s and HEADs carry only what we set."""

    default_mimetype = None


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


def parse_if_match(text: str) -> int:
    """The tail a conditional append names: `"<offset>"`, as its ETag gives it.

    Any other value (`*`, a weak or unquoted tag, a list) names no tail, so it fails as
    a stale one does (412), never a 400: pull request #243 of the protocol says so.
    """
    match = QUOTED_OFFSET_PATTERN.fullmatch(text.strip())
    return int(match.group(1)) if match is not None else NO_TAIL


def format_tail_etag(position: int) -> str:
    """The ETag of a stream's tail, what a conditional append names in If-Match."""
    return f'"{format_offset(position)}"'


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


def is_reserved(path: str) -> bool:
    """Whether a stream path lies under `__ds/`, where the protocol's own routes are
    (subscriptions.py): no stream is ever created, read or counted there."""
    return path.split("/", 1)[0] == RESERVED_PREFIX


def subscription_key(subscription_id: str) -> str:
    """The path a subscription is served by, as a stream is by its own (members.py): the
    member that serves this path's partition holds the subscription's wakes."""
    return f"{RESERVED_PREFIX}/subscriptions/{subscription_id}"


def reserved_route_key(path: str) -> str | None:
    """The path whose server answers a request under `__ds/`: a subscription's key for
    its routes, None for those any member answers alike (jwks.json, unknown routes)."""
    parts = path.split("/", 3)
    if len(parts) >= 3 and parts[1] == "subscriptions" and parts[2]:
        return subscription_key(parts[2])
    return None


def parse_fork_source(text: str) -> str:
    """The suite sends the source as the stream's URL path; accept that or a bare path."""
    source = text.strip()
    if source.startswith(STREAM_PREFIX):
        source = source[len(STREAM_PREFIX) :]
    return parse_stream_path(source)


def parse_number(name: str, text: str, maximum: int = MAX_SAFE_INTEGER) -> int:
    """The numeric header or query parameter `name` (decimals.py says what passes)."""
    try:
        return parse_decimal(text, maximum)
    except ValueError as error:
        raise BadRequest(f"{name} {error}") from None


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


def parse_payload(
    content_type: str, body: bytes, *, allow_empty: bool, max_depth: int, max_messages: int
) -> Payload:
    """An append's body as messages: one per JSON message in a JSON stream, else one."""
    if is_json_type(content_type):
        return parse_json_payload(
            body, allow_empty=allow_empty, max_depth=max_depth, max_messages=max_messages
        )
    return Payload(body)


def parse_json_payload(
    body: bytes, *, allow_empty: bool, max_depth: int, max_messages: int
) -> Payload:
    """One message per top-level array item (one level of flattening), or the value.

    Each message is kept byte for byte as sent: msgspec validates the whole text and
    hands back each item as a view of the body, so no message becomes a Python object
    and is serialised again (figures: bench/README.md). Numbers stay exact at any
    width, and whitespace inside a message stays. An array of more than `max_messages`
    items is refused (413) before it is parsed: each item costs a view object, and tiny
    ones cost far more than their bytes.

    Every level of nesting takes a pair of brackets, so a message of n bytes nests at
    most n // 2 deep: a batch of short messages cannot pass the depth limit and skips
    the bracket scan. msgspec itself stops at Python's recursion limit, far deeper than
    ours, so it parses first.
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
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    details: dict[str, object] | None = None,
) -> Response:
    body = error_body(code, message, details)
    return Response(body, status, headers or {}, mimetype="application/json")


def storage_unavailable_response() -> Response:
    """503, for as long as storage fails in a way a retry may cure."""
    return error_response(
        503,
        "storage_unavailable",
        "storage is unavailable; retry",
        {"Retry-After": RETRY_AFTER_SECONDS},
    )


def json_response(
    body: object, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """`body` as JSON; `headers` may name another Content-Type."""
    return Response(
        orjson.dumps(body), status, {"Content-Type": "application/json"} | (headers or {})
    )


def append_answer(
    result: AppendResult, produced_data: bool, conditional: bool = False
) -> tuple[int, dict[str, str]]:
    """Status and headers of an append that succeeded; 200 only for new producer data.

    A `conditional` one (If-Match) also gets the new tail's ETag, for the next one to
    name; other appends answer as the protocol without conditions does."""
    info = result.info
    headers = {NEXT_OFFSET: format_offset(info.tail)}
    if info.closed:
        headers[CLOSED] = "true"
    if conditional:
        headers["ETag"] = format_tail_etag(info.tail)
    if result.producer is not None:
        headers[PRODUCER_EPOCH] = str(result.producer.epoch)
        headers[PRODUCER_SEQ] = str(result.producer.seq)
        if result.duplicate:
            del headers[NEXT_OFFSET]
    return (200 if produced_data and not result.duplicate else 204), headers


def empty_body(info: StreamInfo) -> bytes:
    return b"[]" if is_json_type(info.content_type) else b""


def store_error_response(error: StoreError) -> Response:
    """A store outcome as its status (`STATUS_OF_ERROR`), with the headers that say more."""
    headers: dict[str, str] = {}
    if isinstance(error, StreamClosed):
        headers = {CLOSED: "true", NEXT_OFFSET: format_offset(error.tail)}
    elif isinstance(error, PreconditionFailed):
        headers = {"ETag": format_tail_etag(error.tail), NEXT_OFFSET: format_offset(error.tail)}
        if error.closed:
            headers[CLOSED] = "true"
    elif isinstance(error, OffsetTrimmed):
        headers = {EARLIEST_OFFSET: format_offset(error.earliest)}
    elif isinstance(error, ProducerFenced):
        headers = {PRODUCER_EPOCH: str(error.current_epoch)}
    elif isinstance(error, ProducerGap):
        headers = {
            PRODUCER_EXPECTED_SEQ: str(error.expected),
            PRODUCER_RECEIVED_SEQ: str(error.received),
        }
    elif isinstance(error, StreamMoved):
        headers = {"Retry-After": RETRY_AFTER_SECONDS}
    status = STATUS_OF_ERROR[type(error)]
    return error_response(status, "_".join(words_of(type(error))), str(error), headers)


def words_of(error_class: type[Exception]) -> list[str]:
    """The words of an exception's CamelCase name: `ProducerGap` is `producer gap`."""
    return CAMEL_CASE_BOUNDARY.sub(" ", error_class.__name__).lower().split()
