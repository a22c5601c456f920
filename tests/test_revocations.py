"""Revoked tokens: refused on every route, by every worker and node, within the bound
PICOMQ_REVOCATION_INTERVAL promises; live reads of them end; other tokens go on.

Servers are real gunicorn processes, two of them on one storage root where a test needs
another node (local disk, and a moto bucket). The bound waited for is the interval plus
LISTING_ALLOWANCE_SECONDS for one listing on a busy machine: a test waits up to it for
an effect, and asserts nothing about how much sooner it came.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import gevent
import jwt
import pytest
import requests
from conftest import REPO_DIR, make_server, whole_lines

from localdisk import LocalDisk
from revocations import PREFIX, Revocations

if TYPE_CHECKING:
    from conftest import Server, StartServer

SECRET = "revocation-test-secret-" + "r" * 40
EVERYTHING = "read:** append:** create:** delete:** admin:**"
INTERVAL_SECONDS = 0.5
LISTING_ALLOWANCE_SECONDS = 4.0
BOUND_SECONDS = INTERVAL_SECONDS + LISTING_ALLOWANCE_SECONDS
REQUEST_TIMEOUT_SECONDS = 30
TEXT = {"Content-Type": "text/plain"}
CLOSE = {"Connection": "close"}
ACCESS_LOG_FORMAT = "%(p)s %(m)s %(U)s %(s)s"
SETTINGS = {
    "PICOMQ_JWT_SECRET": SECRET,
    "PICOMQ_REVOCATION_INTERVAL": str(INTERVAL_SECONDS),
    "PICOMQ_SSE_MAX_DURATION": "60",
}


def mint(scope: str = EVERYTHING, **claims: object) -> str:
    now = int(time.time())
    body = {"scope": scope, "iat": now, "exp": now + 600, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, SECRET, algorithm="HS256")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def jti_of(token: str) -> str:
    return jwt.decode(token, options={"verify_signature": False})["jti"]


def revoke(server: Server, **body: object) -> dict:
    """Revoke through the admin route with an admin token; the revocation it answers."""
    body.setdefault("until", int(time.time()) + 600)
    response = requests.post(
        f"{server.url}/v1/revocations", json=body, headers=bearer(mint(jti=fresh("admin")))
    )
    assert response.status_code == 201, response.content
    return response.json()


def create_stream(server: Server, path: str, data: bytes = b"x") -> str:
    url = server.stream_url(path)
    response = requests.put(url, data=data, headers={**TEXT, **bearer(mint())})
    assert response.status_code == 201, response.content
    return url


# -- every route ----------------------------------------------------------------------


def every_route(server: Server, path: str) -> dict[str, Callable[[str], requests.Response]]:
    """A request to each kind of route, with the given token, each on a new connection
    (so that the requests spread over the workers)."""
    url, root = server.stream_url(path), server.url
    revocation = {"jti": fresh("unused"), "until": int(time.time()) + 600}

    def send(
        method: str, target: str, headers: dict[str, str] | None = None, **options: object
    ) -> Callable[[str], requests.Response]:
        def request(token: str) -> requests.Response:
            return requests.request(
                method,
                target,
                headers={**CLOSE, **bearer(token), **(headers or {})},
                timeout=REQUEST_TIMEOUT_SECONDS,
                **options,
            )

        return request

    return {
        "create": send("PUT", f"{url}-new", TEXT),
        "plain append": send("POST", url, TEXT, data=b"y"),
        "close": send("POST", f"{url}-other", {"Stream-Closed": "true"}),
        "catch-up read": send("GET", url, params={"offset": "-1"}),
        "head": send("HEAD", url),
        "delete": send("DELETE", f"{url}-other"),
        "long-poll": send("GET", url, params={"offset": "now", "live": "long-poll"}),
        "sse": send("GET", url, params={"offset": "now", "live": "sse"}, stream=True),
        "listing": send("GET", f"{root}/v1/streams"),
        "metrics": send("GET", f"{root}/metrics"),
        "revocations": send("POST", f"{root}/v1/revocations", json=revocation),
        "subscriptions": send("GET", f"{root}/v1/stream/__ds/subscriptions/nobody"),
    }


def assert_revoked(response: requests.Response, route: str) -> None:
    assert response.status_code == 401, (route, response.status_code, response.content[:200])
    if response.request.method != "HEAD":
        assert response.json()["error"] == {"code": "invalid_token", "message": "token revoked"}
    assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]


def assert_refused_everywhere(routes: dict, token: str, rounds: int) -> None:
    for _ in range(rounds):
        for route, request in routes.items():
            with request(token) as response:
                assert_revoked(response, route)


def assert_served_everywhere(routes: dict, token: str) -> None:
    """No route refuses the token (a 404 of the subscription route is its answer)."""
    for route, request in routes.items():
        with request(token) as response:
            status = response.status_code
            assert status < 400 or status == 404, (route, status, response.content[:200])


def wait_out_the_bound(revoked_at: float) -> None:
    time.sleep(max(0.0, revoked_at + BOUND_SECONDS - time.monotonic()))


# -- another worker -------------------------------------------------------------------


def start_logged_server(start_server: StartServer, tmp_path: Path, **options: object) -> Server:
    """Two workers; the access log (tmp_path/access.log) names each request's worker."""
    access_log = tmp_path / "access.log"
    arguments = (
        f"--access-logfile {shlex.quote(str(access_log))} "
        f"--access-logformat {shlex.quote(ACCESS_LOG_FORMAT)}"
    )
    return start_server(workers=2, env={**SETTINGS, "GUNICORN_CMD_ARGS": arguments}, **options)


