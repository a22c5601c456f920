"""Access control: tokens, scopes, 401 versus 403, no existence leaks, no tokens in logs.

Servers are real gunicorn processes with a key configured; tokens are minted with PyJWT
(as any backend would) or with `python -m picomq token`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import os
import runpy
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import jwt
import pytest
import requests
from conftest import REPO_DIR, make_server
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.rsa import generate_private_key
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from test_limits import (
    assert_all_inside,
    hostile_targets,
    json_error_problem,
    send_raw,
    snapshot_ancestors,
)

from auth import Grant, includes, matches, parse_scope
from settings import Settings, SettingsError

if TYPE_CHECKING:
    from conftest import Server, StartServer

SECRET = "test-secret-" + "k" * 60  # 64 bytes or more: long enough for HS512 too
OCTETS = {"Content-Type": "application/octet-stream"}
EVERYTHING = "read:** append:** create:** delete:** admin:**"


def mint(
    scope: object = EVERYTHING, *, key: object = SECRET, algorithm: str = "HS256", **claims: object
) -> str:
    """A token as any backend would mint it; a claim given as None is left out."""
    body = {"scope": scope, "exp": int(time.time()) + 600, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm=algorithm)


def encode_part(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def fresh(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module with PICOMQ_JWT_SECRET set."""
    server = make_server(
        tmp_path_factory.mktemp("picomq-auth"),
        env={"PICOMQ_JWT_SECRET": SECRET, "PICOMQ_SSE_MAX_DURATION": "1"},
    )
    server.start()
    yield server
    server.stop()


def create_stream(server: Server, path: str, data: bytes = b"") -> str:
    url = server.stream_url(path)
    response = requests.put(url, data=data, headers={**OCTETS, **bearer(mint())})
    assert response.status_code == 201, response.content
    return url


def body_for(method: str) -> bytes | None:
    """A byte of body, but none on a HEAD: the worker refuses a HEAD with one (400)."""
    return None if method == "HEAD" else b"x"


def assert_refused(response: requests.Response, status: int, error: str) -> None:
    problem = json_error_problem(response, response.request.method or "GET")
    assert not problem, problem
    assert response.status_code == status, (response.status_code, response.content)
    assert response.headers["Cache-Control"] == "no-store"
    challenge = response.headers["WWW-Authenticate"]
    assert challenge.startswith('Bearer realm="picomq"'), challenge
    if error != "missing_token":
        assert f'error="{error}"' in challenge, challenge


# -- scopes, as pure functions --------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("agents/run-42", "agents/run-42", True),
        ("agents/run-42", "agents/run-43", False),
        ("agents/run-42", "agents/run-42/x", False),
        ("agents/*", "agents/run-42", True),
        ("agents/*", "agents/run-42/x", False),
        ("agents/*", "agents", False),
        ("*/logs", "a/logs", True),
        ("jobs/**", "jobs/a/b/c", True),
        ("jobs/**", "jobs", True),
        ("jobs/**", "jobsx/a", False),
        ("**", "anything/at/all", True),
        ("**/tail", "a/b/tail", True),
        ("**/tail", "a/b/tail/x", False),
        ("a/**/z", "a/z", True),
        ("a/**/z", "a/b/c/z", True),
        ("a/**/z", "a/b/c/y", False),
        ("run-*", "run-42", True),
        ("run-*", "walk-42", False),
        ("run-*", "run-4/2", False),
        ("a.b", "axb", False),
        ("a+", "aa", False),
    ],
)
def test_patterns_match_whole_segments(pattern: str, path: str, expected: bool) -> None:
    assert matches(tuple(pattern.split("/")), tuple(path.split("/"))) is expected


def test_many_double_stars_match_in_polynomial_time() -> None:
    """`**/a/**/a/…` against a long path of `a`s is quadratic, not exponential."""
    pattern = tuple(["**", "a"] * 16 + ["b"])
    assert matches(pattern, tuple(["a"] * 32)) is False


@pytest.mark.parametrize(
    ("grant", "pattern", "expected"),
    [
        ("public/**", "public/**", True),
        ("public/**", "public/a/*", True),
        ("public/**", "public", True),
        ("public/**", "public/**/x", True),
        ("public/**", "**", False),
        ("public/**", "private/*", False),
        ("public/**", "*/x", False),
        ("public/**", "public*/x", False),
        ("public/*", "public/**", False),
        ("public/*", "public/a-*", True),
        ("public/a-*", "public/a-1*", True),
        ("public/a-*", "public/*", False),
        ("run-*-x", "run-1*-x", True),
        ("run-*-x", "run-*", False),
        ("**", "**", True),
        ("**/logs", "a/**/logs", True),
        ("a/**/z", "a/**", False),
        ("*", "**", False),
        ("*", "*", True),
    ],
)
def test_a_grant_includes_a_pattern(grant: str, pattern: str, expected: bool) -> None:
    assert includes(tuple(grant.split("/")), tuple(pattern.split("/"))) is expected


