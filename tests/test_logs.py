"""The access log's direct path: the same line as `logging` writes, and only when equivalent."""

from __future__ import annotations

import io
import json
import logging
import re

from flask import Flask

import logs as logs_module
from logs import AccessLog, JsonFormatter, RequestLog

FIELDS = {"method": "POST", "path": "/v1/stream/a", "query": {}, "status": 204, "request_id": "r1"}
TIME_PATTERN = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def access_log_to(handler: logging.Handler) -> AccessLog:
    """An access log whose logger (outside logging's tree) reaches `handler` alone."""
    logger = logging.Logger("picomq.access")
    logger.addHandler(handler)
    access = AccessLog(logger)
    access.write_directly_if_possible()
    return access


def json_stream_handler() -> tuple[logging.StreamHandler, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    return handler, stream


def test_the_direct_line_is_the_line_logging_writes() -> None:
    handler, stream = json_stream_handler()
    access = access_log_to(handler)
    assert access.direct is handler
    access.log(dict(FIELDS))
    access.direct = None  # the same log, through a LogRecord
    access.log(dict(FIELDS))
    direct, through_logging = (json.loads(line) for line in stream.getvalue().splitlines())
    assert TIME_PATTERN.fullmatch(direct.pop("time"))
    assert TIME_PATTERN.fullmatch(through_logging.pop("time"))
    assert direct == through_logging
    assert list(direct) == list(through_logging)
    assert direct["logger"] == "picomq.access" and direct["status"] == 204


def test_a_filtered_or_other_handler_still_gets_log_records() -> None:
    handler, stream = json_stream_handler()
    seen: list[logging.LogRecord] = []
    handler.addFilter(lambda record: seen.append(record) or True)
    access = access_log_to(handler)
    assert access.direct is None
    access.log(dict(FIELDS))
    assert [record.fields for record in seen] == [FIELDS]
    assert json.loads(stream.getvalue())["path"] == "/v1/stream/a"
    for other in (logging.FileHandler("/dev/null", delay=True), logging.NullHandler()):
        other.setFormatter(JsonFormatter())
        assert access_log_to(other).direct is None
    plain_text, _ = json_stream_handler()
    plain_text.setFormatter(logging.Formatter())
    assert access_log_to(plain_text).direct is None


def test_a_second_handler_anywhere_up_the_tree_means_records() -> None:
    handler, _ = json_stream_handler()
    parent = logging.Logger("picomq")
    parent.addHandler(logging.NullHandler())
    logger = logging.Logger("picomq.access")
    logger.parent = parent
    logger.addHandler(handler)
    access = AccessLog(logger)
    access.write_directly_if_possible()
    assert access.direct is None
    logger.propagate = False
    access.write_directly_if_possible()
    assert access.direct is handler


def test_the_direct_path_keeps_the_level() -> None:
    handler, stream = json_stream_handler()
    access = access_log_to(handler)
    access.logger.setLevel(logging.WARNING)
    access.log(dict(FIELDS))
    assert access.direct is handler and stream.getvalue() == ""


def test_a_failing_stream_is_reported_as_logging_would_and_never_raises() -> None:
    handler, stream = json_stream_handler()
    access = access_log_to(handler)
    failures: list[logging.LogRecord] = []
    handler.handleError = failures.append
    stream.close()  # writing now raises ValueError
    access.log(dict(FIELDS))
    assert [record.getMessage() for record in failures] == ["request"]


# -- the request log middleware ---------------------------------------------------------


class Body(list):
    """A response body that records being closed, and can fail to close."""

    def __init__(self, chunks: list[bytes], fail: bool = False) -> None:
        super().__init__(chunks)
        self.closed, self.fail = False, fail

    def close(self) -> None:
        self.closed = True
        if self.fail:
            raise OSError("the body failed to close")


def serve(body: Body, environ: dict, status: str = "200 OK") -> tuple[list, list[bytes], list]:
    """Call RequestLog around a one-response app; returns headers, chunks and its lines."""
    lines: list[dict] = []
    started: list = []

    def app(environ: dict, start_response) -> Body:  # noqa: ANN001 - WSGI's callable
        start_response(status, [("Content-Type", "text/plain")])
        return body

    original, logs_module.access_log.log = logs_module.access_log.log, lines.append
    try:
        response = RequestLog(app)(environ, lambda status, headers, *_: started.append(headers))
        chunks = list(response)
        assert lines == []  # nothing is logged before the server closes the body
        try:
            response.close()
        except OSError:
            pass
    finally:
        logs_module.access_log.log = original
    return started[0], chunks, lines


def test_the_request_log_adds_an_id_and_logs_the_request_when_closed() -> None:
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/v1/stream/caf\xc3\xa9",  # WSGI's latin-1 view of UTF-8 bytes
        "QUERY_STRING": "offset=-1&live=sse&access_token=secret&offset=5&limit=" + "9" * 300,
        "REMOTE_ADDR": "127.0.0.1",
        "HTTP_X_REQUEST_ID": "caller-id.1",
    }
    body = Body([b"one", b"two"])
    headers, chunks, [line] = serve(body, environ, "206 Partial Content")
    assert ("X-Request-Id", "caller-id.1") in headers
    assert chunks == [b"one", b"two"] and body.closed
    assert line.pop("duration_ms") >= 0
    assert line == {
        "method": "GET",
        "path": "/v1/stream/café",
        "query": {"offset": "-1", "live": "sse", "limit": "9" * 200},
        "status": 206,
        "remote_addr": "127.0.0.1",
        "request_id": "caller-id.1",
    }
    assert environ["picomq.request_id"] == "caller-id.1"


def test_a_forged_id_is_replaced_and_a_failing_close_still_logs() -> None:
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/x", "HTTP_X_REQUEST_ID": 'a"\n{'}
    body = Body([], fail=True)
    headers, _, [line] = serve(body, environ, "500 Internal Server Error")
    [(_, generated)] = [header for header in headers if header[0] == "X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert line["request_id"] == generated and line["status"] == 500 and line["query"] == {}


def test_log_lines_written_during_a_request_carry_its_id() -> None:
    handler, stream = json_stream_handler()
    logger = logging.getLogger("picomq.test")
    app = Flask(__name__)

    @app.get("/work")
    def work() -> str:
        logger.warning("working")
        return "done"

    app.wsgi_app = RequestLog(app.wsgi_app)
    logger.addHandler(handler)
    try:
        response = app.test_client().get("/work", headers={"X-Request-Id": "id-7"})
        logger.warning("outside any request")
    finally:
        logger.removeHandler(handler)
    assert response.headers["X-Request-Id"] == "id-7"
    during, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert during["request_id"] == "id-7" and during["message"] == "working"
    assert "request_id" not in outside