def logged(tmp_path: Path) -> list[list[str]]:
    """(pid, method, path, status) of each request so far."""
    return [line.split(" ") for line in whole_lines(tmp_path / "access.log")]


def test_a_revoked_jti_is_refused_on_every_route_by_every_worker(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_logged_server(start_server, tmp_path, long_poll_timeout=0.5)
    path = fresh("routes")
    create_stream(server, path)
    create_stream(server, f"{path}-other")
    victim, bystander = mint(jti=fresh("victim")), mint(jti=fresh("bystander"))
    routes = every_route(server, path)
    assert_served_everywhere(routes, victim)
    revoked_at = time.monotonic()
    revoke(server, jti=jti_of(victim))
    wait_out_the_bound(revoked_at)
    assert_refused_everywhere(routes, victim, rounds=5)
    create_stream(server, f"{path}-other")  # the bystander may close and delete it again
    assert_served_everywhere(routes, bystander)
    entries = logged(tmp_path)
    revoker = next(pid for pid, method, url, _ in entries if url == "/v1/revocations")
    refusing = {pid for pid, _, _, status in entries if status == "401"}
    assert refusing - {revoker}, f"only worker {revoker} refused the token: nothing was tested"


# -- another node ---------------------------------------------------------------------


@pytest.fixture
def two_nodes(start_server: StartServer, storage_url: str) -> tuple[Server, Server]:
    """Two servers (one worker each) on one storage root: local disk, or a moto bucket."""
    settings = {**SETTINGS, "PICOMQ_POLL_INTERVAL": "0.2"}
    first = start_server(storage_url=storage_url, workers=1, env=settings)
    second = start_server(storage_url=storage_url, workers=1, long_poll_timeout=30, env=settings)
    return first, second


def test_a_revoked_sub_is_refused_on_another_node_and_later_tokens_are_not(
    two_nodes: tuple[Server, Server],
) -> None:
    here, there = two_nodes
    path = fresh("subject")
    create_stream(here, path)
    create_stream(here, f"{path}-other")
    subject = fresh("user")
    issued_before = mint(sub=subject, iat=int(time.time()) - 5)
    routes = every_route(there, path)
    with routes["head"](issued_before) as response:
        assert response.status_code == 200
    revoked_at = time.monotonic()
    answer = revoke(here, sub=subject)
    assert answer["sub"] == subject and answer["at"] >= int(time.time()) - 5
    wait_out_the_bound(revoked_at)
    assert_refused_everywhere(routes, issued_before, rounds=2)
    routes = {name: request for name, request in routes.items() if name != "long-poll"}
    assert_served_everywhere(routes, mint(sub=subject, iat=int(time.time()) + 1))
    create_stream(here, f"{path}-other")
    assert_served_everywhere(routes, mint(sub=fresh("someone-else")))


# -- live reads -----------------------------------------------------------------------


@contextmanager
def open_sse(server: Server, path: str, token: str) -> Iterator[http.client.HTTPResponse]:
    """An SSE read from the start, its first events read (so it waits at the tail)."""
    connection = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    connection.timeout = BOUND_SECONDS  # each read: an end that never comes fails the test
    try:
        connection.request("GET", f"/v1/stream/{path}?offset=-1&live=sse", headers=bearer(token))
        response = connection.getresponse()
        assert response.status == 200
        assert read_sse_events(response, until=b'"upToDate":true')
        yield response
    finally:
        connection.close()


def read_sse_events(response: http.client.HTTPResponse, until: bytes) -> bytes:
    """The body up to the line that holds `until`; b"" if the body ends first."""
    received = b""
    while until not in received:
        line = response.readline()
        if not line:
            return b""
        received += line
    return received


def live_reads(server: Server) -> float:
    """Long-polls and SSE reads the (one-worker) server holds, from its metrics."""
    text = requests.get(f"{server.url}/metrics", headers=bearer(mint())).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("picomq_live_connections{")
    )


