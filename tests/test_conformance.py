"""The Durable Streams server conformance suite (npm, run by vitest) against a real PicoMQ,
on local disk and on S3 (a fresh bucket on moto_server).

Needs node and npm; installs the pinned suite with `npm ci` when node_modules is missing or
older than package-lock.json. Deselect with `-m "not conformance"`.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from node_tools import npm_ci, require_node_and_npm

if TYPE_CHECKING:
    from conftest import StartServer

CONFORMANCE_DIR = Path(__file__).resolve().parent / "conformance"
EXPECTED_PASSED = 338  # every test of suite 0.3.6, the 6 subscription tests included
LONG_POLL_TIMEOUT = 0.5  # the suite's offset=now long-poll tests must finish within 5 s
VITEST_TIMEOUT_SECONDS = 600
# vitest gives each test 5 s. On moto (a Python server on loopback) the property-based
# tests' hundreds of sequential requests took 4.2-5.0 s on a slower machine (2 x AMD
# EPYC, 2026-12-03), and timed out there on code that passed elsewhere: more time on S3.
S3_TEST_TIMEOUT_MS = 15_000
MESSAGE_CHARS = 400
MAX_FAILURES_LISTED = 60
OUTPUT_TAIL_CHARS = 4000


def run_vitest(base_url: str, report_path: Path, test_timeout_ms: int | None) -> tuple[int, str]:
    """Run the suite; return vitest's exit code and its console output.

    `test_timeout_ms` replaces vitest's 5 s per test, when given.

    vitest runs in its own process group so a timeout can stop its worker processes too.
    """
    env = dict(os.environ, PICOMQ_URL=base_url, NO_COLOR="1")
    env["PICOMQ_LONG_POLL_MS"] = str(int(LONG_POLL_TIMEOUT * 1000))
    command = [
        str(CONFORMANCE_DIR / "node_modules" / ".bin" / "vitest"),
        "run",
        "--root",
        str(CONFORMANCE_DIR),
        "--reporter=default",
        "--reporter=json",
        f"--outputFile.json={report_path}",
        *([f"--testTimeout={test_timeout_ms}"] if test_timeout_ms else []),
    ]
    process = subprocess.Popen(
        command,
        cwd=CONFORMANCE_DIR,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=VITEST_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # leader not yet reaped: the group is ours
        output, _ = process.communicate()
        tail = output[-OUTPUT_TAIL_CHARS:]
        pytest.fail(f"vitest did not finish within {VITEST_TIMEOUT_SECONDS} s\n{tail}")
    return process.returncode, output


def describe_failure(test: dict) -> str:
    """The test's name and the first lines of its error, without the stack trace."""
    lines = []
    for message in test.get("failureMessages", []):
        lines += [line for line in message.splitlines() if not line.lstrip().startswith("at ")]
    text = "\n    ".join(lines) or "(no message)"
    if "STACK_TRACE_ERROR" in text:
        text += " (vitest's JSON report says this for a test timeout; see vitest's output)"
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + "..."
    return f"- {test.get('fullName')}\n    {text}"


# Generous retention on every stream: the protocol must not notice it.
RETENTION = {"PICOMQ_RETENTION_AGE": "86400", "PICOMQ_RETENTION_BYTES": str(1 << 30)}
# The suite's webhook receivers listen on 127.0.0.1, which webhooks reach only when allowed;
# it also checks that http://10.0.0.1 is refused, so nothing wider is allowed.
WEBHOOKS_TO_LOOPBACK = {"PICOMQ_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32"}


# Several workers, and two nodes on one bucket that nginx takes in turn, request by
# request: every request about a stream or a subscription may reach a process that does
# not serve it, and is forwarded to the one that does.
BACKENDS = ["local", "s3", "local-with-retention", "local-2-workers", "local-4-workers",
            "s3-2-nodes"]  # fmt: skip


@pytest.mark.conformance
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance_suite(
    backend: str, start_server: StartServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    require_node_and_npm(
        "install Node.js 18 or newer with npm "
        "(Debian: apt-get install nodejs npm) to run the conformance suite"
    )
    npm_ci(CONFORMANCE_DIR)
    base_url = start_backend(backend, start_server, request)
    report_path = tmp_path / "vitest-report.json"

    test_timeout_ms = S3_TEST_TIMEOUT_MS if backend.startswith("s3") else None
    returncode, output = run_vitest(base_url, report_path, test_timeout_ms)
    output_path = tmp_path / "vitest-output.txt"
    output_path.write_text(output)
    print(output[-OUTPUT_TAIL_CHARS:])  # vitest's summary, shown by pytest on failure
    if not report_path.exists():
        pytest.fail(f"vitest wrote no report (exit {returncode})\n{output[-OUTPUT_TAIL_CHARS:]}")
    report = json.loads(report_path.read_text())

    tests = [test for suite in report["testResults"] for test in suite["assertionResults"]]
    failed = [test for test in tests if test["status"] == "failed"]
    summary = (
        f"passed {report['numPassedTests']}, failed {report['numFailedTests']}, "
        f"pending {report['numPendingTests']}, total {report['numTotalTests']}"
    )
    failures = "\n".join(describe_failure(test) for test in failed[:MAX_FAILURES_LISTED])
    if len(failed) > MAX_FAILURES_LISTED:
        failures += f"\n... and {len(failed) - MAX_FAILURES_LISTED} more"
    assert report["numFailedTests"] == 0 and report["numPassedTests"] == EXPECTED_PASSED, (
        f"conformance: {summary} (expected {EXPECTED_PASSED} passed)\n"
        f"full output: {output_path}\nfull report: {report_path}\n{failures}"
    )


def start_backend(backend: str, start_server: StartServer, request: pytest.FixtureRequest) -> str:
    """Start the servers `backend` names; the base URL the suite runs against."""
    start = functools.partial(start_server, long_poll_timeout=LONG_POLL_TIMEOUT)
    if backend.startswith("s3"):  # a fresh bucket on the session's moto_server
        storage = request.getfixturevalue("s3_storage")
        env = {**storage.env, **WEBHOOKS_TO_LOOPBACK}
        if backend == "s3":
            return start(storage_url=storage.url, env=env).url
        nodes = [start(storage_url=storage.url, env=env) for _ in range(2)]
        return request.getfixturevalue("start_nginx")(nodes).url
    if backend == "local-with-retention":
        return start(env={**RETENTION, **WEBHOOKS_TO_LOOPBACK}).url
    workers = int(backend.split("-")[1]) if backend.endswith("-workers") else None
    return start(env=WEBHOOKS_TO_LOOPBACK, workers=workers).url