def test_includes_never_says_yes_when_a_path_tells_otherwise() -> None:
    """Every pair of small patterns: when one includes the other, no path shows it wrong."""
    words = [("a",), ("b",), ("ab",)]
    paths = [p + q + r for p in [()] + words for q in [()] + words for r in words]
    segments = ["a", "*", "**", "a*", "*b"]
    patterns = [tuple(s) for n in (1, 2, 3) for s in itertools.product(segments, repeat=n)]
    for grant, pattern in itertools.product(patterns, patterns):
        if includes(grant, pattern):
            wrong = [path for path in paths if matches(pattern, path) and not matches(grant, path)]
            assert not wrong, (grant, pattern, wrong)


def test_scope_parsing_keeps_known_grants_and_skips_the_rest() -> None:
    grants = parse_scope("read:agents/run-42  append:jobs/** fly:x read: delete:a/../b bogus")
    assert grants == (
        Grant("read", ("agents", "run-42")),
        Grant("append", ("jobs", "**")),
    )


@pytest.mark.parametrize("item", ["fly:x", "read:", "read:a//b", "delete:a/../b", "read:a**"])
def test_strict_scope_parsing_refuses_what_would_grant_nothing(item: str) -> None:
    with pytest.raises(ValueError, match="scope item"):
        parse_scope(f"read:ok {item}", strict=True)


# -- off by default ---------------------------------------------------------------------


def test_without_a_key_no_token_is_needed_and_reads_stay_publicly_cacheable(
    server: Server, unique_stream: str
) -> None:
    url = server.stream_url(unique_stream)
    assert requests.put(url, headers=OCTETS).status_code == 201
    assert requests.post(url, data=b"x", headers=OCTETS).status_code == 204
    response = requests.get(url, params={"offset": "-1"})
    assert response.status_code == 200
    assert response.headers["Cache-Control"].startswith("public")
    assert requests.delete(url).status_code == 204


def test_a_token_is_ignored_when_access_control_is_off(server: Server, unique_stream: str) -> None:
    url = server.stream_url(unique_stream)
    response = requests.put(url, headers={**OCTETS, **bearer("not-a-jwt")})
    assert response.status_code == 201


# -- 401: missing or invalid ------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "POST", "DELETE"])
def test_missing_token_is_401_on_every_method(auth_server: Server, method: str) -> None:
    url = create_stream(auth_server, fresh())
    response = requests.request(method, url, data=body_for(method), headers=OCTETS)
    assert_refused(response, 401, "missing_token")


def test_missing_token_is_401_on_control_routes_and_unknown_paths(auth_server: Server) -> None:
    for path in ("/v1/stream/__ds/subscriptions/s1", "/metrics", "/v1/streams", "/nowhere"):
        assert_refused(requests.get(auth_server.url + path), 401, "missing_token")


def test_other_authorization_schemes_count_as_missing(auth_server: Server) -> None:
    url = create_stream(auth_server, fresh())
    basic = "Basic " + base64.b64encode(b"user:pass").decode()
    assert_refused(requests.get(url, headers={"Authorization": basic}), 401, "missing_token")


def invalid_tokens() -> dict[str, str]:
    now = int(time.time())
    header, payload, signature = mint("read:nothing").split(".")
    forged_payload = encode_part(json.dumps({"scope": EVERYTHING, "exp": now + 600}).encode())
    unsigned = jwt.encode({"scope": EVERYTHING, "exp": now + 600}, None, algorithm="none")
    return {
        "garbage": "not-a-jwt",
        "empty payload": "a.b.c",
        "other secret": mint(key="another-secret-" + "z" * 40),
        "expired": mint(exp=now - 3600),
        "not yet valid": mint(nbf=now + 3600),
        "no exp": mint(exp=None),
        "alg none": unsigned,
        "HS512": mint(algorithm="HS512"),
        "tampered payload": f"{header}.{forged_payload}.{signature}",
        "signature dropped": f"{header}.{payload}.",
        "scope not a string": mint(["read:**"]),
    }


@pytest.mark.parametrize("name", list(invalid_tokens()))
def test_invalid_tokens_are_401(auth_server: Server, name: str) -> None:
    token = invalid_tokens()[name]
    url = create_stream(auth_server, fresh(), b"secret data")
    for response in (
        requests.get(url, headers=bearer(token)),
        requests.get(url, params={"access_token": token}),
    ):
        assert_refused(response, 401, "invalid_token")
        assert b"secret data" not in response.content