def test_live_reads_of_a_revoked_token_end_on_another_node_within_the_bound(
    two_nodes: tuple[Server, Server],
) -> None:
    here, there = two_nodes
    path = fresh("live")
    create_stream(here, path)
    victim, bystander = mint(jti=fresh("victim")), mint(jti=fresh("bystander"))
    with open_sse(there, path, victim) as watched, open_sse(there, path, bystander) as unaffected:
        check_live_reads_end(here, there, path, victim, bystander, watched, unaffected)


def check_live_reads_end(
    here: Server,
    there: Server,
    path: str,
    victim: str,
    bystander: str,
    watched: http.client.HTTPResponse,
    unaffected: http.client.HTTPResponse,
) -> None:
    long_poll: dict[str, object] = {}

    def wait_long() -> None:  # a read timeout if the answer does not come within the bound
        try:
            long_poll["answer"] = requests.get(
                there.stream_url(path),
                params={"offset": "now", "live": "long-poll"},
                headers=bearer(victim),
                timeout=BOUND_SECONDS + 2,
            )
        except requests.RequestException as error:
            long_poll["error"] = error

    waiter = threading.Thread(target=wait_long)
    waiter.start()
    deadline = time.monotonic() + REQUEST_TIMEOUT_SECONDS
    # The node that serves the stream holds the reads, whichever node they came to.
    while live_reads(here) + live_reads(there) < 3:  # the long-poll waits
        assert time.monotonic() < deadline, "the long-poll never started waiting"
        time.sleep(0.05)
    revoke(here, jti=jti_of(victim))
    try:
        rest = watched.read()  # to the body's end (a read past the bound times out)
    except TimeoutError:
        pytest.fail(f"the SSE read of a revoked token was still open {BOUND_SECONDS} s on")
    assert b"event:" not in rest, rest  # ended with no event after the revocation
    waiter.join(BOUND_SECONDS + REQUEST_TIMEOUT_SECONDS)
    assert "answer" in long_poll, f"the long-poll in progress: {long_poll.get('error')}"
    assert_revoked(long_poll["answer"], "long-poll in progress")
    headers = {**TEXT, **bearer(bystander)}
    assert requests.post(here.stream_url(path), data=b"after", headers=headers).status_code == 204
    assert b"data:after" in read_sse_events(unaffected, until=b"data:after")


# -- the admin route and the command ---------------------------------------------------


