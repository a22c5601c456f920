"""The reserved subscription APIs (`/v1/stream/__ds/...`) against a real PicoMQ.

Webhooks go to a small HTTP receiver in this process on 127.0.0.1; signatures are checked
with the public key from the server's JWKS. Each test uses its own subscription ids and
stream prefix, so tests share this module's server, which may reach loopback receivers
(PICOMQ_WEBHOOK_ALLOWED_NETWORKS); `strict_server` runs with the default, which may not.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import IPv4Address, IPv6Address
from typing import TYPE_CHECKING

import gevent
import pytest
import requests
from conftest import make_server
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from loopback_listener import LoopbackListener
from processes import free_port

import directory
from auth import matches
from directory import Directory, Entry
from settings import Settings
from subscriptions import WebhookSigner
from webhooks import (
    WebhookTarget,
    WebhookUrlRejected,
    check_webhook_url,
    post_webhook,
    retry_delay,
)

if TYPE_CHECKING:
    from conftest import Server, StartServer

WAIT_SECONDS = 10.0
ALLOW_LOOPBACK = {"PICOMQ_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8,::1"}
LOOPBACK = Settings.from_environment(ALLOW_LOOPBACK).webhook_allowed_networks
SIGNATURE = re.compile(r"t=(\d+),kid=([^,]+),ed25519=([A-Za-z0-9_-]+)")
JSON = {"Content-Type": "application/json"}


# -- a webhook receiver -------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    body: dict
    raw: bytes
    signature: str
    host: str  # the Host header


class Receiver:
    """Records every POST; answers with `replies` in turn (the last one repeats).

    `headers` go with every answer (a Location, say).
    """

    def __init__(self, replies: list[tuple[int, dict]], headers: dict[str, str]) -> None:
        self.replies = list(replies)
        self.deliveries: queue.Queue[Delivery] = queue.Queue()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                signature = self.headers.get("Webhook-Signature", "")
                host = self.headers.get("Host", "")
                receiver.deliveries.put(Delivery(json.loads(raw), raw, signature, host))
                status, reply = receiver.replies[0]
                if len(receiver.replies) > 1:
                    receiver.replies.pop(0)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/webhook"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def next(self) -> Delivery:
        try:
            return self.deliveries.get(timeout=WAIT_SECONDS)
        except queue.Empty:
            pytest.fail(f"no webhook delivery within {WAIT_SECONDS} s")

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def make_receiver() -> Iterator[Callable[..., Receiver]]:
    receivers: list[Receiver] = []

    def make(*replies: tuple[int, dict], headers: dict[str, str] | None = None) -> Receiver:
        receiver = Receiver(list(replies) or [(200, {})], headers or {})
        receivers.append(receiver)
        return receiver

    yield make
    for receiver in receivers:
        receiver.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """This module's PicoMQ: local disk, and webhooks may reach the loopback receivers."""
    allowing = make_server(tmp_path_factory.mktemp("picomq-subscriptions"), env=ALLOW_LOOPBACK)
    allowing.start()
    yield allowing
    allowing.stop()


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A PicoMQ with the default settings: webhooks reach public addresses only."""
    strict = make_server(tmp_path_factory.mktemp("picomq-strict"))
    strict.start()
    yield strict
    strict.stop()


# -- helpers ---------------------------------------------------------------------------


def sub_url(server: Server, subscription_id: str, tail: str = "") -> str:
    return server.stream_url(f"__ds/subscriptions/{subscription_id}{tail}")


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def put_subscription(server: Server, subscription_id: str, **config: object) -> requests.Response:
    return requests.put(sub_url(server, subscription_id), json=config, timeout=10)


def create_stream(server: Server, path: str, *messages: dict) -> None:
    body = json.dumps(list(messages))
    response = requests.put(server.stream_url(path), data=body, headers=JSON, timeout=10)
    assert response.status_code == 201, response.text


def append(server: Server, path: str, message: dict) -> str:
    response = requests.post(server.stream_url(path), json=message, timeout=10)
    assert response.status_code in (200, 204), response.text
    return response.headers["Stream-Next-Offset"]


def get_subscription(server: Server, subscription_id: str) -> dict:
    response = requests.get(sub_url(server, subscription_id), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def wait_until(predicate: Callable[[], object], what: str) -> object:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def acked_offsets(server: Server, subscription_id: str) -> dict[str, str]:
    streams = get_subscription(server, subscription_id)["streams"]
    return {stream["path"]: stream["acked_offset"] for stream in streams}


def verify_signature(server: Server, delivery: Delivery) -> str:
    """Check the Ed25519 signature against the server's JWKS; returns the kid."""
    match = SIGNATURE.fullmatch(delivery.signature)
    assert match, delivery.signature
    timestamp, kid, signature = match.groups()
    keys = requests.get(server.stream_url("__ds/jwks.json"), timeout=10).json()["keys"]
    [key] = [key for key in keys if key["kid"] == kid]
    public_key = Ed25519PublicKey.from_public_bytes(decode_base64url(key["x"]))
    public_key.verify(decode_base64url(signature), f"{timestamp}.".encode() + delivery.raw)
    return kid


def decode_base64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def error_code(response: requests.Response) -> str:
    assert response.headers["Content-Type"].startswith("application/json"), response.text
    return response.json()["error"]["code"]


def callback(delivery: Delivery, acks: list[dict], done: bool, token: str | None = None):
    body = delivery.body
    headers = {"Authorization": f"Bearer {token or body['callback_token']}"}
    payload = {"wake_id": body["wake_id"], "generation": body["generation"], "acks": acks,
               "done": done}  # fmt: skip
    return requests.post(body["callback_url"], json=payload, headers=headers, timeout=10)


def tail_of(delivery: Delivery, path: str) -> str:
    [stream] = [stream for stream in delivery.body["streams"] if stream["path"] == path]
    return stream["tail_offset"]


