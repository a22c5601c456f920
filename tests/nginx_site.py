"""The shipped nginx site (deploy/nginx-picomq.conf) as tests run it: in front of one
PicoMQ, or of several that nginx takes in turn, request by request.

nginx picks an upstream server for each request (round-robin, its default), whichever
client connection the request came on; the site's upstream keep-alive only reuses a
connection to the server already picked. One nginx worker process keeps one turn for
all requests, so consecutive requests alternate between the servers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

DEPLOY_DIR = Path(__file__).resolve().parent.parent / "deploy"
SHIPPED_UPSTREAM_SERVER = "server 127.0.0.1:4437;"
# Each proxied request holds two: the client's connection and one to a PicoMQ.
WORKER_CONNECTIONS = 1024


def nginx_config(base_dir: Path, site: str, port: int) -> Path:
    """A main nginx.conf, all under base_dir, that includes the site as given.

    Its access log (base_dir/access.log) names the request id, the status, the URI, the
    PicoMQ that answered and the client connection's serial number.
    """
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
events {{ worker_connections {WORKER_CONNECTIONS}; }}
http {{
    log_format ids '$request_id $status $request_uri $upstream_addr $connection';
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


def site_for(picomq_ports: Sequence[int], port: int) -> str:
    """The shipped site with only its addresses changed: listening on 127.0.0.1:port, its
    upstream the PicoMQs on picomq_ports (one or more)."""
    site = (DEPLOY_DIR / "nginx-picomq.conf").read_text()
    upstream_servers = "\n    ".join(
        f"server 127.0.0.1:{picomq_port};" for picomq_port in picomq_ports
    )
    for old, new in (
        (SHIPPED_UPSTREAM_SERVER, upstream_servers),
        ("listen 80;", f"listen 127.0.0.1:{port};"),
        ("listen [::]:80;", ""),
    ):
        assert site.count(old) == 1, old
        site = site.replace(old, new)
    return site
