"""The append fast path (fastpath.py): which requests it answers, and that it answers as Flask.

In process, on a real store on local disk: the app as gunicorn calls it (`app`, which
offers each request to the fast path first) against the same app with the fast path
skipped (`app.wsgi_app`, Flask alone). Behaviour over HTTP is covered by the other
tests, which run against gunicorn and send their plain appends through this path.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from flask import Flask
from werkzeug.test import Client

import fastpath
from auth import mint_token
from fastpath import header_lines
from metrics import get_metrics
from objectstore import StorageUnavailable
from picomq import create_app
from settings import Settings

JSON = {"Content-Type": "application/json"}
SECRET = "s" * 32
# Headers that differ between any two appends.
PER_REQUEST = {"x-request-id", "stream-next-offset"}

WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


def app_with_stream_s(tmp_path: Path, **environment: str) -> Flask:
    """PicoMQ's app on local disk under `tmp_path`, with the JSON stream `s`."""
    settings = Settings.from_environment(
        {"PICOMQ_STORAGE_URL": str(tmp_path / "data"), "PICOMQ_LOG_FORMAT": "text"} | environment
    )
    app = create_app(settings)
    creator = bearer("create:s read:s") if "PICOMQ_JWT_SECRET" in environment else {}
    assert Client(app).put("/v1/stream/s", headers=JSON | creator).status_code == 201
    return app


def bearer(scope: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {mint_token(SECRET, 'HS256', scope, 600)}"}


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Flask]:
    yield app_with_stream_s(tmp_path)


def answers_of_fast_path(app: Flask) -> list[object]:
    """Record what the fast path returns for each request from now on (None: declined)."""
    answers: list[object] = []
    offer = app.fast_path

    def recorded(environ: dict, start_response: Callable) -> Iterable[bytes] | None:
        answer = offer(environ, start_response)
        answers.append(answer)
        return answer

    app.fast_path = recorded
    return answers


def appends_counted() -> tuple[float, float]:
    metrics = get_metrics()
    label = "application/json"
    return (
        metrics.appends.labels(label)._value.get(),
        metrics.append_bytes.labels(label)._value.get(),
    )


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [record.fields for record in caplog.records if record.name == "picomq.access"]


@pytest.mark.parametrize("tokens", [False, True], ids=["open", "tokens checked"])
def test_a_plain_append_gets_the_answer_flask_gives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, tokens: bool
) -> None:
    app = app_with_stream_s(tmp_path, **({"PICOMQ_JWT_SECRET": SECRET} if tokens else {}))
    headers = JSON | (bearer("append:s") if tokens else {})
    caplog.set_level(logging.INFO, logger="picomq.access")
    answers = answers_of_fast_path(app)
    responses, counts = [], [appends_counted()]
    for wsgi_app in (app, app.wsgi_app):  # the fast path, then Flask alone
        body = b'[{"n":1},{"n":2}]'
        responses.append(Client(wsgi_app).post("/v1/stream/s", data=body, headers=headers))
        counts.append(appends_counted())
    assert answers == [[]]  # the fast path answered the first, and was not asked the second
    fast, flask = responses
    fast.close(), flask.close()  # Flask logs a request when its response closes
    assert (fast.status, flask.status) == ("204 NO CONTENT", "204 NO CONTENT")
    assert [name for name, _ in fast.headers] == [name for name, _ in flask.headers]
    fast_static, flask_static = (
        {name: value for name, value in response.headers if name.lower() not in PER_REQUEST}
        for response in responses
    )
    assert fast_static == flask_static
    assert ("Vary" in fast_static) is tokens
    assert fast.headers["Stream-Next-Offset"] == "0000000000000000_0000000000000016"
    assert flask.headers["Stream-Next-Offset"] == "0000000000000000_0000000000000032"
    (appends_0, bytes_0), (appends_1, bytes_1), (appends_2, bytes_2) = counts
    assert appends_1 - appends_0 == appends_2 - appends_1 == 1
    assert bytes_1 - bytes_0 == bytes_2 - bytes_1 == len(body)
    fast_line, flask_line = access_lines(caplog)
    assert fast_line.pop("request_id") == fast.headers["X-Request-Id"]
    assert flask_line.pop("request_id") == flask.headers["X-Request-Id"]
    assert fast_line.pop("duration_ms") >= 0 and flask_line.pop("duration_ms") >= 0
    assert fast_line == flask_line
    assert list(fast_line) == list(flask_line)
    read = Client(app).get("/v1/stream/s?offset=-1", headers=bearer("read:s") if tokens else {})
    assert read.data == b'[{"n":1},{"n":2},{"n":1},{"n":2}]'