# -- pure functions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("events/*", "events/a", True),
        ("events/*", "events/a/b", False),
        ("events/*", "events", False),
        ("events/**", "events", True),
        ("events/**", "events/a/b/c", True),
        ("**/log", "log", True),
        ("**/log", "a/b/log", True),
        ("**/log", "a/b/logs", False),
        ("a/*/c", "a/b/c", True),
        ("a/*/c", "a/b/x/c", False),
        ("events/sync-*", "events/sync-1", True),
        ("events/sync-*", "events/async-1", False),
        ("a.b/*", "aXb/c", False),
    ],
)
def test_glob_segments(pattern: str, path: str, expected: bool) -> None:
    """A subscription's pattern is matched by auth's matcher, as a token's grants are."""
    assert matches(tuple(pattern.split("/")), tuple(path.split("/"))) is expected


def test_the_directory_is_read_again_once_due_though_no_commit_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member reads the directory again after its last commit: a subscription of which
    no word reached it is learned then, not only at its next commit."""
    monkeypatch.setattr(directory, "REFRESH_SECONDS", 0.2)
    stored: dict[str, Entry] = {}
    reads: list[None] = []

    def load(known: dict[str, Entry]) -> dict[str, Entry]:
        reads.append(None)
        return dict(stored)

    learned_late: list[Entry] = []
    known = Directory(load)
    known.on_learn = learned_late.extend
    assert known.due_after_commit()  # never read
    known.read()
    for _ in range(3):  # three commits before the next read is due: one read for them
        assert not known.due_after_commit()
    entry = Entry("s1", "i1", None, None, frozenset({"a/b"}))
    stored["s1"] = entry  # created through another member, and its word was lost
    deadline = time.monotonic() + 10
    while not learned_late and time.monotonic() < deadline:
        gevent.sleep(0.05)
    gevent.sleep(0.5)  # more than a refresh interval: no other read is due without commits
    assert learned_late == [entry]
    assert len(reads) == 2


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",
        "http://127.9.8.7/hook",
        "http://localhost:3000/hook",
        "https://localhost/hook",
        "http://[::1]:8080/hook",
        "http://[::ffff:127.0.0.1]:8080/hook",
    ],
)
def test_loopback_webhook_urls_need_the_setting(url: str) -> None:
    with pytest.raises(WebhookUrlRejected, match="PICOMQ_WEBHOOK_ALLOWED_NETWORKS"):
        check_webhook_url(url, ())
    check_webhook_url(url, LOOPBACK)


@pytest.mark.parametrize(
    "url",
    [
        "https://93.184.216.34/hook",
        "https://[2606:2800:220:1:248:1893:25c8:1946]/hook",
        "https://[64:ff9b::5db8:d822]/hook",  # NAT64 of 93.184.216.34
        "https://[2002:5db8:d822::1]/hook",  # 6to4 of 93.184.216.34
    ],
)
def test_public_https_webhook_urls_are_allowed(url: str) -> None:
    check_webhook_url(url, ())


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1/hook",
        "https://10.0.0.1/hook",
        "https://172.16.5.4/hook",
        "https://192.168.1.1/hook",
        "https://100.64.0.1/hook",
        "https://169.254.169.254/latest/meta-data",
        "http://169.254.169.254/latest/meta-data",
        "https://[fd00:ec2::254]/latest/meta-data",
        "https://[fe80::1]/hook",
        "https://[fe80::1%25eth0]/hook",
        "https://[fd00::1]/hook",
        "https://[fec0::1]/hook",
        "https://[::ffff:10.0.0.1]/hook",
        "https://[::ffff:169.254.169.254]/hook",
        "https://[64:ff9b::7f00:1]/hook",
        "https://[64:ff9b::a9fe:a9fe]/hook",
        "https://[64:ff9b:1::a00:1]/hook",
        "https://[::127.0.0.1]/hook",
        "https://[::a9fe:a9fe]/hook",
        "https://[2002:7f00:1::1]/hook",
        "https://[2002:a9fe:a9fe::]/hook",
        "https://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/hook",
        "https://0.0.0.0/hook",
        "http://0.0.0.0:8080/hook",
        "https://[::]/hook",
        "https://224.0.0.1/hook",
        "https://[ff02::1]/hook",
        "http://2130706433/hook",
        "http://0x7f.1/hook",
        "http://0x7f000001/hook",
        "http://0177.0.0.1/hook",
        "http://127.1/hook",
        "http://017700000001/hook",
        "http://127.0.0.1./hook",
        "http://93.184.216.34/hook",
        "ftp://127.0.0.1/hook",
        "file:///etc/passwd",
        "http://user:secret@127.0.0.1/hook",
        "http://127.0.0.1:99999/hook",
        "http://127.0.0.1:0/hook",
        "http://127.0.0.1/caf\u00e9",
        "not a url",
        "",
    ],
)
def test_webhook_urls_rejected_even_with_loopback_allowed(url: str) -> None:
    with pytest.raises(WebhookUrlRejected):
        check_webhook_url(url, LOOPBACK)


def test_retry_delay_backs_off_to_a_minute_with_jitter() -> None:
    delays = [retry_delay(attempt) for attempt in range(12)]
    assert 0.8 <= delays[0] <= 1.2
    assert 1.6 <= delays[1] <= 2.4
    assert all(48 <= delay <= 72 for delay in delays[6:])


def test_signer_signs_timestamp_and_body() -> None:
    signer = WebhookSigner(Ed25519PrivateKey.generate())
    header = signer.sign(b'{"a":1}', 1700000000)
    timestamp, kid, signature = SIGNATURE.fullmatch(header).groups()
    assert (timestamp, kid) == ("1700000000", signer.kid)
    assert kid.startswith("ds_")
    public_key = Ed25519PublicKey.from_public_bytes(decode_base64url(signer.jwk()["x"]))
    public_key.verify(decode_base64url(signature), b'1700000000.{"a":1}')
    with pytest.raises(InvalidSignature):
        public_key.verify(decode_base64url(signature), b'1700000001.{"a":1}')


# -- HTTP ----------------------------------------------------------------------------------


def test_jwks_is_an_ed25519_key_set(server: Server) -> None:
    response = requests.get(server.stream_url("__ds/jwks.json"), timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/jwk-set+json")
    [key] = response.json()["keys"]
    assert (key["kty"], key["crv"], key["alg"], key["use"]) == ("OKP", "Ed25519", "EdDSA", "sig")
    assert key["kid"].startswith("ds_")
    assert len(decode_base64url(key["x"])) == 32
    assert "d" not in key


def test_create_confirm_conflict_get_delete(server: Server, make_receiver) -> None:
    receiver = make_receiver()
    subscription_id = unique("sub")
    config = {"type": "webhook", "pattern": f"{unique('p')}/*", "webhook": {"url": receiver.url},
              "lease_ttl_ms": 1000, "description": "test"}  # fmt: skip
    created = put_subscription(server, subscription_id, **config)
    assert created.status_code == 201, created.text
    body = created.json()
    assert "webhook_secret" not in body and "webhook_secret" not in body["webhook"]
    signing = body["webhook"]["signing"]
    assert signing["alg"] == "ed25519" and signing["kid"].startswith("ds_")
    assert signing["jwks_url"] == server.stream_url("__ds/jwks.json")

    assert put_subscription(server, subscription_id, **config).status_code == 200
    assert (
        put_subscription(server, subscription_id, **{**config, "pattern": "x/*"}).status_code == 409
    )
    got = get_subscription(server, subscription_id)
    assert (got["id"], got["type"], got["webhook"]["url"]) == (
        subscription_id,
        "webhook",
        receiver.url,
    )
    assert (got["lease_ttl_ms"], got["description"], got["status"]) == (1000, "test", "active")

    assert requests.delete(sub_url(server, subscription_id), timeout=10).status_code == 204
    missing = requests.get(sub_url(server, subscription_id), timeout=10)
    assert (missing.status_code, error_code(missing)) == (404, "SUBSCRIPTION_NOT_FOUND")
    assert put_subscription(server, subscription_id, **config).status_code == 201


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1/hook", "http://169.254.169.254/", "gopher://127.0.0.1/", "http://x.y/"]
)
def test_unsafe_webhook_url_is_rejected(server: Server, url: str) -> None:
    response = put_subscription(
        server, unique("sub"), type="webhook", pattern="events/*", webhook={"url": url}
    )
    assert (response.status_code, error_code(response)) == (400, "WEBHOOK_URL_REJECTED")


LOOPBACK_SPELLINGS = [
    "http://127.0.0.1:{port}/webhook",
    "http://localhost:{port}/webhook",
    "http://[::1]:{port}/webhook",
    "http://[::ffff:127.0.0.1]:{port}/webhook",
    "http://[64:ff9b::7f00:1]:{port}/webhook",
    "http://[::127.0.0.1]:{port}/webhook",
    "http://[2002:7f00:1::]:{port}/webhook",
    "http://2130706433:{port}/webhook",
    "http://0x7f.1:{port}/webhook",
    "http://0177.0.0.1:{port}/webhook",
    "http://0.0.0.0:{port}/webhook",
]


@pytest.mark.parametrize("spelling", LOOPBACK_SPELLINGS)
def test_loopback_receivers_are_refused_by_default(
    strict_server: Server, make_receiver, spelling: str
) -> None:
    receiver = make_receiver()
    url = spelling.format(port=receiver.port)
    response = put_subscription(strict_server, unique("sub"), type="webhook",
                                pattern=f"{unique('events')}/*", webhook={"url": url})  # fmt: skip
    assert (response.status_code, error_code(response)) == (400, "WEBHOOK_URL_REJECTED")
    assert response.json()["error"]["message"].startswith("webhook.url")


def test_a_loopback_receiver_is_reached_where_the_setting_allows(
    server: Server, strict_server: Server, make_receiver
) -> None:
    receiver = make_receiver((200, {"done": True}))
    prefix = unique("events")
    url = f"http://localhost:{receiver.port}/webhook"  # 127.0.0.1, and ::1 where it has one
    config = {"type": "webhook", "pattern": f"{prefix}/*", "webhook": {"url": url}}
    refused = put_subscription(strict_server, unique("sub"), **config)
    assert (refused.status_code, error_code(refused)) == (400, "WEBHOOK_URL_REJECTED")
    assert put_subscription(server, unique("sub"), **config).status_code == 201
    create_stream(server, f"{prefix}/a", {"n": 1})
    delivery = receiver.next()
    assert delivery.host == f"localhost:{receiver.port}"
    assert [stream["path"] for stream in delivery.body["streams"]] == [f"{prefix}/a"]


def test_each_delivery_checks_the_url_again(start_server: StartServer, make_receiver) -> None:
    """A subscription made while loopback was allowed delivers nothing once it is not."""
    allowing = start_server(env=ALLOW_LOOPBACK)
    receiver = make_receiver((200, {"done": True}))
    subscription_id, prefix = unique("sub"), unique("events")
    created = put_subscription(allowing, subscription_id, type="webhook",
                               pattern=f"{prefix}/*", webhook={"url": receiver.url})  # fmt: skip
    assert created.status_code == 201
    allowing.stop()
    del allowing.env["PICOMQ_WEBHOOK_ALLOWED_NETWORKS"]
    allowing.start()
    create_stream(allowing, f"{prefix}/a", {"n": 1})
    wait_until(
        lambda: get_subscription(allowing, subscription_id)["status"] == "failed",
        "a delivery attempt that fails",
    )
    assert receiver.deliveries.empty()


def test_deliveries_never_go_through_an_environment_proxy(
    start_server: StartServer, make_receiver
) -> None:
    """A proxy would resolve the host itself, after the check: no proxy is ever used."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    proxies = {name: nowhere for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy")}
    proxied = start_server(env={**ALLOW_LOOPBACK, **proxies, "NO_PROXY": "", "no_proxy": ""})
    receiver = make_receiver((200, {"done": True}))
    prefix = unique("events")
    created = put_subscription(proxied, unique("sub"), type="webhook", pattern=f"{prefix}/*",
                               webhook={"url": receiver.url})  # fmt: skip
    assert created.status_code == 201
    create_stream(proxied, f"{prefix}/a", {"n": 1})
    assert receiver.next().body["streams"][0]["path"] == f"{prefix}/a"