def test_valid_token_in_header_or_query_is_accepted(auth_server: Server) -> None:
    url = create_stream(auth_server, fresh(), b"hello")
    token = mint("read:**")
    assert requests.get(url, headers=bearer(token)).content == b"hello"
    assert requests.get(url, params={"offset": "-1", "access_token": token}).content == b"hello"


def test_token_in_header_and_query_or_twice_in_query_is_400(auth_server: Server) -> None:
    url = create_stream(auth_server, fresh())
    token = mint()
    both = requests.get(url, headers=bearer(token), params={"access_token": token})
    twice = requests.get(f"{url}?access_token={token}&access_token={token}")
    for response in (both, twice):
        assert_refused(response, 400, "invalid_request")


# -- 403: each action on each route -----------------------------------------------------


def test_each_method_needs_its_own_action(auth_server: Server) -> None:
    """Every grant but the needed one is 403; the needed one alone is enough."""
    path = fresh("acts")
    url = auth_server.stream_url(path)
    needed = {
        "PUT": ("create", {"data": b"", "headers": OCTETS}, 201),
        "POST": ("append", {"data": b"x", "headers": OCTETS}, 204),
        "GET": ("read", {"params": {"offset": "-1"}}, 200),
        "HEAD": ("read", {}, 200),
        "DELETE": ("delete", {}, 204),
    }
    actions = ("read", "append", "create", "delete", "admin")
    for method, (action, arguments, status) in needed.items():
        extra = arguments.pop("headers", {})
        for other in actions:
            if other == action:
                continue
            response = requests.request(
                method, url, headers={**extra, **bearer(mint(f"{other}:{path}"))}, **arguments
            )
            assert_refused(response, 403, "insufficient_scope")
        response = requests.request(
            method, url, headers={**extra, **bearer(mint(f"{action}:{path}"))}, **arguments
        )
        assert response.status_code == status, (method, response.status_code, response.content)


def test_closing_a_stream_counts_as_append(auth_server: Server) -> None:
    path = fresh("close")
    url = create_stream(auth_server, path)
    close = {"Stream-Closed": "true"}
    refused = requests.post(url, headers={**close, **bearer(mint(f"read:{path} delete:{path}"))})
    assert_refused(refused, 403, "insufficient_scope")
    assert "Stream-Closed" not in requests.head(url, headers=bearer(mint())).headers
    allowed = requests.post(url, headers={**close, **bearer(mint(f"append:{path}"))})
    assert allowed.status_code == 204, allowed.content
    assert requests.head(url, headers=bearer(mint())).headers["Stream-Closed"] == "true"


def test_patterns_limit_a_token_to_its_streams(auth_server: Server) -> None:
    run = fresh("agents")
    mine, sibling = f"{run}/run-42", f"{run}/run-43"
    for path in (mine, sibling, f"{mine}/deeper"):
        create_stream(auth_server, path, b"data")
    token = mint(f"read:{mine} append:{run}/*")
    assert requests.get(auth_server.stream_url(mine), headers=bearer(token)).status_code == 200
    for path in (sibling, f"{mine}/deeper"):
        response = requests.get(auth_server.stream_url(path), headers=bearer(token))
        assert_refused(response, 403, "insufficient_scope")
    append = requests.post(
        auth_server.stream_url(sibling), data=b"x", headers={**OCTETS, **bearer(token)}
    )
    assert append.status_code == 204


def test_fork_needs_create_on_the_fork_and_read_on_the_source(auth_server: Server) -> None:
    source, fork = fresh("source"), fresh("fork")
    create_stream(auth_server, source, b"history")
    fork_url = auth_server.stream_url(fork)
    for header in (source, f"/v1/stream/{source}"):
        headers = {**OCTETS, "Stream-Forked-From": header}
        refused = requests.put(fork_url, headers={**headers, **bearer(mint(f"create:{fork}"))})
        assert_refused(refused, 403, "insufficient_scope")
    assert requests.head(fork_url, headers=bearer(mint())).status_code == 404
    token = mint(f"create:{fork} read:{source}")
    headers = {**OCTETS, "Stream-Forked-From": source, **bearer(token)}
    assert requests.put(fork_url, headers=headers).status_code == 201
    assert requests.get(fork_url, headers=bearer(mint())).content == b"history"


def test_control_routes_need_admin(auth_server: Server) -> None:
    url = f"{auth_server.url}/v1/stream/__ds/subscriptions/{fresh('sub')}"
    refused = requests.get(url, headers=bearer(mint("read:** append:** create:** delete:**")))
    assert_refused(refused, 403, "insufficient_scope")
    reached = requests.get(url, headers=bearer(mint("admin:__ds/**")))
    assert reached.status_code == 404, reached.content  # the subscription view answered
    listing = f"{auth_server.url}/v1/streams"
    refused = requests.get(listing, headers=bearer(mint("read:**")))
    assert_refused(refused, 403, "insufficient_scope")
    assert requests.get(listing, headers=bearer(mint("admin:**"))).status_code == 200


