"""The web inspector in a real headless Chromium (Debian's package, driven by Node's
playwright-core): load the page, open a stream, see an append appear live, restart the
server, and see the next appends appear once each, resumed from the shown offset.

With access control on, the page and its script load without a token, and the page
takes one in its Token field and never shows it. Needs node, npm and /usr/bin/chromium
(test.sh installs them as root on Debian).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests
from node_tools import NODE_DIR, drive_through_restart, install_node_packages, require_chromium

from auth import mint_token

if TYPE_CHECKING:
    from conftest import StartServer

DRIVER_TIMEOUT_SECONDS = 180
JWT_SECRET = "inspector-test-secret-of-at-least-32-bytes"


def test_page_is_served_with_its_scripts_even_with_access_control_on(
    start_server: StartServer,
) -> None:
    server = start_server(env={"PICOMQ_JWT_SECRET": JWT_SECRET})
    page = requests.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200
    assert page.headers["Content-Type"].startswith("text/html")
    directives = dict(
        part.strip().partition(" ")[::2]
        for part in page.headers["Content-Security-Policy"].split(";")
    )
    nonce = re.fullmatch(r"'nonce-([\w-]{16,})'", directives["script-src"])
    assert nonce is not None, directives  # no 'self': streams are served from this origin
    assert directives["style-src"] == directives["script-src"]
    assert directives["default-src"] == "'none'" and page.headers["Cache-Control"] == "no-store"
    for asset in ("/static/inspector.js", "/static/inspector.css"):
        assert re.search(f'nonce="{nonce.group(1)}"[^>]*"{asset}"', page.text), asset
        assert requests.get(f"{server.url}{asset}", timeout=10).status_code == 200
    again = requests.get(f"{server.url}/", timeout=10).headers["Content-Security-Policy"]
    assert nonce.group(0) not in again, "the nonce is the same for two answers"


def test_no_stream_runs_as_a_page_or_as_the_inspectors_script(
    start_server: StartServer, unique_stream: str, tmp_path: Path
) -> None:
    """Anyone who may create a stream writes its bytes, served from this origin: in a
    browser they must run neither as a page of their own nor in the inspector's page."""
    require_chromium()
    install_node_packages()
    server = start_server()
    streams = {
        f"{unique_stream}-page": ("text/html", b"<script>document.title = 'ran'</script>"),
        f"{unique_stream}-script": ("text/javascript", b"window.ran = true;"),
    }
    for path, (content_type, body) in streams.items():
        response = requests.put(
            server.stream_url(path), data=body, headers={"Content-Type": content_type}
        )
        assert response.status_code == 201, response.content
    screenshot = tmp_path / "sandbox.png"
    result = subprocess.run(
        ["node", str(NODE_DIR / "sandbox.mjs"), server.url, *streams, str(screenshot)],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_SECONDS,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n(screenshot: {screenshot})"
    assert result.stdout.startswith("OK "), result.stdout


@pytest.mark.parametrize("access_control", ["off", "on"])
def test_inspector_follows_live_and_resumes_after_a_restart(
    start_server: StartServer, unique_stream: str, tmp_path: Path, access_control: str
) -> None:
    require_chromium()
    install_node_packages()
    token_argument: list[str] = []
    headers = {"Content-Type": "application/json"}
    if access_control == "on":
        server = start_server(env={"PICOMQ_JWT_SECRET": JWT_SECRET})
        token = mint_token(JWT_SECRET, "HS256", "read:** append:** admin:v1/streams", 600)
        token_argument = [token]
        headers["Authorization"] = f"Bearer {token}"
        assert requests.get(f"{server.url}/v1/streams", timeout=10).status_code == 401
    else:
        server = start_server()
    url = server.stream_url(unique_stream)
    create_token = mint_token(JWT_SECRET, "HS256", "create:**", 60)
    create_headers = {**headers, "Authorization": f"Bearer {create_token}"}
    assert requests.put(url, headers=create_headers).status_code == 201
    response = requests.post(url, json=[{"n": 1}, {"n": 2}], headers=headers)
    assert response.status_code == 204

    screenshot = tmp_path / "inspector.png"
    command = [
        "node",
        str(NODE_DIR / "inspector.mjs"),
        server.url,
        unique_stream,
        str(screenshot),
        *token_argument,
    ]

    def crash_and_start() -> None:
        server.kill9()  # the connection drops as in a crash; acknowledged data stays
        server.start()

    returncode, _, errors = drive_through_restart(command, crash_and_start, DRIVER_TIMEOUT_SECONDS)
    assert returncode == 0, f"{errors}\n(screenshot: {screenshot})"