def test_redirects_are_not_followed(server: Server, make_receiver) -> None:
    elsewhere = make_receiver()
    redirecting = make_receiver((307, {}), headers={"Location": elsewhere.url})
    prefix = unique("events")
    created = put_subscription(server, unique("sub"), type="webhook", pattern=f"{prefix}/*",
                               webhook={"url": redirecting.url})  # fmt: skip
    assert created.status_code == 201
    create_stream(server, f"{prefix}/a", {"n": 1})
    first, retry = redirecting.next(), redirecting.next()  # a 3xx is a failed attempt
    assert retry.body["wake_id"] == first.body["wake_id"]
    assert elsewhere.deliveries.empty()


class TricklingReceiver(LoopbackListener):
    """Takes each POST, then answers one byte a second of a reply it says is 100 long."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}/webhook"

    def serve(self, connection: socket.socket) -> None:
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
            for _ in range(100):
                if self.stopped.wait(1.0):
                    return
                try:
                    connection.sendall(b" ")
                except OSError:
                    return

    def close(self) -> None:
        self.stopped.set()
        super().close()


def test_a_receiver_that_trickles_its_reply_fails_the_attempt_by_the_deadline(
    start_server: StartServer,
) -> None:
    """Each read has a timeout; the attempt as a whole ends by PICOMQ_WEBHOOK_TIMEOUT."""
    server = start_server(env={**ALLOW_LOOPBACK, "PICOMQ_WEBHOOK_TIMEOUT": "1"})
    receiver = TricklingReceiver()
    try:
        prefix = unique("events")
        created = put_subscription(server, unique("sub"), type="webhook", pattern=f"{prefix}/*",
                                   webhook={"url": receiver.url})  # fmt: skip
        assert created.status_code == 201
        create_stream(server, f"{prefix}/a", {"n": 1})
        wait_until(lambda: receiver.connections >= 2, "a second attempt after the first timed out")
    finally:
        receiver.close()


def test_a_post_goes_to_the_checked_address_under_the_urls_host(make_receiver) -> None:
    """No second lookup: `.invalid` never resolves (RFC 6761), yet the POST arrives.

    The receiver listens on 127.0.0.1 only, so [::1] refuses and the next address is tried.
    """
    receiver = make_receiver((200, {"done": True}))
    addresses = (IPv6Address("::1"), IPv4Address("127.0.0.1"))
    target = WebhookTarget("http", "rebinding.invalid", receiver.port, "/webhook?a=1", addresses)
    status, reply = post_webhook(target, b'{"n": 1}', dict(JSON))
    assert (status, json.loads(reply)) == (200, {"done": True})
    delivery = receiver.next()
    assert (delivery.host, delivery.body) == (f"rebinding.invalid:{receiver.port}", {"n": 1})


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b'{"type": "push", "pattern": "a/*"}',
        b'{"type": "webhook", "webhook": {"url": "http://127.0.0.1/"}}',
        b'{"type": "webhook", "pattern": "a/*"}',
        b'{"type": "pull-wake", "pattern": "a/*"}',
        b'{"type": "pull-wake", "pattern": "a/*", "wake_stream": "w", "lease_ttl_ms": 5}',
        b'{"type": "pull-wake", "pattern": "a/*", "wake_stream": "w", "lease_ttl_ms": true}',
        b'{"type": "pull-wake", "pattern": "../*", "wake_stream": "w"}',
        b'{"type": "pull-wake", "pattern": "__ds/*", "wake_stream": "w"}',
        b'{"type": "pull-wake", "streams": ["a", 3], "wake_stream": "w"}',
        b'{"type": "pull-wake", "streams": ["w"], "wake_stream": "w"}',
    ],
)
def test_bad_subscription_bodies_get_400(server: Server, body: bytes) -> None:
    response = requests.put(sub_url(server, unique("sub")), data=body, headers=JSON, timeout=10)
    assert (response.status_code, error_code(response)) == (400, "INVALID_REQUEST")


def test_bad_requests_get_json_4xx(server: Server) -> None:
    bad_id = requests.get(sub_url(server, "-bad-id"), timeout=10)
    assert (bad_id.status_code, error_code(bad_id)) == (400, "INVALID_REQUEST")
    missing = requests.post(sub_url(server, unique("none"), "/claim"), json={"worker": "w"})
    assert (missing.status_code, error_code(missing)) == (404, "SUBSCRIPTION_NOT_FOUND")
    wrong_method = requests.post(sub_url(server, unique("sub")), json={}, timeout=10)
    assert (wrong_method.status_code, error_code(wrong_method)) == (405, "METHOD_NOT_ALLOWED")
    jwks_put = requests.put(server.stream_url("__ds/jwks.json"), timeout=10)
    assert jwks_put.status_code == 405


def test_webhook_delivery_is_signed_and_done_reply_acks(server: Server, make_receiver) -> None:
    receiver = make_receiver((200, {"done": True}))
    subscription_id, prefix = unique("sub"), unique("events")
    created = put_subscription(
        server, subscription_id, type="webhook", pattern=f"{prefix}/*",
        webhook={"url": receiver.url}, lease_ttl_ms=1000,
    )  # fmt: skip
    assert created.status_code == 201
    path = f"{prefix}/orders"
    create_stream(server, path, {"event": "created"})

    delivery = receiver.next()
    assert verify_signature(server, delivery) == created.json()["webhook"]["signing"]["kid"]
    body = delivery.body
    assert body["subscription_id"] == subscription_id
    assert body["callback_url"] == sub_url(server, subscription_id, "/callback")
    assert body["wake_id"] and body["callback_token"] and body["generation"] >= 1
    [stream] = body["streams"]
    assert (stream["path"], stream["link_type"], stream["has_pending"]) == (path, "glob", True)
    assert stream["acked_offset"] == "-1"
    wait_until(
        lambda: acked_offsets(server, subscription_id)[path] == stream["tail_offset"],
        "the done reply to acknowledge the tail",
    )


def first_wake(
    subscribed: Server, written: Server, receiver: Receiver
) -> tuple[str, str, Delivery]:
    """A webhook subscription to `receiver` made through `subscribed`, one stream it
    links created through `written`: the subscription's id, the stream's path and the
    first delivery."""
    subscription_id, prefix = unique("sub"), unique("events")
    put_subscription(subscribed, subscription_id, type="webhook", pattern=f"{prefix}/*",
                     webhook={"url": receiver.url}, lease_ttl_ms=60_000)  # fmt: skip
    path = f"{prefix}/a"
    create_stream(written, path, {"n": 1})
    return subscription_id, path, receiver.next()


def test_webhook_callback_acks_and_fences(server: Server, make_receiver) -> None:
    receiver = make_receiver((200, {}))
    subscription_id, path, first = first_wake(server, server, receiver)
    tail = tail_of(first, path)

    unauthenticated = requests.post(first.body["callback_url"], json={}, timeout=10)
    assert (unauthenticated.status_code, error_code(unauthenticated)) == (401, "TOKEN_INVALID")
    forged = callback(first, [], False, token=first.body["callback_token"] + "x")
    assert (forged.status_code, error_code(forged)) == (401, "TOKEN_INVALID")
    other = path.rsplit("/", 1)[0] + "/other"  # matches the pattern, but not linked
    unlinked = callback(first, [{"stream": other, "offset": tail}], False)
    assert (unlinked.status_code, error_code(unlinked)) == (409, "INVALID_OFFSET")
    beyond = callback(
        first, [{"stream": path, "offset": "0000000000000000_0000000099999999"}], False
    )
    assert (beyond.status_code, error_code(beyond)) == (409, "INVALID_OFFSET")
    heartbeat = callback(first, [], False)
    assert heartbeat.json() == {"ok": True, "next_wake": False}

    # New data while the wake is out: acking only the first tail leaves work, so a new
    # wake (next generation) follows the done callback.
    append(server, path, {"n": 2})
    done = callback(first, [{"stream": path, "offset": tail}], True)
    assert (done.status_code, done.json()) == (200, {"ok": True, "next_wake": True})
    assert acked_offsets(server, subscription_id)[path] == tail
    second = receiver.next()
    assert second.body["generation"] > first.body["generation"]
    assert second.body["wake_id"] != first.body["wake_id"]

    stale = callback(first, [{"stream": path, "offset": tail}], True)
    assert (stale.status_code, error_code(stale)) == (409, "FENCED")
    regress = callback(second, [{"stream": path, "offset": "0000000000000000_0000000000000000"}],
                       False)  # fmt: skip
    assert (regress.status_code, error_code(regress)) == (409, "INVALID_OFFSET")
    final = callback(second, [{"stream": path, "offset": tail_of(second, path)}], True)
    assert final.json() == {"ok": True, "next_wake": False}


def test_webhook_retries_after_a_failed_delivery(server: Server, make_receiver) -> None:
    receiver = make_receiver((500, {}), (200, {"done": True}))
    subscription_id, prefix = unique("sub"), unique("events")
    put_subscription(server, subscription_id, type="webhook", pattern=f"{prefix}/*",
                     webhook={"url": receiver.url})  # fmt: skip
    path = f"{prefix}/a"
    create_stream(server, path, {"n": 1})
    first, retry = receiver.next(), receiver.next()
    assert retry.body["wake_id"] == first.body["wake_id"]
    verify_signature(server, retry)
    wait_until(
        lambda: acked_offsets(server, subscription_id)[path] == tail_of(retry, path),
        "the retried delivery to be acknowledged",
    )
    assert get_subscription(server, subscription_id)["status"] == "active"


def test_explicit_streams_are_added_and_removed(server: Server, make_receiver) -> None:
    receiver = make_receiver()
    subscription_id, prefix = unique("sub"), unique("manual")
    created = put_subscription(server, subscription_id, type="webhook",
                               streams=[f"{prefix}/a"], webhook={"url": receiver.url})  # fmt: skip
    assert created.status_code == 201
    add = requests.post(sub_url(server, subscription_id, "/streams"),
                        json={"streams": [f"{prefix}/b", f"{prefix}/c"]}, timeout=10)  # fmt: skip
    assert add.status_code == 204
    encoded = requests.utils.quote(f"{prefix}/b", safe="")
    remove = requests.delete(sub_url(server, subscription_id, f"/streams/{encoded}"), timeout=10)
    assert remove.status_code == 204
    streams = get_subscription(server, subscription_id)["streams"]
    assert [(s["path"], s["link_type"]) for s in streams] == [
        (f"{prefix}/a", "explicit"),
        (f"{prefix}/c", "explicit"),
    ]
    empty = requests.post(sub_url(server, subscription_id, "/streams"), json={"streams": []})
    assert (empty.status_code, error_code(empty)) == (400, "INVALID_REQUEST")
    missing = requests.post(sub_url(server, unique("none"), "/streams"), json={"streams": ["x"]})
    assert (missing.status_code, error_code(missing)) == (404, "SUBSCRIPTION_NOT_FOUND")

    # An explicitly linked stream wakes the subscription once it gets data.
    create_stream(server, f"{prefix}/c", {"n": 1})
    delivery = receiver.next()
    assert [s["path"] for s in delivery.body["streams"] if s["has_pending"]] == [f"{prefix}/c"]


def test_pattern_links_existing_streams_at_their_tail(server: Server, make_receiver) -> None:
    receiver = make_receiver((200, {"done": True}))
    prefix = unique("events")
    create_stream(server, f"{prefix}/old", {"n": 1})
    tail = append(server, f"{prefix}/old", {"n": 2})
    subscription_id = unique("sub")
    put_subscription(server, subscription_id, type="webhook", pattern=f"{prefix}/*",
                     webhook={"url": receiver.url})  # fmt: skip
    assert acked_offsets(server, subscription_id) == {f"{prefix}/old": tail}
    new_tail = append(server, f"{prefix}/old", {"n": 3})
    delivery = receiver.next()
    [stream] = delivery.body["streams"]
    assert (stream["acked_offset"], stream["tail_offset"]) == (tail, new_tail)


def read_wake_events(server: Server, wake_stream: str, subscription_id: str) -> list[dict]:
    events = requests.get(server.stream_url(wake_stream), timeout=10).json()
    return [event for event in events if event["subscription_id"] == subscription_id]


def claim(server: Server, subscription_id: str, worker: str) -> requests.Response:
    return requests.post(sub_url(server, subscription_id, "/claim"), json={"worker": worker})


def pull_request(server: Server, subscription_id: str, action: str, claimed: dict, **extra):
    body = {"wake_id": claimed["wake_id"], "generation": claimed["generation"], **extra}
    headers = {"Authorization": f"Bearer {claimed['token']}"}
    return requests.post(sub_url(server, subscription_id, f"/{action}"), json=body,
                         headers=headers, timeout=10)  # fmt: skip


def test_pull_wake_claim_ack_release(server: Server) -> None:
    subscription_id, prefix, wake_stream = unique("pull"), unique("events"), unique("wake/pool")
    create_stream(server, wake_stream)
    created = put_subscription(server, subscription_id, type="pull-wake", pattern=f"{prefix}/*",
                               wake_stream=wake_stream, lease_ttl_ms=60_000)  # fmt: skip
    assert created.status_code == 201
    nothing = claim(server, subscription_id, "worker-1")
    assert (nothing.status_code, error_code(nothing)) == (409, "NO_PENDING_WORK")

    path = f"{prefix}/a"
    create_stream(server, path, {"event": "created"})
    [event] = wait_until(lambda: read_wake_events(server, wake_stream, subscription_id), "a wake")
    assert (event["type"], event["stream"]) == ("wake", path)
    assert isinstance(event["generation"], int) and isinstance(event["ts"], int)

    first = claim(server, subscription_id, "worker-1")
    assert first.status_code == 200, first.text
    claimed = first.json()
    assert (claimed["generation"], claimed["lease_ttl_ms"]) == (event["generation"], 60_000)
    [stream] = claimed["streams"]
    busy = claim(server, subscription_id, "worker-2")
    assert (busy.status_code, error_code(busy)) == (409, "ALREADY_CLAIMED")
    assert busy.json()["error"]["current_holder"] == "worker-1"

    acks = [{"stream": path, "offset": stream["tail_offset"]}]
    ack = pull_request(server, subscription_id, "ack", claimed, acks=acks, done=True)
    assert (ack.status_code, ack.json()) == (200, {"ok": True, "next_wake": False})
    assert acked_offsets(server, subscription_id)[path] == stream["tail_offset"]
    stale = pull_request(server, subscription_id, "ack", claimed, acks=acks, done=True)
    assert (stale.status_code, error_code(stale)) == (409, "FENCED")

    append(server, path, {"event": "second"})
    second = claim(server, subscription_id, "worker-1")
    assert second.status_code == 200, second.text
    claimed2 = second.json()
    assert claimed2["generation"] > claimed["generation"]
    old_release = pull_request(server, subscription_id, "release", claimed)
    assert (old_release.status_code, error_code(old_release)) == (409, "FENCED")
    release = pull_request(server, subscription_id, "release", claimed2)
    assert release.status_code == 204
    # Released with data still pending: the next wake is announced at once.
    wait_until(
        lambda: len(read_wake_events(server, wake_stream, subscription_id)) >= 3,
        "a wake after release",
    )
    assert claim(server, subscription_id, "worker-2").status_code == 200


def test_pull_wake_lease_expiry_fences_the_old_holder(server: Server) -> None:
    subscription_id, prefix, wake_stream = unique("pull"), unique("events"), unique("wake")
    create_stream(server, wake_stream)
    put_subscription(server, subscription_id, type="pull-wake", pattern=f"{prefix}/*",
                     wake_stream=wake_stream, lease_ttl_ms=1000)  # fmt: skip
    create_stream(server, f"{prefix}/a", {"n": 1})
    claimed = claim(server, subscription_id, "slow").json()
    taken = wait_until(
        lambda: (
            (response := claim(server, subscription_id, "fast")).status_code == 200
            and response.json()
        ),
        "the lease to expire",
    )
    assert taken["generation"] > claimed["generation"]
    late = pull_request(server, subscription_id, "ack", claimed, done=True)
    assert (late.status_code, error_code(late)) == (409, "FENCED")


@pytest.fixture(params=["local", "s3"])
def restartable_server(request: pytest.FixtureRequest, start_server: StartServer) -> Server:
    """A PicoMQ of its own, on local disk or on a fresh bucket of the session's moto S3."""
    if request.param == "local":
        return start_server(env=ALLOW_LOOPBACK)
    endpoint = request.getfixturevalue("moto_s3")
    bucket = unique("subscriptions")
    assert requests.put(f"{endpoint}/{bucket}", timeout=10).status_code == 200
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}  # fmt: skip
    return start_server(storage_url=f"s3://{bucket}/picomq", env={**env, **ALLOW_LOOPBACK})