def test_public_routes_need_no_token(auth_server: Server) -> None:
    assert requests.get(f"{auth_server.url}/v1/stream/__ds/jwks.json").status_code == 200
    assert requests.get(f"{auth_server.url}/healthz").status_code == 200
    preflight = requests.options(
        auth_server.stream_url(fresh()),
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 204


def test_wake_token_routes_are_left_to_the_subscription(auth_server: Server) -> None:
    """callback/ack/release carry the server's own wake token, not a JWT."""
    url = f"{auth_server.url}/v1/stream/__ds/subscriptions/{fresh('sub')}/callback"
    response = requests.post(url, json={}, headers=bearer("wake-token"))
    assert response.status_code in (401, 404), response.content
    assert "WWW-Authenticate" not in response.headers  # not our refusal: the view's


# -- subscriptions: what they link is what their creator may read ------------------------

SUBSCRIBER = "admin:__ds/** read:public/** append:wakes/**"


def subscribe(server: Server, token: str, subscription_id: str, **config: object):
    url = f"{server.url}/v1/stream/__ds/subscriptions/{subscription_id}"
    return requests.put(url, json=config, headers=bearer(token))


def test_a_subscription_links_only_what_its_creator_may_read(auth_server: Server) -> None:
    token, prefix = mint(SUBSCRIBER), fresh()
    wake = f"wakes/{prefix}"
    create_stream(auth_server, wake)
    pull = {"type": "pull-wake", "wake_stream": wake}
    for config in (
        {"pattern": "**"},
        {"pattern": "private/*"},
        {"pattern": "*/x"},
        {"pattern": "public*/x"},
        {"streams": [f"private/{prefix}"]},
        {"pattern": f"public/{prefix}/**", "streams": [f"private/{prefix}"]},
        {"pattern": f"public/{prefix}/**", "wake_stream": f"public/{prefix}-wake"},
    ):
        refused = subscribe(auth_server, token, fresh("sub"), **{**pull, **config})
        assert_refused(refused, 403, "insufficient_scope")
    subscription_id = fresh("sub")
    created = subscribe(auth_server, token, subscription_id, **pull,
                        pattern=f"public/{prefix}/**", streams=[f"public/{prefix}"])  # fmt: skip
    assert created.status_code == 201, created.content
    streams = f"{auth_server.url}/v1/stream/__ds/subscriptions/{subscription_id}/streams"
    added = requests.post(streams, json={"streams": [f"private/{prefix}"]}, headers=bearer(token))
    assert_refused(added, 403, "insufficient_scope")
    added = requests.post(streams, json={"streams": [f"public/{prefix}-2"]}, headers=bearer(token))
    assert added.status_code == 204, added.content


def test_a_subscription_lists_only_the_streams_the_caller_may_read(auth_server: Server) -> None:
    prefix = fresh()
    public, private, wake = f"public/{prefix}", f"private/{prefix}", f"wakes/{prefix}"
    for path in (public, private, wake):
        create_stream(auth_server, path)
    subscription_id = fresh("sub")
    created = subscribe(auth_server, mint(), subscription_id, type="pull-wake",
                        streams=[public, private], wake_stream=wake)  # fmt: skip
    assert created.status_code == 201, created.content
    url = f"{auth_server.url}/v1/stream/__ds/subscriptions/{subscription_id}"
    everything = requests.get(url, headers=bearer(mint())).json()["streams"]
    assert [stream["path"] for stream in everything] == [private, public]
    limited = requests.get(url, headers=bearer(mint(SUBSCRIBER))).json()["streams"]
    assert [stream["path"] for stream in limited] == [public]
    secret = requests.post(auth_server.stream_url(private), data=b"secret",
                           headers={**OCTETS, **bearer(mint())})  # fmt: skip
    assert secret.status_code == 204
    claimed = requests.post(f"{url}/claim", json={"worker": "w"}, headers=bearer(mint(SUBSCRIBER)))
    assert claimed.status_code == 200, claimed.content
    assert [stream["path"] for stream in claimed.json()["streams"]] == [public]


# -- no existence leaks -----------------------------------------------------------------
# -- no existence leaks -----------------------------------------------------------------


def answer(response: requests.Response) -> tuple:
    return (
        response.status_code,
        response.content,
        response.headers.get("WWW-Authenticate"),
        response.headers.get("Content-Type"),
    )


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST", "DELETE", "PUT"])
def test_no_grant_gets_the_same_answer_whether_or_not_the_stream_exists(
    auth_server: Server, method: str
) -> None:
    existing, missing = fresh("exists"), fresh("missing")
    create_stream(auth_server, existing, b"data")
    unrelated = mint("read:elsewhere/** append:elsewhere/** create:elsewhere/**")
    headers = {**OCTETS, **bearer(unrelated)}
    answers = [
        answer(
            requests.request(
                method, auth_server.stream_url(path), data=body_for(method), headers=headers
            )
        )
        for path in (existing, missing)
    ]
    assert answers[0] == answers[1]
    assert answers[0][0] == 403
    anonymous = [
        answer(
            requests.request(
                method, auth_server.stream_url(path), data=body_for(method), headers=OCTETS
            )
        )
        for path in (existing, missing)
    ]
    assert anonymous[0] == anonymous[1]
    assert anonymous[0][0] == 401


def test_fork_of_a_stream_without_read_access_leaks_nothing(auth_server: Server) -> None:
    existing = fresh("private-source")
    create_stream(auth_server, existing, b"data")
    answers = []
    for source in (existing, fresh("no-such-source")):
        fork = fresh("fork")
        headers = {**OCTETS, "Stream-Forked-From": source, **bearer(mint(f"create:{fork}"))}
        answers.append(answer(requests.put(auth_server.stream_url(fork), headers=headers)))
    assert answers[0] == answers[1]
    assert answers[0][0] == 403


# -- caching ----------------------------------------------------------------------------


def test_no_short_path_reaches_a_long_path_s_stream_past_its_scope(auth_server: Server) -> None:
    """Long paths are kept under a hashed name; no other path's name can equal it."""
    long_path = f"private/{fresh()}/" + "x" * 300
    url = create_stream(auth_server, long_path, b"secret")
    digest = hashlib.sha256(long_path.encode()).hexdigest()
    one_segment = bearer(mint("read:* append:* create:* delete:*"))
    for alias in ("~" + digest, "%h" + digest):
        alias_url = auth_server.stream_url(quote(alias, safe=""))
        assert requests.get(alias_url, headers=one_segment).status_code == 404
        assert requests.delete(alias_url, headers=one_segment).status_code == 404
        assert (
            requests.post(alias_url, data=b"x", headers={**OCTETS, **one_segment}).status_code
            == 404
        )
        created = requests.put(alias_url, data=b"mine", headers={**OCTETS, **one_segment})
        assert created.status_code == 201, created.content
        assert requests.get(alias_url, headers=one_segment).content == b"mine"
    assert requests.get(url, headers=bearer(mint())).content == b"secret"


def test_credentialed_reads_are_never_publicly_cacheable(auth_server: Server) -> None:
    url = create_stream(auth_server, fresh(), b"cache me privately")
    token = mint("read:**")
    responses = [
        requests.get(url, params={"offset": "-1"}, headers=bearer(token)),
        requests.get(url, params={"offset": "-1", "access_token": token}),
        requests.head(url, headers=bearer(token)),
        requests.get(url, params={"offset": "now"}, headers=bearer(token)),
    ]
    for response in responses:
        assert response.status_code == 200
        cache_control = response.headers["Cache-Control"]
        assert "public" not in cache_control, cache_control
        assert "private" in cache_control or "no-store" in cache_control, cache_control
    assert responses[0].headers["Cache-Control"].startswith("private, max-age=")
    assert "Authorization" in responses[0].headers["Vary"]


# -- EventSource-style live reads with the token in the query --------------------------


def test_sse_with_access_token_in_the_query(auth_server: Server) -> None:
    path = fresh("sse")
    url = create_stream(auth_server, path, b"event data")
    token = mint(f"read:{path}")
    params = {"offset": "-1", "live": "sse", "access_token": token}
    with requests.get(url, params=params, stream=True, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["Cache-Control"] == "no-cache"
        first = next(response.iter_content(chunk_size=None))
    assert b"event: data" in first
    assert base64.b64encode(b"event data") in first


# -- tokens never reach the logs --------------------------------------------------------


@pytest.mark.parametrize("access_control", ["on", "off"])
def test_tokens_never_appear_in_logs(start_server: StartServer, access_control: str) -> None:
    key = {"PICOMQ_JWT_SECRET": SECRET} if access_control == "on" else {}
    server = start_server(env={**key, "GUNICORN_CMD_ARGS": "--access-logfile -"})
    path = fresh("logged")
    url = create_stream(server, path, b"x")
    valid, invalid = mint(f"read:{path}"), mint(key="wrong-secret-" + "y" * 40)
    requests.get(url, params={"offset": "-1", "access_token": valid, "cursor": "7"})
    requests.get(url, params={"access_token": invalid})
    requests.get(url, headers=bearer(valid))
    requests.get(url, headers=bearer(invalid))
    requests.get(f"{server.url}/nowhere", params={"access_token": valid})
    server.stop()  # flush every log line
    output = server.output()
    assert "GET /v1/stream/" in output and "cursor=7" in output, output[-2000:]
    for token in (valid, invalid):
        for piece in token.split("."):
            assert piece not in output


# -- asymmetric keys and audience -------------------------------------------------------


def pem_pair(private_key: object) -> tuple[str, str]:
    private = private_key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    public = private_key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    return private.decode(), public.decode()


def test_ed25519_public_key_from_a_file(start_server: StartServer, tmp_path: Path) -> None:
    private_pem, public_pem = pem_pair(Ed25519PrivateKey.generate())
    key_file = tmp_path / "picomq.pub.pem"
    key_file.write_text(public_pem)
    server = start_server(env={"PICOMQ_JWT_PUBLIC_KEY": str(key_file)})
    path = fresh("ed")
    url = server.stream_url(path)
    signed = mint(f"create:{path}", key=private_pem, algorithm="EdDSA")
    assert requests.put(url, headers=bearer(signed)).status_code == 201
    assert requests.head(url, headers=bearer(signed)).status_code == 403  # create only
    stranger = mint(f"read:{path}", key=Ed25519PrivateKey.generate(), algorithm="EdDSA")
    assert_refused(requests.head(url, headers=bearer(stranger)), 401, "invalid_token")
    # The public key used as an HMAC secret (algorithm confusion) must not verify.
    header = encode_part(b'{"alg":"HS256","typ":"JWT"}')
    claims = {"scope": f"read:{path}", "exp": int(time.time()) + 600}
    signing_input = f"{header}.{encode_part(json.dumps(claims).encode())}"
    mac = hmac.new(public_pem.encode(), signing_input.encode(), hashlib.sha256).digest()
    forged = f"{signing_input}.{encode_part(mac)}"
    assert_refused(requests.head(url, headers=bearer(forged)), 401, "invalid_token")
    shared = mint(f"read:{path}")  # HS256 with some secret
    assert_refused(requests.head(url, headers=bearer(shared)), 401, "invalid_token")


def test_rsa_public_key_as_pem_text_with_audience(start_server: StartServer) -> None:
    private_pem, public_pem = pem_pair(generate_private_key(public_exponent=65537, key_size=2048))
    server = start_server(
        env={"PICOMQ_JWT_PUBLIC_KEY": public_pem, "PICOMQ_JWT_AUDIENCE": "picomq-test"}
    )
    path = fresh("rsa")
    url = server.stream_url(path)
    good = mint(f"create:{path}", key=private_pem, algorithm="RS256", aud="picomq-test")
    assert requests.put(url, headers=bearer(good)).status_code == 201
    for aud in (None, "someone-else"):
        token = mint(f"read:{path}", key=private_pem, algorithm="RS256", aud=aud)
        assert_refused(requests.head(url, headers=bearer(token)), 401, "invalid_token")


# -- several keys, chosen by kid ---------------------------------------------------------

NEW_SECRET, OLD_SECRET = "new-secret-" + "n" * 40, "old-secret-" + "o" * 40


def signed(key: object, algorithm: str = "HS256", kid: str | None = None, **claims: object) -> str:
    body = {"scope": EVERYTHING, "exp": int(time.time()) + 600, **claims}
    headers = {"kid": kid} if kid is not None else None
    return jwt.encode(body, key, algorithm=algorithm, headers=headers)


def head_status(server: Server, token: str) -> int:
    return requests.head(server.stream_url(fresh("kid")), headers=bearer(token)).status_code


def test_secrets_rotate_by_kid_and_a_retired_key_s_tokens_get_401(
    start_server: StartServer,
) -> None:
    both = json.dumps({"2026-05": NEW_SECRET, "2026-01": OLD_SECRET})
    rotating = start_server(env={"PICOMQ_JWT_SECRET": both})
    assert head_status(rotating, signed(NEW_SECRET, kid="2026-05")) == 404  # let in
    assert head_status(rotating, signed(OLD_SECRET, kid="2026-01")) == 404
    assert head_status(rotating, signed(NEW_SECRET)) == 404  # no kid: the first key
    for refused in (
        signed(OLD_SECRET),
        signed(OLD_SECRET, kid="2026-05"),
        signed(NEW_SECRET, kid="2026-01"),
        signed(NEW_SECRET, kid="2025-09"),
    ):
        assert head_status(rotating, refused) == 401
    retired = start_server(env={"PICOMQ_JWT_SECRET": json.dumps({"2026-05": NEW_SECRET})})
    assert head_status(retired, signed(NEW_SECRET, kid="2026-05")) == 404
    old = signed(OLD_SECRET, kid="2026-01")
    response = requests.get(retired.stream_url("any"), headers=bearer(old))
    assert_refused(response, 401, "invalid_token")
    assert "kid" in response.json()["error"]["message"]


def test_public_keys_of_both_kinds_rotate_by_kid(start_server: StartServer) -> None:
    ed_private, ed_public = pem_pair(Ed25519PrivateKey.generate())
    rsa_private, rsa_public = pem_pair(generate_private_key(public_exponent=65537, key_size=2048))
    keys = json.dumps({"ed": ed_public, "rsa": rsa_public})
    server = start_server(env={"PICOMQ_JWT_PUBLIC_KEY": keys})
    assert head_status(server, signed(ed_private, "EdDSA", kid="ed")) == 404
    assert head_status(server, signed(rsa_private, "RS256", kid="rsa")) == 404
    assert head_status(server, signed(ed_private, "EdDSA")) == 404
    assert head_status(server, signed(rsa_private, "RS256", kid="ed")) == 401
    assert head_status(server, signed(rsa_private, "RS256")) == 401


def test_the_single_key_form_looks_at_no_kid(auth_server: Server) -> None:
    assert head_status(auth_server, signed(SECRET, kid="whatever-the-backend-says")) == 404


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{", "not a JSON object"),
        ("{}", "1 to 8 keys"),
        (json.dumps({str(n): SECRET for n in range(9)}), "1 to 8 keys"),
        ('{"a": "' + SECRET + '", "a": "' + SECRET + '"}', "twice"),
        (json.dumps({"a b": SECRET}), "key ids are"),
        (json.dumps({"a": 7}), "key a: must be a JSON string"),
        (json.dumps({"a": SECRET, "b": "short"}), "key b: must be at least 32 bytes"),
    ],
)
def test_bad_key_sets_stop_the_boot_naming_the_key(value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message) as failure:
        Settings.from_environment({"PICOMQ_JWT_SECRET": value})
    assert SECRET not in str(failure.value) and "short" not in str(failure.value)


def test_a_public_key_set_names_the_key_that_is_not_one() -> None:
    keys = json.dumps({"good": pem_pair(Ed25519PrivateKey.generate())[1], "bad": "/no/such.pem"})
    with pytest.raises(SettingsError, match="key bad: not a readable PEM public key"):
        Settings.from_environment({"PICOMQ_JWT_PUBLIC_KEY": keys})


def test_token_command_signs_with_the_first_key_of_a_set(start_server: StartServer) -> None:
    both = json.dumps({"2026-05": NEW_SECRET, "2026-01": OLD_SECRET})
    result = run_token_command("--scope", "read:**", env={"PICOMQ_JWT_SECRET": both})
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    assert jwt.get_unverified_header(token)["kid"] == "2026-05"
    claims = jwt.decode(token, NEW_SECRET, algorithms=["HS256"])
    assert len(claims["jti"]) >= 16  # so it can be revoked alone
    retired = start_server(env={"PICOMQ_JWT_SECRET": json.dumps({"2026-01": OLD_SECRET})})
    assert head_status(retired, token) == 401


# -- settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"PICOMQ_JWT_SECRET": "short"}, "at least 32 bytes"),
        ({"PICOMQ_JWT_PUBLIC_KEY": "/no/such/key.pem"}, "PEM public key"),
        ({"PICOMQ_JWT_PUBLIC_KEY": "-----BEGIN PUBLIC KEY-----\nAAAA\n"}, "PEM public key"),
        ({"PICOMQ_JWT_SECRET": SECRET, "PICOMQ_JWT_PUBLIC_KEY": "x"}, "not both"),
    ],
)
def test_bad_key_settings_stop_the_boot(environment: dict[str, str], message: str) -> None:
    if "not both" in message:
        environment["PICOMQ_JWT_PUBLIC_KEY"] = pem_pair(Ed25519PrivateKey.generate())[1]
    with pytest.raises(SettingsError, match=message) as failure:
        Settings.from_environment(environment)
    assert "short" not in str(failure.value)  # a secret is never echoed