def producer(epoch: int, seq: int) -> dict[str, str]:
    return {**JSON, "Producer-Id": "p1", "Producer-Epoch": str(epoch), "Producer-Seq": str(seq)}


def test_a_producers_appends_get_the_answers_flask_gives(app: Flask) -> None:
    """New data, a duplicate, a fenced epoch, a gap: the fast path first, then Flask alone."""
    answers = answers_of_fast_path(app)
    for fast_headers, flask_headers, status, differ in (
        (producer(1, 0), producer(1, 1), 200, {"producer-seq", "stream-next-offset"}),
        (producer(1, 1), producer(1, 1), 204, set()),  # duplicates: no Stream-Next-Offset
        (producer(0, 2), producer(0, 2), 403, set()),  # an older epoch: fenced
        (producer(1, 5), producer(1, 5), 409, set()),  # a gap in the sequence
    ):
        fast = Client(app).post("/v1/stream/s", data=b"[1]", headers=fast_headers)
        flask = Client(app.wsgi_app).post("/v1/stream/s", data=b"[1]", headers=flask_headers)
        assert fast.status_code == flask.status_code == status
        assert [name for name, _ in fast.headers] == [name for name, _ in flask.headers]
        fast_static, flask_static = (
            {n: v for n, v in r.headers if n.lower() not in differ | {"x-request-id"}}
            for r in (fast, flask)
        )
        assert fast_static == flask_static
        assert fast.data == flask.data
    assert answers == [[], [], None, None]  # the two refusals were handed to the view
    assert Client(app).get("/v1/stream/s?offset=-1").data == b"[1,1]"


@pytest.mark.parametrize(
    "headers",
    [
        {**JSON, "Producer-Id": "p1"},
        {**JSON, "Producer-Id": "p1", "Producer-Epoch": "0", "Producer-Seq": "x"},
        {**JSON, "Producer-Id": " ", "Producer-Epoch": "0", "Producer-Seq": "0"},
    ],
)
def test_a_malformed_producer_is_refused_by_flask(app: Flask, headers: dict[str, str]) -> None:
    answers = answers_of_fast_path(app)
    response = Client(app).post("/v1/stream/s", data=b"[1]", headers=headers)
    assert answers == [None]
    assert response.status_code == 400
    assert "Producer" in response.json["error"]["message"]


def test_a_sane_request_id_is_echoed(app: Flask) -> None:
    answers = answers_of_fast_path(app)
    headers = {**JSON, "X-Request-Id": "run-42.step:7"}
    response = Client(app).post("/v1/stream/s", data=b"1", headers=headers)
    assert answers == [[]]
    assert response.headers["X-Request-Id"] == "run-42.step:7"
    forged = {**JSON, "X-Request-Id": "a b"}
    assert (
        Client(app).post("/v1/stream/s", data=b"1", headers=forged).headers["X-Request-Id"] != "a b"
    )


@pytest.mark.parametrize(
    ("what", "method", "path", "headers"),
    [
        ("a read", "GET", "/v1/stream/s", {}),
        ("a query", "POST", "/v1/stream/s?via=flask", JSON),
        ("a close", "POST", "/v1/stream/s", {**JSON, "Stream-Closed": "true"}),
        ("a Stream-Seq", "POST", "/v1/stream/s", {**JSON, "Stream-Seq": "a"}),
        ("chunks", "POST", "/v1/stream/s", {**JSON, "Transfer-Encoding": "chunked"}),
        ("a reserved path", "POST", "/v1/stream/__ds/x", JSON),
        ("a bad path", "POST", "/v1/stream/a//b", JSON),
        ("a path outside", "POST", "/v2/stream/s", JSON),
    ],
)
def test_other_requests_go_to_flask_untouched(
    app: Flask, what: str, method: str, path: str, headers: dict[str, str]
) -> None:
    answers = answers_of_fast_path(app)
    body = b"" if method == "GET" else b"[1]"
    environ = request_environ(method, path, headers, body)
    assert app.fast_path(environ, unexpected_start_response) is None, what
    assert environ["wsgi.input"].tell() == 0, what
    assert answers == [None]


