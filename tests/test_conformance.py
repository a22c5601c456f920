"""The Durable Streams server conformance suite (npm, run by vitest) against a real PicoMQ,
on local disk and on S3 (a fresh bucket on moto_server); and against several processes
that must answer as one: several workers of one node, two nodes behind nginx.

The seven runs go in two lanes at once (LANES), each lane with a moto_server of its
own: the runs through several processes on S3 in one, the others in the other. A run
on S3 keeps about one core busy (moto, mostly), one on local disk about half of one.

Needs node and npm; installs the pinned suite with `npm ci` when node_modules is missing or
older than package-lock.json. Deselect with `-m "not conformance"`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import create_bucket, make_moto, make_nginx, make_server, s3_environment
from node_tools import npm_ci, require_node_and_npm

CONFORMANCE_DIR = Path(__file__).resolve().parent / "conformance"
EXPECTED_PASSED = 338  # every test of suite 0.3.6, the 6 subscription tests included
LONG_POLL_TIMEOUT = 0.5  # the suite's offset=now long-poll tests must finish within 5 s
VITEST_TIMEOUT_SECONDS = 600
STARTUP_SECONDS = 120  # a lane's servers, before each run
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


@dataclass(frozen=True)
class Deployment:
    """What one run of the suite is served by. Several workers or nodes must answer as
    one: each stream and subscription is served by one member (members.py), and the
    others forward to it; nginx sends each request to the next node (test_deploy.py
    shows it does, also on one client connection)."""

    on_s3: bool = False
    workers: int | None = None
    nodes: int = 1  # more than one: on one bucket, behind nginx
    env: Mapping[str, str] = field(default_factory=dict)
    test_timeout_ms: int | None = None


DEPLOYMENTS = {
    "local": Deployment(),
    "local-with-retention": Deployment(env=RETENTION),
    "s3": Deployment(on_s3=True, test_timeout_ms=S3_TEST_TIMEOUT_MS),
    "s3-2-workers": Deployment(
        on_s3=True, workers=2, test_timeout_ms=SEVERAL_ON_S3_TEST_TIMEOUT_MS
    ),
    "local-2-workers": Deployment(workers=2),
    "local-4-workers": Deployment(workers=4),
    "two-nodes-on-s3": Deployment(
        on_s3=True, nodes=2, test_timeout_ms=SEVERAL_ON_S3_TEST_TIMEOUT_MS
    ),
}
# The runs through several processes on S3 one after the other: two at once starved
# each other's heartbeats on 2 cores, and their members took partitions from each
# other mid-test (appends answered 503, as they should be: the suite does not retry).
# The one-worker run on S3, which has no other member to lose a partition to, goes
# beside them after the local ones, so that the two lanes take about as long.
LANES = (
    ("two-nodes-on-s3", "s3-2-workers"),
    ("local-4-workers", "local-2-workers", "local", "local-with-retention", "s3"),
)


@dataclass(frozen=True)
class SuiteRun:
    returncode: int
    output: str
    directory: Path  # vitest's output and report, and the servers' logs


@pytest.fixture(scope="module")
def suite_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[SuiteRun]]]:
    """The runs of the selected deployments, started in their lanes; each test waits for
    its own."""
    selected = {
        item.callspec.params["deployment"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    require_node_and_npm(
        "install Node.js 18 or newer with npm "
        "(Debian: apt-get install nodejs npm) to run the conformance suite"
    )
    npm_ci(CONFORMANCE_DIR)
    runs: dict[str, Future[SuiteRun]] = {name: Future() for name in selected}
    with ExitStack() as stack, ThreadPoolExecutor(len(LANES)) as lanes:
        for lane in LANES:
            names = [name for name in lane if name in selected]
            if not names:
                continue
            endpoint = None
            if any(DEPLOYMENTS[name].on_s3 for name in names):
                moto = make_moto(tmp_path_factory.mktemp("moto-conformance"))
                moto.start()
                stack.callback(moto.stop)
                endpoint = f"http://127.0.0.1:{moto.port}"
            lanes.submit(run_lane, names, endpoint, tmp_path_factory, runs)
        yield runs
    # Leaving: the lanes are done (the pool waits for them), then each moto stops.


def run_lane(
    names: list[str],
    endpoint: str | None,
    tmp_path_factory: pytest.TempPathFactory,
    runs: dict[str, Future[SuiteRun]],
) -> None:
    for name in names:
        try:
            directory = tmp_path_factory.mktemp(f"conformance-{name}")
            runs[name].set_result(run_suite(DEPLOYMENTS[name], endpoint, directory))
        except BaseException as error:  # the test reports it
            runs[name].set_exception(error)


def run_suite(deployment: Deployment, endpoint: str | None, directory: Path) -> SuiteRun:
    """Start the deployment's servers, run the suite against them, stop them."""
    env = {**WEBHOOKS_TO_LOOPBACK, **deployment.env}
    storage_url = None
    if deployment.on_s3:
        assert endpoint is not None
        env |= s3_environment(endpoint)
        storage_url = f"s3://{create_bucket(endpoint)}/picomq"
    with ExitStack() as stack:
        nodes = []
        for number in range(deployment.nodes):
            node = make_server(
                directory / f"node-{number}",
                storage_url=storage_url,
                long_poll_timeout=LONG_POLL_TIMEOUT,
                workers=deployment.workers,
                env=env,
            )
            node.start()
            stack.callback(node.stop)
            nodes.append(node)
        url = nodes[0].url
        if deployment.nodes > 1:
            (directory / "nginx").mkdir()
            nginx = make_nginx(directory / "nginx", nodes)
            nginx.managed.start()
            stack.callback(nginx.managed.stop)
            url = nginx.url
        returncode, output = run_vitest(
            url, directory / "vitest-report.json", deployment.test_timeout_ms
        )
    (directory / "vitest-output.txt").write_text(output)
    return SuiteRun(returncode, output, directory)


@pytest.mark.conformance
@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_conformance_suite(deployment: str, suite_runs: dict[str, Future[SuiteRun]]) -> None:
    """Every test of the suite passes against the deployment (DEPLOYMENTS)."""
    lane_seconds = (VITEST_TIMEOUT_SECONDS + STARTUP_SECONDS) * max(map(len, LANES))
    run = suite_runs[deployment].result(timeout=lane_seconds)
    print(run.output[-OUTPUT_TAIL_CHARS:])  # vitest's summary, shown by pytest on failure
    report_path, output_path = (
        run.directory / "vitest-report.json",
        run.directory / "vitest-output.txt",
    )
    if not report_path.exists():
        pytest.fail(
            f"vitest wrote no report (exit {run.returncode})\n{run.output[-OUTPUT_TAIL_CHARS:]}"
        )
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