def test_small_rsa_keys_are_refused() -> None:
    public_pem = pem_pair(generate_private_key(public_exponent=65537, key_size=1024))[1]
    with pytest.raises(SettingsError, match="2048"):
        Settings.from_environment({"PICOMQ_JWT_PUBLIC_KEY": public_pem})


def test_short_secret_stops_the_server_without_printing_it(start_server: StartServer) -> None:
    secret = "tiny-" + uuid.uuid4().hex[:8]
    with pytest.raises(pytest.fail.Exception) as failure:
        start_server(env={"PICOMQ_JWT_SECRET": secret})
    message = str(failure.value)
    assert "PICOMQ_JWT_SECRET" in message and "exited before answering HTTP" in message
    assert secret not in message


# -- the insecure-bind warning ----------------------------------------------------------


def load_gunicorn_config() -> dict:
    environment = {key: value for key, value in os.environ.items() if key.startswith("PICOMQ_")}
    for key in environment:
        del os.environ[key]
    try:
        return runpy.run_path(str(REPO_DIR / "gunicorn.conf.py"))
    finally:
        os.environ.update(environment)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:4437", True),
        ("127.0.0.2:80", True),
        ("localhost:4437", True),
        ("[::1]:4437", True),
        ("unix:/run/picomq.sock", True),
        ("0.0.0.0:4437", False),
        ("[::]:4437", False),
        ("10.0.0.5:4437", False),
        ("203.0.113.7:4437", False),
        ("picomq.example.com:4437", False),
        (":4437", False),
    ],
)
def test_which_bind_addresses_count_as_this_machine(address: str, loopback: bool) -> None:
    assert load_gunicorn_config()["is_loopback"](address) is loopback


