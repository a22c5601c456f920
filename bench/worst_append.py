"""The worst appends PicoMQ accepts, and what /healthz feels on the same worker meanwhile.

Starts PicoMQ as compare.py does (one gevent worker pinned to the server core, data
under bench/results/, or on moto with `--s3`) and runs three cases, each on its own
streams:

1. Tiny items: the largest body the server takes (PICOMQ_MAX_REQUEST_BYTES, 16 MiB) as
   one JSON array of `0`s, 8.4 million messages in one append (halved while refused);
   then a catch-up read of it all.
2. Many producers: `--producers` idempotent producers, each id as long as a header line
   allows, register on one byte stream (64 at a time); then one 1-byte append, and the
   bytes it added to storage (the sizes of the objects that appeared).
3. Deep forks: a chain of forks, each of the one before with one message of its own, as
   deep as the server allows (or `--fork-depth`); then a catch-up read of the deepest
   fork, and the listing of them all.

Meanwhile a probe GETs /healthz every 10 ms on its own connection. For each step the
table prints the step's own time, the p50/p99/max of the probes in flight during it
(and how many failed),
and the worker's resident memory before and after it, with its peak so far. Every step
stops at `--case-seconds` (a request in flight then ends by its timeout), so the whole
run stays within about two minutes. Asserts nothing.

    .venv/bin/python bench/worst_append.py
    .venv/bin/python bench/worst_append.py --s3 --producers 200
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import servers
from client import Connection, HttpError
from loads import S3_BUCKET, S3_ENVIRONMENT, STREAM_PREFIX, percentile
from servers import HOST, Server

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MAX_CASE_SECONDS = 30.0
PROBE_INTERVAL_SECONDS = 0.01
PROBE_TIMEOUT_SECONDS = 60.0
MAX_REQUEST_BYTES = 16 * 1024 * 1024  # PicoMQ's default PICOMQ_MAX_REQUEST_BYTES
MAX_HEADER_BYTES = 8190  # PicoMQ's default PICOMQ_MAX_HEADER_BYTES
PRODUCER_CONNECTIONS = 64
MAX_READS = 1000  # catch-up reads of one stream, each up to PICOMQ_MAX_READ_BYTES
BINARY = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
StorageSizes = Callable[[], dict[str, int]]


class HealthProbe:
    """GETs /healthz every PROBE_INTERVAL_SECONDS on one keep-alive connection, in a thread.

    Keeps when each probe started, how long it took and whether it failed (a probe that
    fails counts with the time it took to fail). The thread ends soon after `stopping`
    is set.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[Probe] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="healthz-probe", daemon=True)

    def run(self) -> None:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=PROBE_TIMEOUT_SECONDS)
        while not self.stopping.is_set():
            started, failed = time.monotonic(), False
            try:
                connection.request("GET", "/healthz")
                response = connection.getresponse()
                response.read()
                failed = response.status != 200
            except (OSError, http.client.HTTPException):
                failed = True
                connection.close()  # the next request reopens it
            took = time.monotonic() - started
            self.samples.append(Probe(started, took, failed))
            self.stopping.wait(max(0.0, PROBE_INTERVAL_SECONDS - took))
        connection.close()

    def during(self, start: float, end: float) -> list[Probe]:
        """The probes in flight at some time between `start` and `end`."""
        return [probe for probe in self.samples if probe.started <= end and probe.ended >= start]


@dataclass(frozen=True)
class Probe:
    started: float
    seconds: float
    failed: bool

    @property
    def ended(self) -> float:
        return self.started + self.seconds


@dataclass
class Step:
    """One measured step: its own time, what came of it, the probes and memory around it."""

    name: str
    seconds: float = 0.0
    outcome: str = ""
    healthz: list[Probe] = field(default_factory=list)
    rss_before: float = 0.0
    rss_after: float = 0.0
    rss_peak: float = 0.0