@pytest.fixture(scope="module")
def revoking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = make_server(tmp_path_factory.mktemp("picomq-revoking"), env=SETTINGS)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"", "bad_request"),
        (b"[]", "bad_request"),
        (b'{"jti": "a"}', "bad_request"),
        (b'{"jti": "a", "sub": "b", "until": 2000000000}', "bad_request"),
        (b'{"jti": 7, "until": 2000000000}', "bad_request"),
        (b'{"jti": "a", "until": "2000000000"}', "bad_request"),
        (b'{"jti": "a", "until": 2000000000.5}', "bad_request"),
        (b'{"jti": "a", "until": 2000000000, "why": "leaked"}', "bad_request"),
        (b'{"jti": "", "until": 2000000000}', "bad_request"),
        (b'{"jti": "a", "until": 1}', "bad_request"),
        (b'{"jti": "a", "until": 9000000000}', "bad_request"),
        (json.dumps({"sub": "s" * 1025, "until": 2000000000}).encode(), "bad_request"),
        (b'{"jti": "' + b"j" * 5000 + b'", "until": 2000000000}', "bad_request"),
    ],
)
def test_a_bad_revocation_is_400_with_a_reason(
    revoking_server: Server, body: bytes, code: str
) -> None:
    response = requests.post(
        f"{revoking_server.url}/v1/revocations", data=body, headers=bearer(mint())
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == code and error["message"]


def test_revoking_needs_admin_on_the_route(revoking_server: Server) -> None:
    url = f"{revoking_server.url}/v1/revocations"
    body = {"jti": "j", "until": int(time.time()) + 60}
    assert requests.post(url, json=body).status_code == 401
    response = requests.post(url, json=body, headers=bearer(mint("admin:v1/streams")))
    assert response.status_code == 403
    response = requests.post(url, json=body, headers=bearer(mint("admin:v1/revocations")))
    assert response.status_code == 201


def test_a_server_that_checks_no_revocations_says_so(start_server: StartServer) -> None:
    server = start_server(env={**SETTINGS, "PICOMQ_REVOCATION_INTERVAL": "0"})
    body = {"jti": "j", "until": int(time.time()) + 60}
    response = requests.post(f"{server.url}/v1/revocations", json=body, headers=bearer(mint()))
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "revocations_off"


def test_the_revoke_command_revokes_what_the_token_command_minted(revoking_server: Server) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PICOMQ_")}
    environment.update(PICOMQ_JWT_SECRET=SECRET, PICOMQ_URL=revoking_server.url)

    def picomq(*arguments: str, token: str | None = None) -> subprocess.CompletedProcess:
        env = {**environment, **({"PICOMQ_TOKEN": token} if token else {})}
        return subprocess.run(
            [sys.executable, "-m", "picomq", *arguments],
            cwd=REPO_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=REQUEST_TIMEOUT_SECONDS,
        )

    minted = picomq("token", "--scope", "read:**", "--ttl", "1h")
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.strip()
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    url = revoking_server.stream_url(fresh("cli"))
    assert requests.head(url, headers=bearer(token)).status_code == 404
    revoked = picomq("revoke", "--jti", claims["jti"], "--until", str(claims["exp"]), token=mint())
    assert revoked.returncode == 0, revoked.stderr
    assert json.loads(revoked.stdout)["jti"] == claims["jti"]
    assert requests.head(url, headers=bearer(token)).status_code == 401  # at once, one worker
    by_subject = picomq("revoke", "--sub", "someone", "--until", "1h", token=mint())
    assert json.loads(by_subject.stdout)["until"] >= claims["exp"] - 5
    for arguments, message in [
        (("--until", "1h"), "--jti or --sub"),
        (("--jti", "a", "--sub", "b", "--until", "1h"), "--jti or --sub"),
        (("--jti", "a", "--until", "soon"), "--until"),
    ]:
        refused = picomq("revoke", *arguments, token=mint())
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    denied = picomq("revoke", "--jti", "a", "--until", "1h", token=mint("read:**"))
    assert denied.returncode == 5, denied.stderr


# -- the list on storage --------------------------------------------------------------


def test_a_listing_deletes_revocations_past_their_until_and_nothing_else(tmp_path: Path) -> None:
    objects = LocalDisk(str(tmp_path))
    revocations = Revocations(objects, interval=60, grace_seconds=0)
    revocations.revoke("jti", "short-lived", int(time.time()) + 1)
    by_subject = revocations.revoke("sub", "someone", int(time.time()) + 600)
    objects.create(f"{PREFIX}/not-a-revocation", b"")
    assert revocations.refuses({"jti": "short-lived"})
    gevent.sleep(2.1)  # past its until
    fresh_process = Revocations(objects, interval=60, grace_seconds=0)
    assert not fresh_process.refuses({"jti": "short-lived"})
    assert fresh_process.refuses({"sub": "someone", "iat": by_subject.at})
    assert fresh_process.refuses({"sub": "someone"})  # no iat: issued whenever
    assert not fresh_process.refuses({"sub": "someone", "iat": by_subject.at + 1})
    names = sorted(objects.list(PREFIX))
    assert len(names) == 2 and names[1] == "not-a-revocation", names
    assert "-sub-" in names[0]