def test_subscriptions_survive_a_restart(restartable_server: Server, make_receiver) -> None:
    server = restartable_server
    receiver = make_receiver((200, {"done": True}))
    webhook_id, pull_id = unique("sub"), unique("pull")
    prefix, wake_stream = unique("events"), unique("wake")
    create_stream(server, wake_stream)
    webhook_config = {"type": "webhook", "pattern": f"{prefix}/*", "streams": ["manual/x"],
                      "webhook": {"url": receiver.url}}  # fmt: skip
    pull_config = {"type": "pull-wake", "pattern": f"{prefix}/*", "wake_stream": wake_stream}
    assert put_subscription(server, webhook_id, **webhook_config).status_code == 201
    assert put_subscription(server, pull_id, **pull_config).status_code == 201
    path = f"{prefix}/a"
    create_stream(server, path, {"n": 1})
    delivered = receiver.next()
    wait_until(lambda: acked_offsets(server, webhook_id)[path] != "-1", "the webhook ack")
    claimed = claim(server, pull_id, "worker").json()
    acks = [{"stream": path, "offset": tail_of(delivered, path)}]
    assert pull_request(server, pull_id, "ack", claimed, acks=acks, done=True).status_code == 200
    before = {sid: get_subscription(server, sid) for sid in (webhook_id, pull_id)}
    kid = verify_signature(server, delivered)

    server.restart()

    after = {sid: get_subscription(server, sid) for sid in (webhook_id, pull_id)}
    # The restarted server takes each subscription over, and a generation number with it.
    assert {sid: body.pop("generation") > before[sid].pop("generation")
            for sid, body in after.items()} == {webhook_id: True, pull_id: True}  # fmt: skip
    assert after == before
    assert put_subscription(server, webhook_id, **webhook_config).status_code == 200
    assert put_subscription(server, pull_id, **pull_config).status_code == 200
    append(server, path, {"n": 2})
    again = receiver.next()
    assert verify_signature(server, again) == kid
    assert again.body["generation"] > delivered.body["generation"]
    assert [s["acked_offset"] for s in again.body["streams"] if s["path"] == path] == [
        tail_of(delivered, path)
    ]
    reclaimed = claim(server, pull_id, "worker")
    assert reclaimed.status_code == 200, reclaimed.text
    assert reclaimed.json()["generation"] > claimed["generation"]