@dataclass
class Bench:
    """The server under test, its probe, its storage's object sizes, the steps measured."""

    server: Server
    probe: HealthProbe
    storage_sizes: StorageSizes
    case_seconds: float
    session: requests.Session = field(default_factory=requests.Session)
    steps: list[Step] = field(default_factory=list)

    def request(
        self, method: str, path: str, deadline: float, **arguments: Any
    ) -> requests.Response | None:
        """The answer, or None if the request failed or `deadline` came first."""
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            url = f"http://{HOST}:{self.server.port}{path}"
            return self.session.request(method, url, timeout=left, **arguments)
        except requests.RequestException:
            return None

    def deadline(self) -> float:
        return time.monotonic() + self.case_seconds

    @contextmanager
    def step(self, name: str) -> Iterator[Step]:
        """Measure the block as one step: time, probes that started in it, worker memory."""
        step = Step(name, rss_before=worker_memory(self.server)[0])
        start = time.monotonic()
        try:
            yield step
        finally:
            end = time.monotonic()
            step.seconds = end - start
            step.healthz = self.probe.during(start, end)
            step.rss_after, step.rss_peak = worker_memory(self.server)
            self.steps.append(step)


def worker_memory(server: Server) -> tuple[float, float]:
    """Resident memory and its peak so far (MiB) of the server's worker, not its master."""
    workers = server.processes()[1:]
    resident = sum(servers.read_status_kib(pid, "VmRSS") for pid in workers)
    peak = sum(servers.read_status_kib(pid, "VmHWM") for pid in workers)
    return resident / 1024, peak / 1024


def describe(answer: requests.Response | None) -> str:
    """The status, and the start of the body of an error."""
    if answer is None:
        return "failed or timed out"
    error = f": {answer.text[:100]}" if answer.status_code >= 400 else ""
    return f"HTTP {answer.status_code}{error}"


def succeeded(answer: requests.Response | None) -> bool:
    return answer is not None and answer.status_code < 300


def read_all(bench: Bench, path: str) -> str:
    """Catch up on `path` from its start, following Stream-Next-Offset; what that took."""
    offset, reads, received = "-1", 0, 0
    deadline = bench.deadline()
    while reads < MAX_READS:
        answer = bench.request("GET", path, deadline, params={"offset": offset})
        reads += 1
        if not succeeded(answer):
            return f"read {reads}: {describe(answer)}"
        received += len(answer.content)
        offset = answer.headers["Stream-Next-Offset"]
        if answer.headers.get("Stream-Up-To-Date") == "true":
            return f"{received:,} bytes in {reads} reads"
    return f"unfinished: {received:,} bytes in {reads} reads"


# (1) One append of as many tiny items as a body holds, then a read of them all.


def zeros_array(items: int) -> bytes:
    return b"[" + b"0," * (items - 1) + b"0]"


def tiny_items(bench: Bench) -> None:
    path = f"{STREAM_PREFIX}tiny-items"
    deadline = bench.deadline()
    bench.request("PUT", path, deadline, headers=JSON)
    items = (MAX_REQUEST_BYTES - 1) // 2  # "[" + "0," * (items - 1) + "0]": 2 items + 1 bytes
    while items >= 1:
        body = zeros_array(items)
        with bench.step(f"append {items:,} `0`s ({len(body) / 2**20:.1f} MiB)") as step:
            answer = bench.request("POST", path, deadline, data=body, headers=JSON)
            step.outcome = describe(answer)
        if succeeded(answer) or answer is None:
            break
        items //= 2  # refused: try half as many
    with bench.step("read them all from -1") as step:
        step.outcome = read_all(bench, path)


# (2) Many producers with the longest ids, then one small append.


def producer_headers(producer_id: str) -> dict[str, str]:
    return {**BINARY, "Producer-Id": producer_id, "Producer-Epoch": "0", "Producer-Seq": "0"}


def longest_producer_id(bench: Bench) -> int:
    """The longest Producer-Id the server takes, by bisection on a stream of its own."""
    path = f"{STREAM_PREFIX}producer-id-probe"
    deadline = bench.deadline()
    bench.request("PUT", path, deadline, headers=BINARY)
    accepted, refused = 1, MAX_HEADER_BYTES + 1
    while refused - accepted > 1 and time.monotonic() < deadline:
        length = (accepted + refused) // 2
        answer = bench.request(
            "POST", path, deadline, data=b"x", headers=producer_headers("p" * length)
        )
        accepted, refused = (length, refused) if succeeded(answer) else (accepted, length)
    return accepted


