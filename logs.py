"""Structured logs: one JSON object per line, and a request id on every response.

A request is logged once, when its response is closed (so an SSE line carries its
whole duration; a plain append, answered by fastpath.py, when its answer is ready):
method, path, the read parameters of the query, status, duration, remote address and
request id. Never headers, other query parameters, tokens or bodies: credentials may
travel in any of those.

Paths and query values are what clients percent-encoded, a line feed or an escape
sequence included. JSON lines escape them as JSON does; plain text lines
(`PICOMQ_LOG_FORMAT=text`) escape every control character, so no request can end a
line or write one that looks like the server's.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import select
import sys
import time
from collections.abc import Callable, Iterator

import orjson
from flask import Response, g, has_request_context, request

REQUEST_ID_HEADER = "X-Request-Id"
# A caller's id is kept only if it cannot forge log lines or headers; else we make one.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
LOGGED_QUERY_PARAMETERS = ("offset", "live", "prefix", "after", "limit")
MAX_LOGGED_VALUE_CHARS = 200

ACCESS_MESSAGE = "request"
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# A field value shown as it is; any other is shown as a JSON string.
PLAIN_VALUE = re.compile(r'[^\s"=\\]+')
TRACEBACK_INDENT = "    "


def log_entry(
    created: float, level: str, logger: str, message: str, pid: int | None
) -> dict[str, object]:
    """The fields every JSON line starts with."""
    return {
        "time": utc_time(created),
        "level": level,
        "logger": logger,
        "message": message,
        "pid": pid,
    }


def utc_time(created: float) -> str:
    """ISO 8601 in UTC to the millisecond, `2026-12-03T11:35:33.832Z`.

    The second is formatted once: through datetime, formatting every line's time showed
    in a single append's profile (figures: bench/README.md)."""
    second = int(created)
    carry, microsecond = divmod(round((created - second) * 1_000_000), 1_000_000)
    second += carry  # datetime rounds to the microsecond first, and so do we
    return f"{_utc_second(second)}.{microsecond // 1000:03d}Z"


