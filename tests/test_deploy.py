"""deploy/: the nginx site in front of a real PicoMQ (SSE events pass unbuffered, long-poll
and request ids pass through, metrics stay local) and the systemd unit's stop timeout.

Needs Debian's nginx (test.sh installs it as root on Debian).
"""

from __future__ import annotations

import configparser
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests
from conftest import REPO_DIR, ManagedProcess
from processes import free_port

if TYPE_CHECKING:
    from conftest import Server

DEPLOY_DIR = REPO_DIR / "deploy"
JSON = "application/json"
READ_TIMEOUT_SECONDS = 10  # far below the SSE response's own 60 s: buffering would show


def nginx_config(base_dir: Path, site: str, port: int) -> Path:
    """A main nginx.conf, all under base_dir, that includes the site as shipped."""
    for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (base_dir / name).mkdir()
    (base_dir / "site.conf").write_text(site)
    user = "user root;" if os.geteuid() == 0 else ""
    config = base_dir / "nginx.conf"
    config.write_text(f"""
{user}
daemon off;
worker_processes 1;
pid {base_dir}/nginx.pid;
error_log {base_dir}/error.log;
events {{ worker_connections 256; }}
http {{
    log_format ids '$request_id $status $request_uri';
    access_log {base_dir}/access.log ids;
    client_body_temp_path {base_dir}/body;
    proxy_temp_path {base_dir}/proxy;
    fastcgi_temp_path {base_dir}/fastcgi;
    uwsgi_temp_path {base_dir}/uwsgi;
    scgi_temp_path {base_dir}/scgi;
    include {base_dir}/site.conf;
}}
""")
    return config


def site_for(picomq_port: int, port: int) -> str:
    """The shipped site with only its addresses changed to this test's ports."""
    site = (DEPLOY_DIR / "nginx-picomq.conf").read_text()
    for old, new in (
        ("server 127.0.0.1:4437;", f"server 127.0.0.1:{picomq_port};"),
        ("listen 80;", f"listen 127.0.0.1:{port};"),
        ("listen [::]:80;", ""),
    ):
        assert site.count(old) == 1, old
        site = site.replace(old, new)
    return site


@pytest.fixture
def proxied(server: Server, tmp_path: Path) -> Iterator[tuple[Server, str]]:
    """The session's PicoMQ behind the shipped nginx site; yields it and nginx's URL."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        pytest.fail("nginx not found: run ./test.sh (installs it as root on Debian)")
    port = free_port()
    picomq_port = int(server.url.rsplit(":", 1)[1])
    config = nginx_config(tmp_path, site_for(picomq_port, port), port)
    managed = ManagedProcess(
        name="nginx",
        command=[nginx, "-c", str(config), "-p", str(tmp_path)],
        cwd=tmp_path,
        env=dict(os.environ),
        log_path=tmp_path / "nginx.out",
        port=port,
        readiness_path="/healthz",
    )
    managed.start()
    yield server, f"http://127.0.0.1:{port}"
    managed.stop()


def test_sse_events_pass_through_nginx_unbuffered(
    proxied: tuple[Server, str], unique_stream: str
) -> None:
    server, proxy = proxied
    url = f"{proxy}/v1/stream/{unique_stream}"
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
    proxied: tuple[Server, str], unique_stream: str, tmp_path: Path
) -> None:
    server, proxy = proxied
    url = f"{proxy}/v1/stream/{unique_stream}"
    requests.put(url, headers={"Content-Type": JSON}, timeout=10)
    requests.post(url, data=b"[1]", headers={"Content-Type": JSON}, timeout=10)
    answer = requests.get(url, params={"offset": "-1", "live": "long-poll"}, timeout=10)
    assert answer.status_code == 200 and answer.json() == [1]
    generated = answer.headers["X-Request-Id"]
    logged = (tmp_path / "access.log").read_text().splitlines()
    assert any(line.startswith(f"{generated} 200 ") for line in logged)  # nginx's own id
    given = requests.get(f"{proxy}/healthz", headers={"X-Request-Id": "abc-123"}, timeout=10)
    assert given.headers["X-Request-Id"] == "abc-123"


def test_metrics_are_served_to_this_machine_only(proxied: tuple[Server, str]) -> None:
    _, proxy = proxied
    response = requests.get(f"{proxy}/metrics", timeout=10)
    assert response.status_code == 200  # the test connects from 127.0.0.1
    assert "picomq_reads_total" in response.text
    assert "deny all;" in (DEPLOY_DIR / "nginx-picomq.conf").read_text()


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