def test_unlinking_explicitly_keeps_a_pattern_match(server: Server, make_receiver) -> None:
    receiver = make_receiver((200, {"done": True}))
    subscription_id, prefix = unique("sub"), unique("events")
    path = f"{prefix}/a"
    put_subscription(server, subscription_id, type="webhook", pattern=f"{prefix}/*",
                     streams=[path], webhook={"url": receiver.url})  # fmt: skip
    create_stream(server, path, {"n": 1})
    tail = tail_of(receiver.next(), path)
    wait_until(lambda: acked_offsets(server, subscription_id)[path] == tail, "the done ack")
    encoded = requests.utils.quote(path, safe="")
    assert (
        requests.delete(sub_url(server, subscription_id, f"/streams/{encoded}")).status_code == 204
    )
    [stream] = get_subscription(server, subscription_id)["streams"]
    assert (stream["link_type"], stream["acked_offset"]) == ("glob", tail)


def test_a_recreated_stream_is_read_from_its_start(server: Server, make_receiver) -> None:
    receiver = make_receiver((200, {"done": True}))
    subscription_id, prefix = unique("sub"), unique("events")
    path = f"{prefix}/a"
    put_subscription(server, subscription_id, type="webhook", pattern=f"{prefix}/*",
                     webhook={"url": receiver.url})  # fmt: skip
    create_stream(server, path, {"n": 1}, {"n": 2})
    first = receiver.next()
    wait_until(lambda: acked_offsets(server, subscription_id)[path] != "-1", "the done ack")
    assert requests.delete(server.stream_url(path), timeout=10).status_code == 204
    create_stream(server, path, {"n": 1})
    [stream] = receiver.next().body["streams"]
    assert (stream["acked_offset"], stream["has_pending"]) == ("-1", True)
    assert stream["tail_offset"] < tail_of(first, path)


