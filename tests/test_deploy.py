"""deploy/: the nginx site in front of a real PicoMQ (SSE events pass unbuffered, long-poll
and request ids pass through, metrics stay local, URLs handed out keep nginx's port), in
front of two (each request goes to the next) and the systemd unit's stop timeout.

Needs Debian's nginx (test.sh installs it as root on Debian).
"""

from __future__ import annotations

import configparser
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests
from conftest import REPO_DIR
from nginx_site import DEPLOY_DIR

if TYPE_CHECKING:
    from conftest import Nginx, Server, StartNginx, StartServer

JSON = "application/json"
READ_TIMEOUT_SECONDS = 10  # far below the SSE response's own 60 s: buffering would show
APPENDS_IN_TURN = 6


@pytest.fixture
def proxied(server: Server, start_nginx: StartNginx) -> tuple[Server, Nginx]:
    """The session's PicoMQ behind the shipped nginx site."""
    return server, start_nginx([server])


def test_sse_events_pass_through_nginx_unbuffered(
    proxied: tuple[Server, Nginx], unique_stream: str
) -> None:
    _, nginx = proxied
    url = f"{nginx.url}/v1/stream/{unique_stream}"
    assert requests.put(url, headers={"Content-Type": JSON}, timeout=10).status_code == 201
    with requests.get(
        url, params={"offset": "-1", "live": "sse"}, stream=True, timeout=READ_TIMEOUT_SECONDS
    ) as follower:
        assert follower.status_code == 200
        lines = follower.iter_lines(decode_unicode=True)
        assert next(lines) == "event: control"  # where the tail is, sent at once
        response = requests.post(url, data=b'{"live":true}', headers={"Content-Type": JSON})
        assert response.status_code == 204
        # Each line must arrive while the response is still open (it lasts 60 s).
        seen = [next(lines) for _ in range(5)]
    assert seen[2:4] == ["event: data", 'data:[{"live":true}]']


def test_long_poll_and_request_ids_pass_through_nginx(
    proxied: tuple[Server, Nginx], unique_stream: str
) -> None:
    _, nginx = proxied
    url = f"{nginx.url}/v1/stream/{unique_stream}"
    requests.put(url, headers={"Content-Type": JSON}, timeout=10)
    requests.post(url, data=b"[1]", headers={"Content-Type": JSON}, timeout=10)
    answer = requests.get(url, params={"offset": "-1", "live": "long-poll"}, timeout=10)
    assert answer.status_code == 200 and answer.json() == [1]
    generated = answer.headers["X-Request-Id"]
    logged = nginx.access_lines(naming=generated)
    assert any(line.startswith(f"{generated} 200 ") for line in logged)  # nginx's own id
    given = requests.get(f"{nginx.url}/healthz", headers={"X-Request-Id": "abc-123"}, timeout=10)
    assert given.headers["X-Request-Id"] == "abc-123"


def test_metrics_are_served_to_this_machine_only(proxied: tuple[Server, Nginx]) -> None:
    _, nginx = proxied
    response = requests.get(f"{nginx.url}/metrics", timeout=10)
    assert response.status_code == 200  # the test connects from 127.0.0.1
    assert "picomq_reads_total" in response.text
    assert "deny all;" in (DEPLOY_DIR / "nginx-picomq.conf").read_text()


def test_urls_handed_out_through_nginx_keep_its_port(
    proxied: tuple[Server, Nginx], unique_stream: str
) -> None:
    """A webhook's JWKS and callback URLs are built from the Host the client sent: nginx
    must pass it on with its port, or they name port 80 of the same host."""
    _, nginx = proxied
    url = f"{nginx.url}/v1/stream/__ds/subscriptions/{unique_stream.replace('/', '-')}"
    config = {"type": "webhook", "pattern": f"{unique_stream}/*",
              "webhook": {"url": "https://93.184.216.34/hook"}}  # fmt: skip
    created = requests.put(url, json=config, timeout=10)
    assert created.status_code == 201, created.text
    jwks_url = created.json()["webhook"]["signing"]["jwks_url"]
    assert jwks_url == f"{nginx.url}/v1/stream/__ds/jwks.json"
    assert requests.delete(url, timeout=10).status_code == 204


def test_nginx_sends_each_request_of_one_connection_to_the_next_node(
    start_server: StartServer, start_nginx: StartNginx, tmp_path: Path, unique_stream: str
) -> None:
    shared_data_dir = str(tmp_path / "shared")  # two nodes on one store
    nodes = [start_server(storage_url=shared_data_dir) for _ in range(2)]
    nginx = start_nginx(nodes)
    url = f"{nginx.url}/v1/stream/{unique_stream}"
    request_ids = [f"append-{number}" for number in range(APPENDS_IN_TURN)]
    with requests.Session() as client:  # one keep-alive connection to nginx
        assert client.put(url, headers={"Content-Type": JSON}, timeout=10).status_code == 201
        for number, request_id in enumerate(request_ids):
            headers = {"Content-Type": JSON, "X-Request-Id": request_id}
            response = client.post(url, data=f"[{number}]", headers=headers, timeout=10)
            assert response.status_code == 204, response.text
    logged = nginx.access_lines(naming=unique_stream, count=1 + len(request_ids))
    assert len({line.split()[-1] for line in logged}) == 1, logged  # one client connection
    # Which node nginx sent each request to ($upstream_addr); the node may forward it on
    # to the member serving the stream, which its own log would show instead.
    upstreams = [line.split()[3] for line in logged]
    node_addresses = {node.url.removeprefix("http://") for node in nodes}
    assert set(upstreams) == node_addresses, logged
    assert all(map(str.__ne__, upstreams, upstreams[1:])), logged  # each to the next


def test_systemd_waits_longer_than_gunicorns_graceful_stop() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # keys are case-sensitive in systemd units
    unit.read_string((DEPLOY_DIR / "picomq.service").read_text())
    service = unit["Service"]
    namespace: dict[str, object] = {}
    exec((REPO_DIR / "gunicorn.conf.py").read_text(), namespace)
    assert int(service["TimeoutStopSec"]) > namespace["graceful_timeout"]
    assert service["ExecStart"].endswith("gunicorn -c gunicorn.conf.py wsgi:app")
    assert service["KillSignal"] == "SIGTERM"
