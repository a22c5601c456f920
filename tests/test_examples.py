"""examples/agent_run against a real PicoMQ: the backend reports a run's progress as
events with ids, idempotently, and closes the stream; its page, in headless Chromium,
rebuilds the whole run after a reload without starting it again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests
from conftest import REPO_DIR, ManagedProcess
from node_tools import NODE_DIR, install_node_packages, require_chromium
from processes import free_port

if TYPE_CHECKING:
    from conftest import Server, StartServer

STEPS = 6
DRIVER_TIMEOUT_SECONDS = 120


@pytest.fixture
def backend(start_server: StartServer, tmp_path: Path) -> Iterator[tuple[Server, str]]:
    """PicoMQ and the example's backend in front of it; yields both URLs' owner and base."""
    server = start_server()
    port = free_port()
    environment = dict(
        os.environ, PICOMQ_URL=server.url, AGENT_STEPS=str(STEPS), AGENT_STEP_SECONDS="0.4"
    )
    managed = ManagedProcess(
        name="agent-run backend",
        command=[sys.executable, str(REPO_DIR / "examples/agent_run/app.py"), "--port", str(port)],
        cwd=tmp_path,
        env=environment,
        log_path=tmp_path / "backend.log",
        port=port,
        readiness_path="/config.json",
    )
    managed.start()
    yield server, f"http://127.0.0.1:{port}"
    managed.stop()


def read_until_closed(stream_url: str) -> list[dict]:
    events, offset = [], "-1"
    for _ in range(200):  # bounded: each long-poll waits at most 0.5 s
        response = requests.get(
            stream_url, params={"offset": offset, "live": "long-poll"}, timeout=10
        )
        if response.status_code == 200:
            events += response.json()
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Closed") == "true":
            return events
    raise AssertionError(f"stream never closed; read {events}")


def test_backend_reports_each_step_once_and_closes(backend: tuple[Server, str]) -> None:
    _, base = backend
    run = requests.post(f"{base}/runs", timeout=10).json()
    events = read_until_closed(run["stream"])
    assert [event["id"] for event in events] == [f"{run['run']}:{n}" for n in range(STEPS + 2)]
    assert [event["type"] for event in events] == ["started", *["progress"] * STEPS, "finished"]
    assert [event["step"] for event in events] == list(range(STEPS + 1)) + [STEPS]

    # A retried append (same producer and seq, as after a lost answer) is not stored again.
    last = {"Producer-Id": run["run"], "Producer-Epoch": "0", "Producer-Seq": str(STEPS + 1)}
    again = requests.post(
        run["stream"],
        data=json.dumps([events[-1]]),
        headers={"Content-Type": "application/json", "Stream-Closed": "true", **last},
        timeout=10,
    )
    assert again.status_code == 204  # a duplicate: acknowledged, nothing written
    assert read_until_closed(run["stream"]) == events


def test_page_rebuilds_the_run_after_a_reload(backend: tuple[Server, str], tmp_path: Path) -> None:
    require_chromium()
    install_node_packages()
    _, base = backend
    screenshot = tmp_path / "agent-run.png"
    result = subprocess.run(
        ["node", str(NODE_DIR / "agent_run.mjs"), base, str(screenshot)],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_SECONDS,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n(screenshot: {screenshot})"
    assert result.stdout.startswith("OK ") and result.stdout.split()[2] == str(STEPS)
    assert requests.get(f"{base}/runs", timeout=10).json() == {"started": 1}
