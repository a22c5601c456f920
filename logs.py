"""Structured logs: one JSON object per line, and a request id on every response.

A request is logged once, when its response is closed (so an SSE line carries its
whole duration): method, path, the read parameters of the query, status, duration,
remote address and request id. Never headers, other query parameters, tokens or
bodies: credentials may travel in any of those.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

import orjson
from flask import has_request_context, request

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_ENVIRON = "HTTP_X_REQUEST_ID"  # the caller's, as the WSGI environ names it
REQUEST_ID_KEY = "picomq.request_id"  # ours, for every log line written while it runs
# A caller's id is kept only if it cannot forge log lines or headers; else we make one.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
LOGGED_QUERY_PARAMETERS = ("offset", "live", "prefix", "after", "limit")
MAX_LOGGED_VALUE_CHARS = 200

ACCESS_MESSAGE = "request"


def log_entry(created: float, level: str, logger: str, message: str) -> dict[str, object]:
    """The fields every JSON line starts with."""
    moment = datetime.fromtimestamp(created, UTC)
    return {
        "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": level,
        "logger": logger,
        "message": message,
        "pid": os.getpid(),
    }


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", "pid", "request_id", ...fields}`, one line."""

    def format(self, record: logging.LogRecord) -> str:
        level, message = record.levelname.lower(), record.getMessage()
        entry = log_entry(record.created, level, record.name, message)
        if has_request_context() and REQUEST_ID_KEY in request.environ:
            entry["request_id"] = request.environ[REQUEST_ID_KEY]
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class AccessLog:
    """The access log: one line per request, the line PicoMQ writes most often.

    Through `logging`, each line costs a LogRecord and a walk through loggers, a lock,
    a handler and a formatter: 55 µs of the 465 µs a single append costs the server
    (bench/compare.py's appends-1 load on PicoMQ alone: 2,170 appends/s, 2,450 with
    the line not written). When logging is set up as PicoMQ sets it up, JSON to one
    stream and nothing else listening, the line is rendered here and written to that
    handler's stream under its lock: the same bytes, for a third of the cost. Any other
    setup (a handler of another kind, a filter, a test's capture) gets LogRecords.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.direct: logging.StreamHandler | None = None  # where lines go without a record

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
        entry = log_entry(time.time(), "info", self.logger.name, ACCESS_MESSAGE)
        entry.update(fields)
        line = orjson.dumps(entry, default=str).decode() + handler.terminator
        handler.acquire()
        try:
            handler.stream.write(line)
            handler.flush()
        except Exception:  # as a handler would: report a failing stream, never raise
            record = self.logger.makeRecord(
                self.logger.name, logging.INFO, __file__, 0, ACCESS_MESSAGE, (), None
            )
            handler.handleError(record)
        finally:
            handler.release()


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
    access_log.write_directly_if_possible()


def request_id_of(given: str | None) -> str:
    if given is not None and REQUEST_ID_PATTERN.fullmatch(given):
        return given
    return os.urandom(16).hex()  # as unique as a uuid4, a tenth of the cost


class RequestLog:
    """WSGI middleware: a request id on every response, one access line per request.

    It reads the WSGI environ and adds to the header list. Done in Flask's hooks,
    through werkzeug's request proxies and Headers, the id and the line took 37 µs of
    the 188 µs of CPU a single append costs (the app called in process, 64 at a
    time); done here, the append costs 165 µs. It wraps everything else, so even a
    request that auth turns away has its id and its line. The line is written when the
    server closes the body, so an SSE line carries the stream's whole duration.
    """

    def __init__(self, app: WSGIApplication) -> None:
        self.app = app

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> LoggedBody:
        request_id = request_id_of(environ.get(REQUEST_ID_ENVIRON))
        environ[REQUEST_ID_KEY] = request_id
        logged = LoggedBody(environ, request_id)

        def start_with_id(status: str, headers: list[tuple[str, str]], *exc_info: object) -> object:
            logged.status = status
            headers.append((REQUEST_ID_HEADER, request_id))
            return start_response(status, headers, *exc_info)

        logged.body = self.app(environ, start_with_id)
        return logged


class LoggedBody:
    """A response body that logs its request when the server closes it.

    Iterating it iterates the app's body itself, so each chunk of a long read or an
    SSE stream costs no extra call.
    """

    __slots__ = ("body", "environ", "request_id", "started", "status")

    def __init__(self, environ: WSGIEnvironment, request_id: str) -> None:
        self.environ, self.request_id = environ, request_id
        self.started = time.perf_counter()
        self.body: Iterable[bytes] = ()
        self.status = ""

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            access_log.log(self.fields())

    def fields(self) -> dict[str, object]:
        environ = self.environ
        path = environ.get("PATH_INFO", "").encode("latin-1").decode(errors="replace")
        return {
            "method": environ.get("REQUEST_METHOD", ""),
            "path": "/" + path.lstrip("/"),  # as Flask's request.path; gunicorn caps its length
            "query": logged_query(environ.get("QUERY_STRING", "")),
            "status": int(self.status[:3] or 0),
            "duration_ms": round((time.perf_counter() - self.started) * 1000, 3),
            "remote_addr": environ.get("REMOTE_ADDR"),
            "request_id": self.request_id,
        }


def logged_query(query_string: str) -> dict[str, str]:
    """The read parameters of a query, each value's first occurrence, cut short."""
    query: dict[str, str] = {}
    if query_string:
        for name, value in parse_qsl(query_string, keep_blank_values=True):
            if name in LOGGED_QUERY_PARAMETERS and name not in query:
                query[name] = value[:MAX_LOGGED_VALUE_CHARS]
    return query