async def register_producers(port: int, path: str, ids: list[str], deadline: float) -> Counter[str]:
    """Append 1 byte as each producer, PRODUCER_CONNECTIONS at a time, until `deadline`;
    return how many answers had each status."""
    pending = iter(ids)
    statuses: Counter[str] = Counter()

    async def register_in_turn() -> None:
        connection = Connection(port)
        try:
            for producer_id in pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                request = connection.request("POST", path, producer_headers(producer_id), b"x")
                try:
                    answer = await asyncio.wait_for(request, left)
                except (TimeoutError, HttpError):
                    statuses["failed or timed out"] += 1
                    return
                statuses[str(answer.status)] += 1
        finally:
            await connection.close()

    await asyncio.gather(*(register_in_turn() for _ in range(PRODUCER_CONNECTIONS)))
    return statuses


def added_bytes(bench: Bench, before: dict[str, int]) -> str:
    """The objects that appeared in storage since `before`: their total size and count."""
    added = [size for name, size in bench.storage_sizes().items() if name not in before]
    return f"{sum(added):,} bytes in {len(added)} new objects"


def many_producers(bench: Bench, producers: int) -> None:
    path = f"{STREAM_PREFIX}many-producers"
    with bench.step("find the longest producer id") as step:
        length = longest_producer_id(bench)
        step.outcome = f"{length:,} bytes"
    bench.request("PUT", path, bench.deadline(), headers=BINARY)
    ids = [f"{number:08d}".ljust(length, "p") for number in range(producers)]
    before = bench.storage_sizes()
    with bench.step(f"register {producers:,} such producers") as step:
        register = register_producers(bench.server.port, path, ids, bench.deadline())
        answers = dict(asyncio.run(register))
        step.outcome = f"answers {answers}; wrote {added_bytes(bench, before)}"
    before = bench.storage_sizes()
    with bench.step("then append 1 byte") as step:
        answer = bench.request("POST", path, bench.deadline(), data=b"x", headers=BINARY)
        step.outcome = f"{describe(answer)}; wrote {added_bytes(bench, before)}"


# (3) A deep chain of forks, then a read of the deepest and a listing.


def fork_chain(bench: Bench, depth: int) -> str | None:
    """Create forks/0 and forks of forks up to `depth`, each with a message of its own;
    return the deepest path created (None if not even the first)."""
    deepest = None
    deadline = bench.deadline()
    with bench.step(f"fork {depth:,} deep, one append each") as step:
        step.outcome = f"{depth:,} forks"
        for level in range(depth + 1):
            path = f"{STREAM_PREFIX}forks/{level}"
            source = {} if deepest is None else {"Stream-Forked-From": deepest}
            answer = bench.request("PUT", path, deadline, headers={**JSON, **source})
            if succeeded(answer):
                answer = bench.request("POST", path, deadline, data=b"[%d]" % level, headers=JSON)
            if not succeeded(answer):
                ran_out = time.monotonic() >= deadline
                step.outcome = f"stopped at depth {level}: " + (
                    "time ran out" if ran_out else describe(answer)
                )
                break
            deepest = path
    return deepest


def list_all(bench: Bench, prefix: str) -> str:
    """List every stream under `prefix`, page by page; what that took."""
    after, pages, listed = None, 0, 0
    deadline = bench.deadline()
    while True:
        params = {"prefix": prefix, "limit": "1000", **({"after": after} if after else {})}
        answer = bench.request("GET", "/v1/streams", deadline, params=params)
        pages += 1
        if not succeeded(answer):
            return f"{describe(answer)} on page {pages}"
        page = answer.json()
        listed += len(page["streams"])
        after = page["next"]
        if after is None:
            return f"{listed:,} streams in {pages} pages"


def deep_forks(bench: Bench, depth: int) -> None:
    deepest = fork_chain(bench, depth)
    if deepest is None:
        return
    with bench.step("read the deepest fork from -1") as step:
        step.outcome = read_all(bench, deepest)
    with bench.step("list the forks") as step:
        step.outcome = list_all(bench, f"{STREAM_PREFIX.removeprefix('/v1/stream/')}forks/")


# The table; the servers and their storage.


def format_probes(probes: list[Probe]) -> str:
    """p50/p99/max in ms, (how many, and how many failed)."""
    if not probes:
        return "none"
    ordered = sorted(probe.seconds for probe in probes)
    p50, p99 = percentile(ordered, 0.5), percentile(ordered, 0.99)
    failed = sum(probe.failed for probe in probes)
    count = f"{len(ordered)}, {failed} failed" if failed else f"{len(ordered)}"
    return f"{1000 * p50:.1f}/{1000 * p99:.1f}/{1000 * ordered[-1]:.1f} ({count})"


