"""The web inspector in a real headless Chromium (Debian's package, driven by Node's
playwright-core): load the page, open a stream, see an append appear live, restart the
server, and see the next appends appear once each, resumed from the shown offset.

With access control on, the page and its script load without a token, and the page
takes one in its Token field and never shows it. Needs node, npm and /usr/bin/chromium
(test.sh installs them as root on Debian).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests

from auth import mint_token

if TYPE_CHECKING:
    from conftest import StartServer

NODE_DIR = Path(__file__).resolve().parent / "node"
CHROMIUM = Path("/usr/bin/chromium")
NPM_TIMEOUT_SECONDS = 600
DRIVER_TIMEOUT_SECONDS = 180
JWT_SECRET = "inspector-test-secret-of-at-least-32-bytes"


def install_node_packages() -> None:
    """`npm ci` in tests/node unless node_modules already matches package-lock.json."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: run ./test.sh (installs them as root)")
    lock = NODE_DIR / "package-lock.json"
    installed = NODE_DIR / "node_modules" / ".package-lock.json"
    if installed.exists() and installed.stat().st_mtime >= lock.stat().st_mtime:
        return
    result = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"],
        cwd=NODE_DIR,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=NPM_TIMEOUT_SECONDS,
    )
    if result.returncode != 0:
        pytest.fail(f"npm ci failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


def test_page_is_served_with_its_scripts_even_with_access_control_on(
    start_server: StartServer,
) -> None:
    server = start_server(env={"PICOMQ_JWT_SECRET": JWT_SECRET})
    page = requests.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200
    assert page.headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    for asset in ("/static/inspector.js", "/static/inspector.css"):
        assert asset in page.text
        assert requests.get(f"{server.url}{asset}", timeout=10).status_code == 200


@pytest.mark.parametrize("access_control", ["off", "on"])
def test_inspector_follows_live_and_resumes_after_a_restart(
    start_server: StartServer, unique_stream: str, tmp_path: Path, access_control: str
) -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} not found: run ./test.sh (installs Debian's chromium as root)")
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
    driver = subprocess.Popen(
        [
            "node",
            str(NODE_DIR / "inspector.mjs"),
            server.url,
            unique_stream,
            str(screenshot),
            *token_argument,
        ],
        cwd=NODE_DIR,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # A hung browser ends the test instead of hanging it.
    timer = threading.Timer(DRIVER_TIMEOUT_SECONDS, os.killpg, (driver.pid, signal.SIGKILL))
    timer.start()
    try:
        assert driver.stdout is not None and driver.stdin is not None
        said = driver.stdout.readline().strip()
        assert said == "RESTART", f"driver said {said!r}: {driver.stderr.read()}"
        server.kill9()  # the connection drops as in a crash; acknowledged data stays
        server.start()
        try:
            driver.stdin.write("RESTARTED\n")
            driver.stdin.flush()
        except BrokenPipeError:
            pass  # the driver has failed already: its output below says why
        _, errors = driver.communicate()
    finally:
        timer.cancel()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()  # reaps it and closes the pipes
    assert driver.returncode == 0, f"{errors}\n(screenshot: {screenshot})"