def test_preflight_allows_json_and_authorization(server: Server) -> None:
    response = requests.options(sub_url(server, "any", "/callback"), timeout=10)
    assert response.status_code == 204
    assert "Authorization" in response.headers["Access-Control-Allow-Headers"]
    assert response.headers["Access-Control-Allow-Origin"] == "*"


def test_webhook_is_redelivered_when_its_lease_runs_out(server: Server, make_receiver) -> None:
    receiver = make_receiver((200, {}))
    subscription_id, prefix = unique("sub"), unique("events")
    put_subscription(server, subscription_id, type="webhook", pattern=f"{prefix}/*",
                     webhook={"url": receiver.url}, lease_ttl_ms=1000)  # fmt: skip
    create_stream(server, f"{prefix}/a", {"n": 1})
    first, second = receiver.next(), receiver.next()  # no callback: the lease expires
    assert second.body["generation"] > first.body["generation"]
    late = callback(first, [], True)
    assert (late.status_code, error_code(late)) == (409, "FENCED")
    done = callback(
        second, [{"stream": f"{prefix}/a", "offset": tail_of(second, f"{prefix}/a")}], True
    )
    assert done.json() == {"ok": True, "next_wake": False}


# -- several processes: one serves each subscription, the others forward to it ----------

NODE_LEASE_SECONDS = 2.0  # short, so a test waits out a member's lease quickly