def format_table(steps: list[Step]) -> str:
    rows = [("step", "time s", "healthz ms p50/p99/max (probes)", "worker MiB before→after (peak)")]
    for step in steps:
        memory = f"{step.rss_before:.0f}→{step.rss_after:.0f} ({step.rss_peak:.0f})"
        rows.append((step.name, f"{step.seconds:.2f}", format_probes(step.healthz), memory))
    width = [max(len(row[column]) for row in rows) for column in range(4)]
    outcomes = ["outcome", *(step.outcome for step in steps)]
    return "\n".join(
        f"{name:<{width[0]}}  {took:>{width[1]}}  {probes:>{width[2]}}  {memory:>{width[3]}}"
        f"  {outcome}"
        for (name, took, probes, memory), outcome in zip(rows, outcomes, strict=True)
    )


def local_sizes(root: Path) -> StorageSizes:
    def sizes() -> dict[str, int]:
        found = {}
        for directory, _, names in os.walk(root):
            for name in names:
                path = os.path.join(directory, name)
                try:
                    found[path] = os.stat(path).st_size
                except FileNotFoundError:
                    continue  # deleted while walking
        return found

    return sizes


def s3_sizes(endpoint: str) -> StorageSizes:
    import s3fs  # noqa: PLC0415 - a PicoMQ dependency, needed only for --s3

    filesystem = s3fs.S3FileSystem(
        key=S3_ENVIRONMENT["AWS_ACCESS_KEY_ID"],
        secret=S3_ENVIRONMENT["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": endpoint, "region_name": S3_ENVIRONMENT["AWS_REGION"]},
    )

    def sizes() -> dict[str, int]:
        filesystem.invalidate_cache()
        found = filesystem.find(S3_BUCKET, detail=True)
        return {name: detail["size"] for name, detail in found.items()}

    return sizes


def start_servers(
    work_dir: Path, core: int, s3: bool, started: list[Server]
) -> tuple[Server, StorageSizes]:
    """PicoMQ on local disk in work_dir/data, or on a moto of its own; and its sizes."""
    if not s3:
        server = servers.picomq(work_dir, core)
        started.append(server)
        return server.start(), local_sizes(work_dir / "data")
    moto = servers.moto(work_dir)
    started.append(moto)
    moto.start()
    requests.put(f"{moto.url}/{S3_BUCKET}", timeout=10).raise_for_status()
    environment = {
        **S3_ENVIRONMENT,
        "AWS_ENDPOINT_URL": moto.url,
        "PICOMQ_STORAGE_URL": f"s3://{S3_BUCKET}/picomq",
    }
    server = servers.picomq(work_dir, core, environment)
    started.append(server)
    return server.start(), s3_sizes(moto.url)


def run_cases(server: Server, sizes: StorageSizes, options: argparse.Namespace) -> Bench:
    probe = HealthProbe(server.port)
    probe.thread.start()
    bench = Bench(server, probe, sizes, min(options.case_seconds, MAX_CASE_SECONDS))
    try:
        tiny_items(bench)
        many_producers(bench, options.producers)
        deep_forks(bench, options.fork_depth)
    finally:
        probe.stopping.set()
        probe.thread.join()
    return bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--producers", type=int, default=1000, help="producers to register")
    parser.add_argument("--fork-depth", type=int, default=1000, help="forks in the chain, at most")
    parser.add_argument("--case-seconds", type=float, default=30, help="each step's deadline")
    parser.add_argument("--s3", action="store_true", help="PicoMQ on moto, not local disk")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    options = parser.parse_args()
    os.sched_setaffinity(0, {options.client_core})
    RESULTS_DIR.mkdir(exist_ok=True)
    started: list[Server] = []
    with tempfile.TemporaryDirectory(dir=RESULTS_DIR, prefix="worst-append-") as work_dir:
        try:
            server, sizes = start_servers(Path(work_dir), options.server_core, options.s3, started)
            bench = run_cases(server, sizes, options)
        finally:
            for process in reversed(started):
                process.stop()
    where = "on moto (S3)" if options.s3 else "on local disk"
    print(f"PicoMQ {where}, one worker; /healthz probed every {PROBE_INTERVAL_SECONDS:g} s")
    print(format_table(bench.steps))


if __name__ == "__main__":
    main()
