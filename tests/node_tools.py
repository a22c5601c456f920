"""Node.js for the tests: check node and npm are there, `npm ci` a pinned package directory,
and drive a Node script that asks the test to restart the server half way through."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"
CHROMIUM = Path("/usr/bin/chromium")
NPM_TIMEOUT_SECONDS = 600


def require_node_and_npm(hint: str) -> None:
    """Fail the test, saying `hint`, unless node and npm are on PATH."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: {hint}")


def npm_ci(directory: Path) -> None:
    """`npm ci` in directory unless node_modules already matches package-lock.json."""
    lock = directory / "package-lock.json"
    installed = directory / "node_modules" / ".package-lock.json"  # written by npm
    if installed.exists() and installed.stat().st_mtime >= lock.stat().st_mtime:
        return
    result = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"],
        cwd=directory,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=NPM_TIMEOUT_SECONDS,
    )
    if result.returncode != 0:
        pytest.fail(f"npm ci failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


def install_node_packages() -> None:
    """`npm ci` in tests/node unless node_modules already matches package-lock.json."""
    require_node_and_npm("run ./test.sh (installs them as root)")
    npm_ci(NODE_DIR)


def require_chromium() -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} not found: run ./test.sh (installs Debian's chromium as root)")


def drive_through_restart(
    command: list[str], restart: Callable[[], None], timeout: float
) -> tuple[int, str, str]:
    """Run a Node driver in tests/node that prints RESTART when it wants the server
    restarted and waits for RESTARTED on stdin; return its exit code, stdout and stderr.

    The driver runs in its own process group, killed after `timeout` seconds so a hung
    driver (or browser) ends the test instead of hanging it.
    """
    driver = subprocess.Popen(
        command,
        cwd=NODE_DIR,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(timeout, os.killpg, (driver.pid, signal.SIGKILL))
    timer.start()
    try:
        assert driver.stdout is not None and driver.stdin is not None
        said = driver.stdout.readline().strip()
        assert said == "RESTART", f"driver said {said!r}: {driver.stderr.read()}"
        restart()
        try:
            driver.stdin.write("RESTARTED\n")
            driver.stdin.flush()
        except BrokenPipeError:
            pass  # the driver has failed already: its output says why
        output, errors = driver.communicate()
    finally:
        timer.cancel()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()  # reaps it and closes the pipes
    return driver.returncode, output, errors