@pytest.fixture
def two_nodes(start_server: StartServer) -> tuple[Server, Server]:
    """Two PicoMQs of one worker each on one data directory. A request about a
    subscription that reaches the node that does not serve it must be forwarded; a node
    that answered it from its own view would answer FENCED, or wake a second time."""
    env = {**ALLOW_LOOPBACK, "PICOMQ_LEASE_SECONDS": str(NODE_LEASE_SECONDS)}
    first = start_server(workers=1, env=env)
    second = start_server(storage_url=str(first.data_dir), workers=1, env=env)
    return first, second


def through(node: Server, delivery: Delivery) -> Delivery:
    """The delivery with its callback URL sent to `node` instead of the creating one."""
    path = delivery.body["callback_url"].split("/v1/stream/", 1)[1]
    body = {**delivery.body, "callback_url": node.stream_url(path)}
    return Delivery(body, delivery.raw, delivery.signature, delivery.host)


def test_pull_wake_means_the_same_through_either_node(two_nodes: tuple[Server, Server]) -> None:
    first, second = two_nodes
    subscription_id, prefix, wake_stream = unique("pull"), unique("events"), unique("wake")
    create_stream(first, wake_stream)
    put_subscription(first, subscription_id, type="pull-wake", pattern=f"{prefix}/*",
                     wake_stream=wake_stream, lease_ttl_ms=60_000)  # fmt: skip
    path = f"{prefix}/a"
    create_stream(second, path, {"n": 1})
    wait_until(lambda: read_wake_events(first, wake_stream, subscription_id), "a wake")

    claimed = claim(first, subscription_id, "worker-1").json()
    busy = claim(second, subscription_id, "worker-2")
    assert (busy.status_code, error_code(busy)) == (409, "ALREADY_CLAIMED")
    [stream] = claimed["streams"]
    acks = [{"stream": path, "offset": stream["tail_offset"]}]
    heartbeat = pull_request(second, subscription_id, "ack", claimed)
    assert (heartbeat.status_code, heartbeat.json()) == (200, {"ok": True, "next_wake": False})
    done = pull_request(second, subscription_id, "ack", claimed, acks=acks, done=True)
    assert (done.status_code, done.json()) == (200, {"ok": True, "next_wake": False})
    assert acked_offsets(first, subscription_id) == {path: stream["tail_offset"]}
    assert acked_offsets(second, subscription_id) == {path: stream["tail_offset"]}
    stale = pull_request(first, subscription_id, "ack", claimed, acks=acks, done=True)
    assert (stale.status_code, error_code(stale)) == (409, "FENCED")

    append(first, path, {"n": 2})
    again = claim(second, subscription_id, "worker-2")
    assert again.status_code == 200, again.text
    released = pull_request(first, subscription_id, "release", again.json())
    assert released.status_code == 204
    events = wait_until(
        lambda: len(found := read_wake_events(second, wake_stream, subscription_id)) >= 3 and found,
        "a wake after the release",
    )
    last = claim(first, subscription_id, "worker-1")
    assert last.status_code == 200, last.text
    # One wake event per wake: no node woke the subscription on its own.
    events = read_wake_events(second, wake_stream, subscription_id)
    generations = [event["generation"] for event in events]
    assert len(generations) == 3 and generations == sorted(set(generations)), events
    assert last.json()["generation"] == generations[-1]