def test_no_warning_on_loopback(server: Server) -> None:
    assert "access control off" not in server.output()


# -- the token command ------------------------------------------------------------------


def run_token_command(*arguments: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PICOMQ_")}
    return subprocess.run(
        [sys.executable, "-m", "picomq", "token", *arguments],
        cwd=REPO_DIR,
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_token_command_mints_what_the_server_accepts(auth_server: Server) -> None:
    path = fresh("minted")
    url = create_stream(auth_server, path, b"minted")
    result = run_token_command(
        "--scope", f"read:{path}", "--ttl", "1h", env={"PICOMQ_JWT_SECRET": SECRET}
    )
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    assert claims["scope"] == f"read:{path}"
    assert claims["exp"] - claims["iat"] == 3600
    assert requests.get(url, headers=bearer(token)).content == b"minted"
    assert_refused(requests.delete(url, headers=bearer(token)), 403, "insufficient_scope")


def test_token_command_signs_with_a_private_key_file(tmp_path: Path) -> None:
    private_pem, public_pem = pem_pair(Ed25519PrivateKey.generate())
    key_file = tmp_path / "signing.pem"
    key_file.write_text(private_pem)
    result = run_token_command(
        "--scope", "append:jobs/**", "--ttl", "15m", "--private-key", str(key_file), env={}
    )
    assert result.returncode == 0, result.stderr
    claims = jwt.decode(result.stdout.strip(), public_pem, algorithms=["EdDSA"])
    assert claims["scope"] == "append:jobs/**"
    assert claims["exp"] - claims["iat"] == 900
    named = run_token_command(
        "--scope", "read:x", "--private-key", str(key_file), "--kid", "ed-2026", env={}
    )
    assert jwt.get_unverified_header(named.stdout.strip())["kid"] == "ed-2026"


@pytest.mark.parametrize(
    ("arguments", "env", "message"),
    [
        (["--scope", "raed:x"], {"PICOMQ_JWT_SECRET": SECRET}, "action must be one of"),
        (["--scope", "read:x", "--ttl", "soon"], {"PICOMQ_JWT_SECRET": SECRET}, "duration"),
        (["--scope", "read:x"], {}, "PICOMQ_JWT_SECRET"),
    ],
)
def test_token_command_refuses_mistakes(arguments: list[str], env: dict, message: str) -> None:
    result = run_token_command(*arguments, env=env)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert result.stdout == ""


# -- hostile paths with access control on -----------------------------------------------


@pytest.mark.parametrize("method", ["GET", "PUT", "POST", "DELETE"])
def test_hostile_paths_with_an_all_powerful_token_touch_nothing_outside(
    auth_server: Server, method: str
) -> None:
    marker = f"pmq-escape-{uuid.uuid4().hex[:12]}"
    before = snapshot_ancestors(auth_server.data_dir)
    token = mint()
    problems = []
    for target, answered_by_app in hostile_targets(marker):
        body = b"x" if method in ("POST", "PUT") else b""
        headers = {**OCTETS, **bearer(token)} if body else bearer(token)
        response = send_raw(auth_server, method, target, headers, body)
        problem = json_error_problem(response, method) if answered_by_app else ""
        if not 400 <= response.status < 500:
            problem = f"status {response.status}"
        if problem:
            problems.append(f"{method} {target[:80]!r}: {problem}")
    assert not problems, "\n".join(problems)
    after = snapshot_ancestors(auth_server.data_dir)
    for ancestor, names in after.items():
        assert not [name for name in names if marker in name], ancestor
    assert after[auth_server.data_dir.parent] == before[auth_server.data_dir.parent]
    assert_all_inside(auth_server.data_dir)