@pytest.mark.parametrize(
    ("what", "content_length"),
    [("no length", None), ("an empty body", "0"), ("past the limit", str(10**12))],
)
def test_bodies_of_no_or_too_large_length_go_to_flask(
    app: Flask, what: str, content_length: str | None
) -> None:
    environ = request_environ("POST", "/v1/stream/s", JSON, b"[1]")
    del environ["CONTENT_LENGTH"]
    if content_length is not None:
        environ["CONTENT_LENGTH"] = content_length
    assert app.fast_path(environ, unexpected_start_response) is None, what
    assert environ["wsgi.input"].tell() == 0, what


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (b"[1,", JSON, 400, "body is not valid JSON"),
        (b"[]", JSON, 400, "an empty JSON array appends nothing"),
        (b"[1]", {"Content-Type": "not a type"}, 400, "malformed Content-Type"),
        (b"[1]", {"Content-Type": "text/plain"}, 409, "Content-Type does not match"),
    ],
)
def test_a_refused_append_is_refused_by_flask_with_its_body_put_back(
    app: Flask, body: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    answers = answers_of_fast_path(app)
    response = Client(app).post("/v1/stream/s", data=body, headers=headers)
    assert answers == [None]
    assert response.status_code == status
    assert message in response.json["error"]["message"]
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_a_bad_body_on_a_closed_stream_is_409_as_through_flask(app: Flask) -> None:
    """The view's order (a closed stream outranks a bad body) holds for replayed bodies."""
    closing = Client(app).post("/v1/stream/s", headers={**JSON, "Stream-Closed": "true"})
    assert closing.status_code == 204
    response = Client(app).post("/v1/stream/s", data=b"[1,", headers=JSON)
    assert response.status_code == 409
    assert response.headers["Stream-Closed"] == "true"


def test_an_unexpected_error_before_the_store_call_is_met_again_by_the_view(
    app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is written before the store call, so Flask replays it and answers 500."""
    views = app.view_functions["stream"].__self__
    calls = []

    def broken(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise RuntimeError("a bug")

    monkeypatch.setattr(fastpath, "parse_payload", broken)
    monkeypatch.setattr(views, "parse_payload", broken)
    answers = answers_of_fast_path(app)
    response = Client(app).post("/v1/stream/s", data=b"[1]", headers=JSON)
    assert answers == [None]
    assert len(calls) == 2
    assert response.status_code == 500
    assert response.json["error"]["code"] == "internal_error"


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        (StorageUnavailable("the bucket is down"), 503, "storage_unavailable"),
        (RuntimeError("a bug"), 500, "internal_error"),
    ],
)
def test_a_failed_store_call_is_answered_by_the_view_and_never_repeated(
    app: Flask, monkeypatch: pytest.MonkeyPatch, failure: Exception, status: int, code: str
) -> None:
    """The write may have happened: making the append again could store it twice."""
    store = app.extensions["picomq.store"]
    calls = []

    def failing_append(path: str, request: object) -> None:
        calls.append(path)
        raise failure

    monkeypatch.setattr(store, "append", failing_append)
    answers = answers_of_fast_path(app)
    response = Client(app).post("/v1/stream/s", data=b"[1]", headers=JSON)
    assert answers == [None]
    assert calls == ["s"]
    assert response.status_code == status
    assert response.json["error"]["code"] == code
    assert "X-Request-Id" in response.headers


@pytest.mark.parametrize(
    ("credentials", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer not-a-jwt"}, 401),
        ({"Authorization": "Basic dXNlcjpwdw=="}, 401),
        ("read:s append:other", 403),  # a scope: the token is minted when the test runs
        ("append:s", 204),
        ("append:*", 204),
    ],
)
def test_only_a_token_that_grants_the_append_takes_the_fast_path(
    tmp_path: Path, credentials: dict[str, str] | str, status: int
) -> None:
    if isinstance(credentials, str):
        credentials = bearer(credentials)
    app = app_with_stream_s(tmp_path, PICOMQ_JWT_SECRET=SECRET)
    answers = answers_of_fast_path(app)
    response = Client(app).post("/v1/stream/s", data=b"[1]", headers=JSON | credentials)
    assert response.status_code == status
    assert answers == ([[]] if status == 204 else [None])


def request_environ(method: str, path: str, headers: dict[str, str], body: bytes) -> dict:
    target, _, query = path.partition("?")
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": target,
        "QUERY_STRING": query,
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8080",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http",
    }
    for name, value in headers.items():
        key = name.upper().replace("-", "_")
        environ[key if key == "CONTENT_TYPE" else f"HTTP_{key}"] = value
    return environ


def unexpected_start_response(status: str, headers: list, exc_info: object = None) -> None:
    raise AssertionError(f"the fast path answered {status}")


@pytest.mark.parametrize("value", ["a\r\nInjected: yes", "a\nInjected: yes", "a\rInjected: yes"])
def test_a_field_value_that_would_break_its_line_is_refused(value: str) -> None:
    """The fast path's answer skips pywsgi's start_response, and its check per field."""
    assert header_lines([("Stream-Closed", "true")]) == b"Stream-Closed: true\r\n"
    with pytest.raises(ValueError, match="inside a header field"):
        header_lines([("Stream-Closed", "true"), ("X-Request-Id", value)])