def test_a_webhook_callback_through_the_other_node(
    two_nodes: tuple[Server, Server], make_receiver
) -> None:
    first, second = two_nodes
    receiver = make_receiver((200, {}))
    subscription_id, path, delivery = first_wake(first, second, receiver)
    delivery = through(second, delivery)

    heartbeat = callback(delivery, [], False)
    assert (heartbeat.status_code, heartbeat.json()) == (200, {"ok": True, "next_wake": False})
    done = callback(delivery, [{"stream": path, "offset": tail_of(delivery, path)}], True)
    assert (done.status_code, done.json()) == (200, {"ok": True, "next_wake": False})
    assert acked_offsets(first, subscription_id) == {path: tail_of(delivery, path)}
    append(first, path, {"n": 2})
    append(second, path, {"n": 3})
    following = through(first, receiver.next())
    assert following.body["generation"] > delivery.body["generation"]
    final = callback(following, [{"stream": path, "offset": tail_of(following, path)}], True)
    assert final.status_code == 200, final.text
    if final.json()["next_wake"]:  # the third append came after the wake reported its tail
        last = receiver.next()
        callback(last, [{"stream": path, "offset": tail_of(last, path)}], True)
    time.sleep(NODE_LEASE_SECONDS / 2)  # time for a second waker, if there were one
    assert receiver.deliveries.empty()


def test_a_paused_node_cannot_complete_a_wake_another_took_over(
    two_nodes: tuple[Server, Server], make_receiver
) -> None:
    first, second = two_nodes
    receiver = make_receiver((200, {}))
    subscription_id, path, paused = first_wake(first, first, receiver)

    os.killpg(first.pid, signal.SIGSTOP)  # the node that serves the subscription
    try:
        time.sleep(NODE_LEASE_SECONDS + 1)
        assert acked_offsets(second, subscription_id) == {path: "-1"}  # second takes it over
        taken = through(second, receiver.next())
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert taken.body["generation"] > paused.body["generation"]

    late = callback(paused, [{"stream": path, "offset": tail_of(paused, path)}], True)
    assert (late.status_code, error_code(late)) == (409, "FENCED")
    assert acked_offsets(first, subscription_id) == {path: "-1"}
    done = callback(taken, [{"stream": path, "offset": tail_of(taken, path)}], True)
    assert (done.status_code, done.json()) == (200, {"ok": True, "next_wake": False})


def test_a_node_that_dies_mid_wake_loses_nothing(
    two_nodes: tuple[Server, Server], make_receiver
) -> None:
    first, second = two_nodes
    receiver = make_receiver((200, {}))
    subscription_id, path, lost = first_wake(first, first, receiver)

    first.kill9()
    # Any request about the subscription reaches a node that takes it over, and with it
    # the wake that died: delivered again, with no new data and long before its lease.
    assert acked_offsets(second, subscription_id) == {path: "-1"}
    again = through(second, receiver.next())
    assert again.body["generation"] > lost.body["generation"]
    assert tail_of(again, path) == tail_of(lost, path)
    late = callback(through(second, lost), [], True)
    assert (late.status_code, error_code(late)) == (409, "FENCED")
    done = callback(again, [{"stream": path, "offset": tail_of(again, path)}], True)
    assert (done.status_code, done.json()) == (200, {"ok": True, "next_wake": False})