@functools.lru_cache(maxsize=2)
def _utc_second(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", "pid", "request_id", ...fields}`, one line."""

    def format(self, record: logging.LogRecord) -> str:
        level, message = record.levelname.lower(), record.getMessage()
        entry = log_entry(record.created, level, record.name, message, record.process)
        if has_request_context() and "request_id" in g:
            entry["request_id"] = g.request_id
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """A handler's own plain lines, with nothing a request sent able to break them.

    The line (`inner`'s format of the message) and the record's fields, appended as
    `name=value` (a dict's items as `name.key=value`), have their control characters
    escaped; an exception's or a stack's lines are escaped and indented, so every line
    that starts at the margin is one the server began.
    """

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        plain = record
        if record.exc_info or record.exc_text or record.stack_info:
            cleared = {"exc_info": None, "exc_text": None, "stack_info": None}
            plain = logging.makeLogRecord(record.__dict__ | cleared)
        line = self.inner.format(plain)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + format_fields(fields)
        parts = [escape_control_characters(line)]
        if record.exc_info:
            parts.append(indent(self.inner.formatException(record.exc_info)))
        if record.stack_info:
            parts.append(indent(self.inner.formatStack(record.stack_info)))
        return "\n".join(parts)


def format_fields(fields: dict[str, object], prefix: str = "") -> str:
    """`name=value` pairs, a dict's items as `name.key=value`; a value that is empty or
    holds a space, quote, `=` or backslash as a JSON string, so none reads as two."""
    pairs = []
    for name, value in fields.items():
        if isinstance(value, dict):
            pairs.append(format_fields(value, f"{prefix}{name}."))
            continue
        text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
        if PLAIN_VALUE.fullmatch(text) is None:
            text = orjson.dumps(text).decode()
        pairs.append(f"{prefix}{name}={text}")
    return " ".join(filter(None, pairs))


def escape_control_characters(text: str) -> str:
    """`\\n`, `\\r`, `\\t`, or `\\xHH` / `\\uHHHH`, for each control character."""
    return CONTROL_CHARACTER.sub(visible_escape, text)


def visible_escape(match: re.Match[str]) -> str:
    character = match.group()
    short = SHORT_ESCAPES.get(character)
    if short is not None:
        return short
    code = ord(character)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def indent(text: str) -> str:
    """Every line escaped and indented: a traceback may quote a request's text."""
    lines = text.split("\n")
    return "\n".join(TRACEBACK_INDENT + escape_control_characters(line) for line in lines)


class AccessLog:
    """The access log: one line per request, the line PicoMQ writes most often.

    Through `logging`, each line costs a LogRecord and a walk through loggers, a lock,
    a handler and a formatter: a tenth of what a single append costs the server. When
    logging is set up as PicoMQ sets it up, JSON to one stream and nothing else
    listening, the line is rendered here and written to that handler's stream under its
    lock: the same line for about half the cost. Any other setup (a handler of another
    kind, a filter, a test's capture) gets LogRecords.

    Under the gevent worker, which sets `defer` (gunicorn.conf.py), the lines of one
    turn of the event loop are written together when the turn ends, in as few writes
    as keep each whole (at most PIPE_BUF bytes, which a pipe never splits between
    workers). Written one by one, each under the handler's lock and flushed, they cost
    one stream's appends nearly twice what they cost written together (figures:
    bench/README.md).
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.direct: logging.StreamHandler | None = None  # where lines go without a record
        self.defer: Callable[[Callable[[], None]], object] | None = None
        self.pending: list[str] = []  # lines of this turn, not yet written

    def write_directly_if_possible(self) -> None:
        """Call once logging is set up: choose the direct path if it is equivalent."""
        self.direct = sole_json_stream_handler(self.logger)

    def log(self, fields: dict[str, object]) -> None:
        handler = self.direct
        if handler is None:
            self.logger.info(ACCESS_MESSAGE, extra={"fields": fields})
            return
        if not self.logger.isEnabledFor(logging.INFO):
            return
        entry = log_entry(time.time(), "info", self.logger.name, ACCESS_MESSAGE, os.getpid())
        entry.update(fields)
        self.pending.append(orjson.dumps(entry, default=str).decode() + handler.terminator)
        if self.defer is None:
            self.write_pending()
        elif len(self.pending) == 1:  # the turn's first line: write them all when it ends
            self.defer(self.write_pending)

    def write_pending(self) -> None:
        """Write the lines logged since the last call, whole lines to each write."""
        lines, self.pending = self.pending, []
        handler = self.direct
        if not lines or handler is None:
            return
        handler.acquire()
        try:
            for chunk in whole_line_chunks(lines, select.PIPE_BUF):
                handler.stream.write(chunk)
                handler.stream.flush()
        except Exception:  # as a handler would: report a failing stream, never raise
            record = self.logger.makeRecord(
                self.logger.name, logging.INFO, __file__, 0, ACCESS_MESSAGE, (), None
            )
            handler.handleError(record)
        finally:
            handler.release()


def whole_line_chunks(lines: list[str], most: int) -> Iterator[str]:
    """`lines` joined into pieces of at most `most` bytes in UTF-8; a longer line alone."""
    chunk: list[str] = []
    size = 0
    for line in lines:
        length = len(line) if line.isascii() else len(line.encode())
        if chunk and size + length > most:
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += length
    if chunk:
        yield "".join(chunk)


def sole_json_stream_handler(logger: logging.Logger) -> logging.StreamHandler | None:
    """The one handler `logger`'s INFO records reach, if a plain JSON stream handler."""
    if logger.filters:
        return None
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        handlers += current.handlers
        current = current.parent if current.propagate else None
    if len(handlers) != 1:
        return None
    [handler] = handlers
    plain = type(handler) is logging.StreamHandler and not handler.filters
    json = isinstance(handler.formatter, JsonFormatter)
    return handler if plain and json and handler.level <= logging.INFO else None


access_log = AccessLog(logging.getLogger("picomq.access"))


def use_json_logs() -> None:
    """Every handler of the root and gunicorn loggers writes JSON from now on.

    The access log writes a line per request, so what no line prints is not gathered
    either: the caller's file and line (a stack walk per record), thread and process
    names (the logging HOWTO's "Optimization" switches). The pid stays: lines carry it.
    """
    logging._srcfile = None  # noqa: SLF001 - the documented switch for caller lookup
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging.logAsyncioTasks = False
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
        root.setLevel(logging.INFO)
    for name in ("", "gunicorn.error"):
        for handler in logging.getLogger(name).handlers:
            handler.setFormatter(JsonFormatter())
    escape_plain_lines("gunicorn.access")  # gunicorn's own access log, if turned on
    access_log.write_directly_if_possible()


def use_text_logs() -> None:
    escape_plain_lines("", "gunicorn.error", "gunicorn.access")


def escape_plain_lines(*logger_names: str) -> None:
    """Every handler of these loggers keeps its format, with what a request put in a
    line escaped (TextFormatter)."""
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if not isinstance(handler.formatter, TextFormatter):
                handler.setFormatter(TextFormatter(handler.formatter))


def request_id_from(given: str | None) -> str:
    """The caller's X-Request-Id if it is sane, else a new one."""
    if given is not None and REQUEST_ID_PATTERN.fullmatch(given):
        return given
    # Unique, not secret: `random` is seeded from the OS and reseeded in each forked
    # worker, and draws without os.urandom's system call (one per request).
    return f"{random.getrandbits(128):032x}"


def log_request(
    method: str,
    path: str,  # gunicorn caps the request line at 4094 bytes
    query: dict[str, str],
    status: int,
    remote_addr: str | None,
    started: float,
    request_id: str,
) -> None:
    """The access line of one request, `started` at that `time.perf_counter()`."""
    access_log.log(
        {
            "method": method,
            "path": path,
            "query": query,
            "status": status,
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
            "remote_addr": remote_addr,
            "request_id": request_id,
        }
    )


def start_request() -> None:
    """Before the view: the request's id (the caller's, if sane) and its start time."""
    g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    g.request_started = time.perf_counter()


def echo_and_log(response: Response) -> None:
    """After the view: echo the id, and log the request once its response closes."""
    if "request_id" not in g:  # an earlier hook (auth) answered before ours ran
        start_request()
    request_id, started = g.request_id, g.request_started
    response.headers[REQUEST_ID_HEADER] = request_id
    arguments = request.args
    query = {
        name: arguments[name][:MAX_LOGGED_VALUE_CHARS]
        for name in LOGGED_QUERY_PARAMETERS
        if name in arguments
    }
    # On close, when the request context may be gone: what the line needs, taken now.
    line = (request.method, request.path, query, response.status_code, request.remote_addr)
    response.call_on_close(functools.partial(log_request, *line, started, request_id))
