"""The access log's direct path: the same line as `logging` writes, and only when equivalent."""

from __future__ import annotations

import io
import json
import logging
import re
import select
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests
from conftest import whole_lines

from auth import mint_token
from logs import AccessLog, JsonFormatter, utc_time

if TYPE_CHECKING:
    from conftest import StartServer

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


class RecordedWrites(io.StringIO):
    """A stream that keeps each write apart, as each is one write(2) on a real one."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_the_lines_of_a_turn_are_written_when_it_ends_in_whole_line_pieces() -> None:
    """Under the gevent worker a turn's lines go out together; no write is longer than a
    pipe keeps whole (PIPE_BUF), none cuts a line, and a line too long goes alone."""
    stream = RecordedWrites()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    access = access_log_to(handler)
    turn_ends: list[Callable[[], None]] = []
    access.defer = turn_ends.append
    paths = [f"/v1/stream/{'p' * (number * 40)}" for number in range(60)]
    paths.insert(30, "/v1/stream/" + "x" * select.PIPE_BUF)
    paths.insert(10, "/v1/stream/" + "é" * 1500)  # 3,000 bytes in 1,500 characters
    for path in paths:
        access.log({**FIELDS, "path": path})
    assert stream.getvalue() == "" and len(turn_ends) == 1
    turn_ends.pop()()
    lines = stream.getvalue().splitlines()
    assert [json.loads(line)["path"] for line in lines] == paths
    assert 2 < len(stream.writes) < len(paths)
    long_line = next(write for write in stream.writes if "x" * select.PIPE_BUF in write)
    assert long_line.count("\n") == 1
    for write in stream.writes:
        assert write.endswith("\n")
        assert len(write.encode()) <= select.PIPE_BUF or write == long_line
    access.log(dict(FIELDS))  # the next turn's first line asks for the turn's end again
    assert len(turn_ends) == 1


def test_a_failing_stream_is_reported_as_logging_would_and_never_raises() -> None:
    handler, stream = json_stream_handler()
    access = access_log_to(handler)
    failures: list[logging.LogRecord] = []
    handler.handleError = failures.append
    stream.close()  # writing now raises ValueError
    access.log(dict(FIELDS))
    assert [record.getMessage() for record in failures] == ["request"]


@pytest.mark.parametrize(
    "fraction", [0.0, 0.0004994, 0.0005, 0.5309994, 0.9994999, 0.9995, 0.9999996]
)
def test_line_times_are_datetime_s_rendering(fraction: float) -> None:
    for second in (0, 1_796_892_552, 1_798_761_599):  # the epoch, a day, the last of a year
        created = second + fraction
        rendered = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
        assert utc_time(created) == rendered.replace("+00:00", "Z")


FORGED = "1999-12-31 23:59:59,999 INFO picomq.access: forged"


def test_text_logs_keep_what_a_request_sent_inside_one_line(start_server: StartServer) -> None:
    """A path or query value with an encoded line feed, carriage return or escape
    sequence, logged by the access line and by the token check's refusal: each shows
    as an escape inside a line the server began, and no line starts with the forgery."""
    secret = "log-test-secret-of-at-least-32-bytes"
    server = start_server(env={"PICOMQ_LOG_FORMAT": "text", "PICOMQ_JWT_SECRET": secret})
    token = {"Authorization": f"Bearer {mint_token(secret, 'HS256', 'read:**', 60)}"}
    for separator in ("%0A", "%0D", "%0D%0A", "%E2%80%A8", "%1B[2K%0D"):
        forged = f"{separator}{requests.utils.quote(FORGED)}"
        assert requests.get(f"{server.url}/v1/stream/a{forged}").status_code in (401, 404)
        read = requests.get(f"{server.url}/v1/stream/a?offset={forged}", headers=token)
        assert read.status_code in (400, 404)
    # The workers write their lines as the responses close: wait for the last one.
    deadline = time.monotonic() + 10
    while server.output().count("forged") < 15 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = server.output().splitlines()
    with_forgery = [line for line in lines if "forged" in line]
    assert len(with_forgery) >= 15, with_forgery  # refusals and access lines, all five
    for line in with_forgery:
        assert not line.startswith(FORGED[:4]), line
        assert not re.search("[\x00-\x1f\x7f-\x9f\u2028\u2029]", line), line
    assert any("method=GET path=" in line for line in with_forgery), with_forgery


def test_gunicorns_own_access_log_keeps_a_decoded_path_inside_one_line(
    start_server: StartServer, tmp_path: Path
) -> None:
    """An operator may turn gunicorn's access log on; its %(U)s is the decoded path."""
    access_log = tmp_path / "gunicorn-access.log"
    arguments = f"--access-logfile {access_log} --access-logformat '%(m)s %(U)s %(s)s'"
    server = start_server(env={"GUNICORN_CMD_ARGS": arguments})
    forged = f"%0A{requests.utils.quote(FORGED)}"
    assert requests.get(f"{server.url}/v1/stream/a{forged}").status_code == 404
    deadline = time.monotonic() + 10
    with_forgery: list[str] = []
    while not with_forgery and time.monotonic() < deadline:
        time.sleep(0.05)
        with_forgery = [line for line in whole_lines(access_log) if "forged" in line]
    assert with_forgery == [f"GET /v1/stream/a\\n{FORGED} 404"], with_forgery
