"""Plain appends, answered before Flask's request machinery starts.

Most requests a stream server takes are plain appends: a POST to a stream with a body
of declared length and a Content-Type, from an idempotent producer or not; no query, no
Stream-Closed, Stream-Seq or If-Match header; and, when tokens are checked, a token that
grants the append. Through Flask, such an append paid more for Flask's request machinery
than for the append itself (bench/ceiling.py; figures: bench/README.md). So they are
served here, from the WSGI environ, through the calls the view makes, with the status,
headers, metrics and access line that the view and the request hooks give.

This is an accelerator: the reference is the stream view (picomq.py's
`StreamViews.append`), which answers every append, on any WSGI server, and this path
must answer as it does. tests/test_fastpath.py holds the two equal in process (each
append through `app`, which offers it here first, and through `app.wsgi_app`, Flask
alone: status, headers, metrics and access line), and tests/test_worker.py's
`test_a_fast_append_is_answered_with_the_bytes_flask_s_answer_has` over HTTP, byte
for byte.

Everything else is Flask's, and so is every refusal:
- a request that is not a plain append goes to Flask untouched (so does one whose token
  is missing, invalid or short of the grant: auth.py refuses it, counts and logs it);
- one this path gives up on before the store call (a bad path, type or body, or any
  other exception) goes to Flask with its body, already read, put back: the view
  parses it again and answers;
- when the store call itself fails, the data may have been written, so the append is
  not made again: the view is handed the failure and raises it (`FAST_APPEND_FAILURE`).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from werkzeug.http import HTTP_STATUS_CODES

from auth import PRIVATE_ANSWER_HEADERS, Verifier, bearer_credentials
from decimals import parse_decimal
from logs import REQUEST_ID_HEADER, log_request, request_id_from
from metrics import count_append, get_metrics
from protocol import (
    CLOSED,
    COMMON_HEADERS,
    FAST_APPEND_FAILURE,
    IF_MATCH,
    PRODUCER_HEADERS,
    STREAM_PREFIX,
    STREAM_SEQ,
    BadRequest,
    append_answer,
    is_reserved,
    parse_content_type,
    parse_payload,
    parse_producer,
    parse_stream_path,
    read_up_to,
)
from settings import Settings
from storage import StreamStore
from streams import AppendRequest, AppendResult
from wire import DIRECT_WRITER_ENVIRON_KEY


class AnswerWriter(Protocol):
    """The connection, as the server offers it in the environ (worker.py)."""

    def send_whole_answer(self, status: str, fields: bytes) -> None:
        """Send a bodiless answer: its status, then `fields`, whole header lines."""


def header_lines(fields: list[tuple[str, str]]) -> bytes:
    """The fields as whole header lines, refused if a value would break its line.

    Every value a plain append's answer carries is an offset, a number, fixed text or
    a request id matched by its pattern; the check keeps it so (no header injection)
    where pywsgi's start_response, which would check each field, is not called.
    """
    lines = "".join(f"{name}: {value}\r\n" for name, value in fields)
    if lines.count("\r") != len(fields) or lines.count("\n") != len(fields):
        raise ValueError("carriage return or line feed inside a header field")
    return lines.encode()


def environ_key(header: str) -> str:
    return "HTTP_" + header.upper().replace("-", "_")


# Headers that make an append more than plain: the view handles them.
NOT_PLAIN = tuple(map(environ_key, (CLOSED, STREAM_SEQ, IF_MATCH, "Transfer-Encoding")))
PRODUCER_KEYS = tuple(map(environ_key, PRODUCER_HEADERS))


class FastAppends:
    """The WSGI answer to plain appends; None for every request Flask must serve."""

    def __init__(self, store: StreamStore, settings: Settings, verifier: Verifier | None) -> None:
        """`verifier`: the tokens' checker when tokens are checked, else None."""
        self.store = store
        self.max_body_bytes = settings.max_request_bytes
        self.max_json_depth = settings.max_json_depth
        self.max_append_messages = settings.max_append_messages
        self.verifier = verifier
        # Headers after the request id: a token-checked answer is private, as in Flask.
        self.closing_headers = PRIVATE_ANSWER_HEADERS if verifier is not None else ()
        self.metrics = get_metrics()

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes] | None:
        path = self.plain_append_path(environ)
        if path is None or not self.grants_append(environ, path):
            return None
        started = time.perf_counter()
        length = int(environ["CONTENT_LENGTH"])
        body = read_up_to(environ["wsgi.input"], length)
        try:
            if len(body) < length:
                raise BadRequest("the body ended early")  # the view words the answer
            content_type = parse_content_type(environ.get("CONTENT_TYPE"), required=True)
            payload = parse_payload(
                content_type,
                body,
                allow_empty=False,
                max_depth=self.max_json_depth,
                max_messages=self.max_append_messages,
            )
            producer = parse_producer(*map(environ.get, PRODUCER_KEYS))
        except Exception:  # noqa: BLE001 - the view meets it again, and answers as always
            environ["wsgi.input"] = io.BytesIO(body)
            return None
        try:
            result = self.store.append(
                path, AppendRequest(content_type, payload, False, producer, None)
            )
        except Exception as error:  # noqa: BLE001 - the view raises it as its own
            environ[FAST_APPEND_FAILURE] = error
            return None
        produced = producer is not None
        self.answer(environ, start_response, result, produced, content_type, length, started)
        return []

    def answer(
        self,
        environ: dict,
        start_response: Callable,
        result: AppendResult,
        produced: bool,
        content_type: str,
        body_bytes: int,
        started: float,
    ) -> None:
        """What the view and the request hooks do once an append has succeeded."""
        status, headers = append_answer(result, produced_data=produced)
        request_id = request_id_from(environ.get("HTTP_X_REQUEST_ID"))
        status_line = f"{status} {HTTP_STATUS_CODES[status].upper()}"  # as werkzeug words it
        fields = [
            *headers.items(),
            *COMMON_HEADERS,
            (REQUEST_ID_HEADER, request_id),
            *self.closing_headers,
            # As werkzeug sends an empty body: no length on a 204, "0" on a 200.
            *(() if status == 204 else (("Content-Length", "0"),)),
        ]
        count_append(self.metrics, content_type, body_bytes)
        remote_addr = environ.get("REMOTE_ADDR")
        log_request("POST", environ["PATH_INFO"], {}, status, remote_addr, started, request_id)
        # The answer goes last. Sent before the two calls above, it made S3's group
        # commits smaller and one stream's appends slower (measured, not explained:
        # bench/README.md).
        writer: AnswerWriter | None = environ.get(DIRECT_WRITER_ENVIRON_KEY)
        if writer is None:  # another WSGI server
            start_response(status_line, fields)
        else:
            writer.send_whole_answer(status_line, header_lines(fields))

    def grants_append(self, environ: dict, path: str) -> bool:
        """True when no token is needed, or the request's bearer token grants the append."""
        if self.verifier is None:
            return True
        token = bearer_credentials(environ.get("HTTP_AUTHORIZATION", ""))
        return bool(token) and self.verifier.allows(token, "append", path)

    def plain_append_path(self, environ: dict) -> str | None:
        """The stream path of a plain append; None for any other request."""
        if environ["REQUEST_METHOD"] != "POST" or environ.get("QUERY_STRING"):
            return None
        path_info = environ.get("PATH_INFO", "")
        if not (path_info.startswith(STREAM_PREFIX) and path_info.isascii()):
            return None  # werkzeug decodes a path of other characters its own way
        try:
            if parse_decimal(environ.get("CONTENT_LENGTH", ""), self.max_body_bytes) == 0:
                return None
        except ValueError:
            return None
        if not environ.keys().isdisjoint(NOT_PLAIN):
            return None
        path = path_info[len(STREAM_PREFIX) :]
        if is_reserved(path):
            return None
        try:
            return parse_stream_path(path)
        except BadRequest:
            return None
