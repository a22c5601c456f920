"""The Durable Streams server conformance suite (npm, run by vitest) against a real PicoMQ,
on local disk and on S3 (a fresh bucket on moto_server); and against several processes
that must answer as one: several workers of one node, two nodes behind nginx.

Needs node and npm; installs the pinned suite with `npm ci` when node_modules is missing or
older than package-lock.json. Deselect with `-m "not conformance"`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from node_tools import npm_ci, require_node_and_npm

if TYPE_CHECKING:
    from conftest import S3Storage, StartNginx, StartServer

CONFORMANCE_DIR = Path(__file__).resolve().parent / "conformance"
EXPECTED_PASSED = 338  # every test of suite 0.3.6, the 6 subscription tests included
LONG_POLL_TIMEOUT = 0.5  # the suite's offset=now long-poll tests must finish within 5 s
VITEST_TIMEOUT_SECONDS = 600
# vitest gives each test 5 s. On moto (a Python server on loopback) the property-based
# tests' hundreds of sequential requests took 4.2-5.0 s on a slower machine (2 x AMD
# EPYC, 2026-12-03), and timed out there on code that passed elsewhere: more time on S3.
S3_TEST_TIMEOUT_MS = 15_000
# Through nginx to two nodes, whose caches each catch up on the other's writes, the
# property-based tests took up to 27 s on 2 loaded cores (2026-12-06), answering right.
SEVERAL_ON_S3_TEST_TIMEOUT_MS = 60_000
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


@pytest.mark.conformance
@pytest.mark.parametrize("backend", ["local", "s3", "local-with-retention"])
def test_conformance_suite(
    backend: str, start_server: StartServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "s3":  # a fresh bucket on the session's moto_server
        storage = request.getfixturevalue("s3_storage")
        server = start_server(
            long_poll_timeout=LONG_POLL_TIMEOUT,
            storage_url=storage.url,
            env={**storage.env, **WEBHOOKS_TO_LOOPBACK},
        )
    elif backend == "local-with-retention":
        server = start_server(
            long_poll_timeout=LONG_POLL_TIMEOUT, env={**RETENTION, **WEBHOOKS_TO_LOOPBACK}
        )
    else:
        server = start_server(long_poll_timeout=LONG_POLL_TIMEOUT, env=WEBHOOKS_TO_LOOPBACK)
    test_timeout_ms = S3_TEST_TIMEOUT_MS if backend == "s3" else None
    assert_suite_passes(server.url, tmp_path, test_timeout_ms)


# Several processes that must answer as one: each stream and subscription is served by
# one member (members.py), and the others forward to it. tests/test_deploy.py shows that
# nginx alternates.


@pytest.mark.conformance
@pytest.mark.parametrize(
    "backend, workers",
    [
        pytest.param("s3", 2, id="s3-2-workers"),
        pytest.param("local", 2, id="local-2-workers"),
        pytest.param("local", 4, id="local-4-workers"),
    ],
)
def test_conformance_suite_on_several_workers(
    backend: str,
    workers: int,
    start_server: StartServer,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    if backend == "s3":
        storage = request.getfixturevalue("s3_storage")
        storage_url, env = storage.url, {**storage.env, **WEBHOOKS_TO_LOOPBACK}
    else:
        storage_url, env = None, WEBHOOKS_TO_LOOPBACK
    server = start_server(
        long_poll_timeout=LONG_POLL_TIMEOUT, storage_url=storage_url, workers=workers, env=env
    )
    test_timeout_ms = SEVERAL_ON_S3_TEST_TIMEOUT_MS if backend == "s3" else None
    assert_suite_passes(server.url, tmp_path, test_timeout_ms)


@pytest.mark.conformance
def test_conformance_suite_on_two_nodes_taking_turns(
    start_server: StartServer, start_nginx: StartNginx, s3_storage: S3Storage, tmp_path: Path
) -> None:
    """Two nodes on one bucket behind nginx, which sends each request to the next node
    (test_deploy.py shows it does, also on one client connection)."""
    nodes = [
        start_server(
            long_poll_timeout=LONG_POLL_TIMEOUT,
            storage_url=s3_storage.url,
            env={**s3_storage.env, **WEBHOOKS_TO_LOOPBACK},
        )
        for _ in range(2)
    ]
    nginx = start_nginx(nodes)
    assert_suite_passes(nginx.url, tmp_path, SEVERAL_ON_S3_TEST_TIMEOUT_MS)


def assert_suite_passes(base_url: str, tmp_path: Path, test_timeout_ms: int | None) -> None:
    """Run the suite against base_url; fail listing the tests that failed unless every one
    of EXPECTED_PASSED passed. vitest's output and report are left in tmp_path."""
    require_node_and_npm(
        "install Node.js 18 or newer with npm "
        "(Debian: apt-get install nodejs npm) to run the conformance suite"
    )
    npm_ci(CONFORMANCE_DIR)
    report_path = tmp_path / "vitest-report.json"
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
