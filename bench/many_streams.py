"""What many streams cost PicoMQ: S3 requests and dollars per message, waiting readers, disk.

Each part starts a fresh PicoMQ as compare.py does (one gunicorn gevent worker pinned
to the server core; for the S3 parts on moto_server, whose access log counts the
requests) and prints one table, a column per revision measured:

- `s3-producers`: N streams (`--streams`, default 1, 100, 200, 1,000), each with one
  sequential producer (append, wait for the answer, append again) for `--duration`
  seconds, after one append to each that is not counted (it loads the stream); the
  appends in flight at the end finish and count. Messages/s, append latency, messages
  per PUT, PUTs/s, other requests per message, dollars per million messages; then the
  requests the server makes in the drain after (the work the appends left it:
  compaction, rewrites of the shared log) per message, and the dollars with them. The
  drain lasts `--drain` seconds (35: above PICOMQ_REWRITE_SECONDS, 30 by default) and
  on until the server is quiet. A stream's records are rewritten once per
  PICOMQ_REWRITE_SECONDS: after a load shorter than that, each stream's one rewrite is
  shared by fewer messages than it would be under a steady load.
- `s3-lone`: `--lone-appends` appends to one stream of an idle node, LONE_GAP_SECONDS
  apart: the latency, and the requests made from each append's start to just after
  its answer.
- `s3-waiting`: `--waiting-streams` quiet streams: the requests of the idle node over
  `--duration` seconds (from MEMBER_QUIET_SECONDS after the creates), then with one
  long-poll reader waiting on each (the default 20 s timeout, renewed): the requests
  that start them, then per hour over `--wait-seconds`, in all and per stream.
- `disk-appends`: compare.py's `appends-1` and `appends-1000` loads (wrk, 64
  connections, over 1 and `--disk-streams` streams) on local disk, and their ratio.
- `disk-lone`: sequential appends to one stream of an idle server on local disk,
  LIVE_PAUSE_SECONDS apart: the latency.

Dollars are at AWS S3 Standard list prices (PRICES). Work a server does periodically
while streams are active shows only if its period fits in the window: the drain
catches what the load left to do, not what the next appends would trigger. `--revision
REV` (repeatable) runs the server of another git revision, checked out in a temporary
worktree as ab.py does ("." is the working tree); each part alternates the revisions
rep by rep, and runs its loads back to back within a rep, in the reverse order in odd
reps (disk-appends' ratio pairs a revision's two loads of one rep, run seconds apart:
this machine's speed drifts by a fifth over minutes, and a ratio of loads run minutes
apart measured that drift).

    .venv/bin/python bench/many_streams.py --revision ef47b81 --revision .   # 16 min
    .venv/bin/python bench/many_streams.py --only s3 --streams 1,100 --drain 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import ab
import compare
import servers
from client import Connection, HttpError
from loads import (
    JSON_HEADERS,
    LIVE_PAUSE_SECONDS,
    LOADS,
    STREAM_PREFIX,
    Load,
    Options,
    Result,
    Target,
    check,
    cpu_use,
    create_streams,
    ignore,
    long_poll_reader,
    message,
    percentile,
)

# AWS S3 Standard list prices (us-east-1), dollars per request: PUT, COPY, POST and LIST
# $0.005 per 1,000; GET, HEAD and the rest $0.0004 per 1,000; DELETE is free.
PRICES = {
    "PUT": 0.005 / 1000,
    "POST": 0.005 / 1000,
    "LIST": 0.005 / 1000,
    "GET": 0.0004 / 1000,
    "HEAD": 0.0004 / 1000,
    "DELETE": 0.0,
}
# An append on moto waits behind every other stream's requests: 60 s and more for some
# of 1,000 streams today. One given up on would count its requests and not its message.
ANSWER_TIMEOUT_SECONDS = 180.0
# The first append to each of 1,000 streams took 20–90 s on moto (today's layout lists
# each stream again): one not answered in time would land in the counted window.
WARM_UP_TIMEOUT_SECONDS = 300.0
FAILURE_PAUSE_SECONDS = 0.1  # a producer whose append failed tries again after this
SETTLE_SECONDS = 2.0  # after setup, before counting: what the creates started ends
LOG_SETTLE_SECONDS = 0.1  # moto logs a request after answering it
LONE_GAP_SECONDS = 0.5  # between lone appends: the node is idle again before each
DISK_LONE_APPENDS = 200
MAX_WAIT_SECONDS = 120  # for --drain and --wait-seconds; a drain ends by then
# A drain goes on past --drain while moto still hears from the server: rewrites of
# 1,000 streams take a while, and a member holding records beats every 3.3 s meanwhile.
DRAIN_QUIET_SECONDS = 5.0
# A member heartbeats for a lease (PICOMQ_LEASE_SECONDS, 10 s) after its last request:
# the idle window starts once that is over, so that it counts what idling costs.
MEMBER_QUIET_SECONDS = 15.0
READERS_START_SECONDS = 5.0  # their first long-polls are answered or waiting by then
WORKING_TREE = "."


@dataclass(frozen=True)
class Figure:
    label: str
    format: str


FIGURES = {
    "msgs_per_s": Figure("messages/s", "{:,.0f}"),
    "p50_ms": Figure("append p50 ms", "{:,.1f}"),
    "p99_ms": Figure("append p99 ms", "{:,.1f}"),
    "max_ms": Figure("append max ms", "{:,.1f}"),
    "msgs_per_put": Figure("messages per PUT", "{:,.2f}"),
    "puts_per_s": Figure("PUTs/s", "{:,.1f}"),
    "others_per_msg": Figure("other requests per message (GET, HEAD, LIST, DELETE)", "{:,.3f}"),
    "usd_per_million": Figure("$ per million messages, during the load", "{:,.2f}"),
    "drain_per_msg": Figure("requests per message in the drain after it", "{:,.3f}"),
    "usd_per_million_drained": Figure("$ per million messages, drain included", "{:,.2f}"),
    "failed": Figure("appends failed", "{:,.0f}"),
    "requests_per_append": Figure("requests per lone append (mean)", "{:,.2f}"),
    "puts_per_append": Figure("PUTs per lone append (mean)", "{:,.2f}"),
    "idle_node_per_hour": Figure("idle node: requests per hour", "{:,.0f}"),
    "idle_stream_per_hour": Figure("idle node: requests per hour per stream", "{:,.1f}"),
    "waiting_start": Figure("one long-poll per stream: requests to start them (once)", "{:,.0f}"),
    "waiting_node_per_hour": Figure("one long-poll per stream: requests per hour", "{:,.0f}"),
    "waiting_stream_per_hour": Figure(
        "one long-poll per stream: requests per hour per stream", "{:,.1f}"
    ),
    "ratio": Figure("appends/s over many streams ÷ over one", "{:.2f}"),
    "server_cpu_pct": Figure("server CPU % of a core", "{:.0f}"),
    "server_user_us": Figure("server CPU µs per append, in its own code", "{:.1f}"),
    "server_system_us": Figure("server CPU µs per append, in the kernel", "{:.1f}"),
    "client_cpu_pct": Figure("client CPU % of a core", "{:.0f}"),
    "moto_cpu_pct": Figure("moto CPU % of a core", "{:.0f}"),
}
# Below this share of its core, a server under wrk waited: for its core, which other
# processes held, or on the disk (on ext4 without a journal, for minutes after a run
# that deleted thousands of files: bench/README.md).
SATURATED_CPU_PCT = 90


def with_server_cpu(
    run: Callable[[Target, Options], Result],
) -> Callable[[Target, Options], Result]:
    """`run`, with a note when the server did not keep its core busy: the rate is the
    machine's; and the server's CPU time per append, split between its own code and
    the kernel. The split tells what a filesystem costs (kernel) from what more
    streams cost the interpreter (bench/README.md, "On a filesystem with a journal")."""

    def checked(target: Target, options: Options) -> Result:
        result = run(target, options)
        figures = result.figures
        appends = figures.get("msgs_per_s") or math.nan  # per second, as the shares are
        for part in ("user", "system"):
            figures[f"server_{part}_us"] = figures[f"server_{part}_pct"] * 1e4 / appends
        used = figures.get("server_cpu_pct", 100.0)
        if used < SATURATED_CPU_PCT:
            result.notes.append(
                f"the server used {used:.0f} % of its core under wrk: it waited for the"
                " core or on the disk, and its rate says little"
            )
        return result

    return checked


DISK_LOADS = {
    load.name: replace(
        load,
        title="local disk: " + load.title.split(") ", 1)[1],
        run=with_server_cpu(load.run),
        figures=(*load.figures, "server_user_us", "server_system_us"),
    )
    for load in LOADS
    if load.name in ("appends-1", "appends-1000")
}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        default="all",
        help=f"comma-separated parts or groups: {', '.join([*PARTS, *GROUPS])}",
    )
    compare.add_harness_arguments(parser, reps=1, duration=10)
    parser.add_argument(
        "--streams",
        default="1,100,200,1000",
        help="comma-separated stream counts for s3-producers (default 1,100,200,1000)",
    )
    parser.add_argument(
        "--drain", type=float, default=35.0, help="seconds counted after each s3-producers load"
    )
    parser.add_argument("--lone-appends", type=int, default=20, help="appends timed by s3-lone")
    parser.add_argument("--waiting-streams", type=int, default=100, help="streams of s3-waiting")
    parser.add_argument(
        "--wait-seconds",
        type=float,
        default=30.0,
        help="seconds the long-polls wait in s3-waiting (above 20 includes a renewal)",
    )
    parser.add_argument("--disk-streams", type=int, default=1000, help="streams of disk-appends")
    parser.add_argument(
        "--revision",
        action="append",
        default=[],
        help="a git revision whose server to run (repeatable; '.' is the working tree)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for every server measured (repeatable)",
    )
    arguments = parser.parse_args()
    compare.check_harness_arguments(parser, arguments)
    if not 0 <= arguments.drain <= MAX_WAIT_SECONDS:
        parser.error(f"--drain must be 0–{MAX_WAIT_SECONDS} seconds")
    if not 1 <= arguments.wait_seconds <= MAX_WAIT_SECONDS:
        parser.error(f"--wait-seconds must be 1–{MAX_WAIT_SECONDS} seconds")
    if any("=" not in pair for pair in arguments.env):
        parser.error("--env takes NAME=VALUE")
    try:
        arguments.stream_counts = [int(count) for count in arguments.streams.split(",")]
    except ValueError:
        parser.error("--streams takes comma-separated numbers")
    arguments.parts = parse_parts(parser, arguments.only)
    arguments.revisions = arguments.revision or [WORKING_TREE]
    return arguments


def parse_parts(parser: argparse.ArgumentParser, only: str) -> list[str]:
    """The parts `--only` names (parts or groups, comma-separated), in PARTS's order."""
    selected: list[str] = []
    for name in only.split(","):
        name = name.strip()
        if name == "all":
            selected += PARTS
        elif name in GROUPS:
            selected += GROUPS[name]
        elif name in PARTS:
            selected.append(name)
        else:
            parser.error(f"unknown part {name!r}")
    return [part for part in PARTS if part in selected]


PRODUCER_FIGURES = (
    "msgs_per_s",
    "p50_ms",
    "p99_ms",
    "msgs_per_put",
    "puts_per_s",
    "others_per_msg",
    "usd_per_million",
    "drain_per_msg",
    "usd_per_million_drained",
    "failed",
    "server_cpu_pct",
    "moto_cpu_pct",
    "client_cpu_pct",
)
LONE_FIGURES = ("p50_ms", "max_ms", "requests_per_append", "puts_per_append")
WAITING_FIGURES = (
    "idle_node_per_hour",
    "idle_stream_per_hour",
    "waiting_start",
    "waiting_node_per_hour",
    "waiting_stream_per_hour",
)


def producer_loads(arguments: argparse.Namespace) -> list[Load]:
    """One load per stream count: each needs a fresh server."""
    loads = []
    for count in arguments.stream_counts:
        each = "one sequential producer" if count == 1 else "one sequential producer each"
        title = f"S3: {count:,} stream{'s' * (count != 1)}, {each}, {{duration}} s"
        run = in_event_loop(sequential_producers, count=count, drain=arguments.drain)
        loads.append(Load(f"s3-producers-{count}", title, run, PRODUCER_FIGURES, s3=True))
    return loads


def lone_loads(arguments: argparse.Namespace) -> list[Load]:
    title = f"S3: a lone append on an idle node, {arguments.lone_appends} of them"
    run = in_event_loop(time_lone_appends, count=arguments.lone_appends)
    return [Load("s3-lone", title, run, LONE_FIGURES, s3=True)]


def waiting_loads(arguments: argparse.Namespace) -> list[Load]:
    count, seconds = arguments.waiting_streams, arguments.wait_seconds
    title = (
        f"S3: {count:,} quiet streams, idle {{duration}} s,"
        f" then one long-poll on each for {seconds:g} s"
    )
    run = in_event_loop(count_waiting_requests, count=count, seconds=seconds)
    return [Load("s3-waiting", title, run, WAITING_FIGURES, s3=True)]


def disk_append_loads(arguments: argparse.Namespace) -> list[Load]:
    return list(DISK_LOADS.values())


def disk_lone_loads(arguments: argparse.Namespace) -> list[Load]:
    title = f"local disk: a lone append on an idle server, {DISK_LONE_APPENDS} of them"
    run = in_event_loop(time_disk_lone_appends, count=DISK_LONE_APPENDS)
    return [Load("disk-lone", title, run, ("p50_ms", "p99_ms"))]


async def timed_append(connection: Connection, path: str, number: int) -> float:
    """Seconds from sending append `number` to its answer (which must be a success)."""
    sent = time.monotonic()
    response = await asyncio.wait_for(
        connection.request("POST", path, JSON_HEADERS, message(number)), ANSWER_TIMEOUT_SECONDS
    )
    check(response.status, "POST")
    return time.monotonic() - sent


def in_event_loop(
    part: Callable[..., Coroutine[object, object, Result]], **arguments: object
) -> Callable[[Target, Options], Result]:
    """A load's run: `part(target, options, **arguments)` in an event loop of its own."""

    def run(target: Target, options: Options) -> Result:
        return asyncio.run(part(target, options, **arguments))

    return run


PARTS: dict[str, Callable[[argparse.Namespace], list[Load]]] = {
    "s3-producers": producer_loads,
    "s3-lone": lone_loads,
    "s3-waiting": waiting_loads,
    "disk-appends": disk_append_loads,
    "disk-lone": disk_lone_loads,
}
GROUPS = {"s3": ("s3-producers", "s3-lone", "s3-waiting"), "disk": ("disk-appends", "disk-lone")}


# S3: sequential producers


async def sequential_producers(
    target: Target, options: Options, count: int, drain: float
) -> Result:
    """`count` streams, a producer each appending one message at a time for the duration.

    The appends in flight at the end are waited for, so every request counted belongs
    to a message counted. Then the `drain`: requests the server makes once the load has
    stopped, such as compacting or rewriting what it wrote, per message of the load.
    """
    assert target.moto is not None
    paths = [f"{STREAM_PREFIX}p{number}" for number in range(count)]
    result = Result()
    setup = await prepare_streams(target.port, paths, result)
    await asyncio.sleep(SETTLE_SECONDS)
    _, mark = servers.count_s3_requests(target.moto.log_path, 0)
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    started, moto_cpu = time.monotonic(), target.moto.cpu_seconds()
    with cpu_use(target, result):
        stop_at = started + options.duration
        await asyncio.gather(
            *(produce(target.port, path, stop_at, latencies, failures) for path in paths)
        )
        elapsed = time.monotonic() - started
    result.figures["moto_cpu_pct"] = 100 * (target.moto.cpu_seconds() - moto_cpu) / elapsed
    await asyncio.sleep(LOG_SETTLE_SECONDS)
    counts, mark = servers.count_s3_requests(target.moto.log_path, mark)
    drained, drained_for = await count_drain(target.moto.log_path, mark, drain)
    add_request_figures(result, latencies, elapsed, counts, drained)
    result.figures["failed"] = sum(failures.values())
    result.details.append(
        f"{setup}; {len(latencies):,} messages in {elapsed:.1f} s; moto saw {dict(counts)},"
        f" then in {drained_for:.0f} s {dict(drained)}"
    )
    if drained_for >= MAX_WAIT_SECONDS:
        result.notes.append(f"the server still made requests {MAX_WAIT_SECONDS} s after the load")
    result.notes += [f"{times} appends failed: {error}" for error, times in failures.items()]
    return result


async def count_drain(log_path: Path, mark: int, drain: float) -> tuple[Counter[str], float]:
    """The requests moto logged after `mark` until the server went quiet; how long it took.

    The window lasts `drain` seconds, and on until DRAIN_QUIET_SECONDS pass without a
    request (MAX_WAIT_SECONDS at most).
    A rewrite is due PICOMQ_REWRITE_SECONDS after a record is logged, so a `drain` above
    it sees every record of the load rewritten once; the quiet that ends it makes sure
    the rewrites have finished, however many streams they cover.
    """
    started = time.monotonic()
    drained: Counter[str] = Counter()
    heard = started
    while (now := time.monotonic()) - started < MAX_WAIT_SECONDS:
        if now - started >= drain and now - heard >= DRAIN_QUIET_SECONDS:
            break
        await asyncio.sleep(1.0)
        made, mark = servers.count_s3_requests(log_path, mark)
        if made:
            drained += made
            heard = time.monotonic()
    return drained, time.monotonic() - started


async def prepare_streams(port: int, paths: list[str], result: Result) -> str:
    """Create the streams, then append once to each, all at once; says how long each took.

    A stream's first append after its create costs what loading the stream's handle
    costs, not what an append costs: on moto, creating 1,000 streams takes longer than
    an index is trusted (`index_max_age`), so today's layout lists each one again.
    """
    started = time.monotonic()
    await create_streams(port, paths)
    created = time.monotonic() - started
    outcomes = await asyncio.gather(
        *(append_once(port, path) for path in paths), return_exceptions=True
    )
    failed = Counter(repr(outcome)[:120] for outcome in outcomes if outcome is not None)
    result.notes += [f"{times} first appends failed: {error}" for error, times in failed.items()]
    warmed = time.monotonic() - started - created
    return f"streams created in {created:.1f} s, one append to each in {warmed:.1f} s"


def add_request_figures(
    result: Result,
    latencies: list[float],
    elapsed: float,
    counts: Counter[str],
    drained: Counter[str],
) -> None:
    """Rates, requests and dollars per message, from the load's and the drain's requests."""
    messages = max(1, len(latencies))
    result.figures.update(
        messages=len(latencies),
        msgs_per_s=len(latencies) / elapsed,
        p50_ms=1000 * percentile(latencies, 0.50),
        p99_ms=1000 * percentile(latencies, 0.99),
        msgs_per_put=len(latencies) / counts["PUT"] if counts["PUT"] else math.nan,
        puts_per_s=counts["PUT"] / elapsed,
        others_per_msg=(sum(counts.values()) - counts["PUT"]) / messages,
        usd_per_million=1e6 * dollars(counts) / messages,
        drain_per_msg=sum(drained.values()) / messages,
        usd_per_million_drained=1e6 * dollars(counts + drained) / messages,
    )


async def append_once(port: int, path: str) -> None:
    connection = Connection(port)
    try:
        response = await asyncio.wait_for(
            connection.request("POST", path, JSON_HEADERS, message()), WARM_UP_TIMEOUT_SECONDS
        )
        check(response.status, "POST")
    finally:
        await connection.close()


async def produce(
    port: int, path: str, stop_at: float, latencies: list[float], failures: Counter[str]
) -> None:
    """Append one message at a time until `stop_at`, each sent once the last is answered."""
    connection = Connection(port)
    number = 0
    try:
        while time.monotonic() < stop_at:
            sent = time.monotonic()
            try:
                response = await asyncio.wait_for(
                    connection.request("POST", path, JSON_HEADERS, message(number)),
                    ANSWER_TIMEOUT_SECONDS,
                )
                check(response.status, "POST")
            except (HttpError, OSError, TimeoutError) as error:
                failures[repr(error)[:120]] += 1
                await connection.close()  # its state is unknown: the next request reopens it
                await asyncio.sleep(FAILURE_PAUSE_SECONDS)
                continue
            latencies.append(time.monotonic() - sent)
            number += 1
    finally:
        await connection.close()


def dollars(counts: Counter[str]) -> float:
    """What these requests cost at PRICES; a kind not listed is priced as a GET."""
    return sum(times * PRICES.get(kind, PRICES["GET"]) for kind, times in counts.items())


# S3: a lone append on an idle node


async def time_lone_appends(target: Target, options: Options, count: int) -> Result:
    """Appends one at a time, LONE_GAP_SECONDS apart, each with the requests it made.

    A request counts for an append when moto logged it between the append's start and
    LOG_SETTLE_SECONDS after its answer; what the node does meanwhile (a heartbeat, say)
    can fall in that window, so the details list each append's requests.
    """
    assert target.moto is not None
    path = f"{STREAM_PREFIX}lone"
    await create_streams(target.port, [path])
    await asyncio.sleep(SETTLE_SECONDS)
    connection = Connection(target.port)
    latencies: list[float] = []
    each: Counter[str] = Counter()
    total: Counter[str] = Counter()
    between: Counter[str] = Counter()
    _, mark = servers.count_s3_requests(target.moto.log_path, 0)
    for number in range(count):
        await asyncio.sleep(LONE_GAP_SECONDS)
        idle, mark = servers.count_s3_requests(target.moto.log_path, mark)
        between += idle
        latencies.append(await timed_append(connection, path, number))
        await asyncio.sleep(LOG_SETTLE_SECONDS)
        made, mark = servers.count_s3_requests(target.moto.log_path, mark)
        total += made
        each[" ".join(f"{kind}×{times}" for kind, times in sorted(made.items())) or "none"] += 1
    await connection.close()
    result = Result()
    result.figures.update(
        p50_ms=1000 * percentile(latencies, 0.50),
        max_ms=1000 * max(latencies),
        requests_per_append=sum(total.values()) / count,
        puts_per_append=total["PUT"] / count,
    )
    shapes = ", ".join(f"{shape}: {times}" for shape, times in each.most_common())
    result.details.append(f"requests of each append: {shapes}; between appends {dict(between)}")
    return result


# S3: readers waiting on quiet streams


async def count_waiting_requests(
    target: Target, options: Options, count: int, seconds: float
) -> Result:
    """The requests of a node with `count` quiet streams: idle, then with a long-poll on each.

    The streams are created empty, so that nothing written needs work later (a rewrite)
    while the readers wait. The idle window starts MEMBER_QUIET_SECONDS after the
    creates. The readers start after it; what starting them costs (loading the streams,
    a member claiming their partitions again) is counted apart, over READERS_START_SECONDS,
    and the rate per hour over the `seconds` after. Each renews its long-poll when it
    times out.
    """
    assert target.moto is not None
    paths = [f"{STREAM_PREFIX}quiet{number}" for number in range(count)]
    tail = await create_streams(target.port, paths)
    await asyncio.sleep(MEMBER_QUIET_SECONDS)
    _, mark = servers.count_s3_requests(target.moto.log_path, 0)
    await asyncio.sleep(options.duration)
    idle, mark = servers.count_s3_requests(target.moto.log_path, mark)
    readers = [
        asyncio.create_task(long_poll_reader(target.port, path, tail, ignore)) for path in paths
    ]
    await asyncio.sleep(READERS_START_SECONDS)
    start, mark = servers.count_s3_requests(target.moto.log_path, mark)
    await asyncio.sleep(seconds)
    waiting, _ = servers.count_s3_requests(target.moto.log_path, mark)
    for reader in readers:
        reader.cancel()
    outcomes = await asyncio.gather(*readers, return_exceptions=True)
    result = Result()
    for outcome in outcomes:
        if not isinstance(outcome, asyncio.CancelledError):
            result.notes.append(f"a long-poll reader failed: {outcome!r}")
    idle_per_hour = sum(idle.values()) * 3600 / options.duration
    waiting_per_hour = sum(waiting.values()) * 3600 / seconds
    result.figures.update(
        idle_node_per_hour=idle_per_hour,
        idle_stream_per_hour=idle_per_hour / count,
        waiting_node_per_hour=waiting_per_hour,
        waiting_stream_per_hour=waiting_per_hour / count,
        waiting_start=sum(start.values()),
    )
    result.details.append(
        f"idle {options.duration} s: moto saw {dict(idle)}; {count} long-polls starting:"
        f" {dict(start)}, then for {seconds:g} s: {dict(waiting)}"
    )
    return result


# Local disk: a lone append on an idle server


async def time_disk_lone_appends(target: Target, options: Options, count: int) -> Result:
    """Appends to one stream one at a time, LIVE_PAUSE_SECONDS apart, as the live loads."""
    path = f"{STREAM_PREFIX}lone"
    await create_streams(target.port, [path])
    connection = Connection(target.port)
    latencies: list[float] = []
    for number in range(count):
        await asyncio.sleep(LIVE_PAUSE_SECONDS)
        latencies.append(await timed_append(connection, path, number))
    await connection.close()
    result = Result()
    result.figures.update(
        p50_ms=1000 * percentile(latencies, 0.50), p99_ms=1000 * percentile(latencies, 0.99)
    )
    return result


# The run and its table


def main() -> None:
    arguments = parse_arguments()
    options = Options(
        duration=arguments.duration,
        streams=arguments.disk_streams,
        client_core=arguments.client_core,
    )
    environment = dict(pair.split("=", 1) for pair in arguments.env)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    os.sched_setaffinity(0, {arguments.client_core})
    open_files = servers.raise_open_file_limit()
    machine, command = compare.describe_run("bench/many_streams.py", open_files)
    parts = [PARTS[part](arguments) for part in arguments.parts]
    chosen = [load for part in parts for load in part]
    runs: list[compare.Run] = []
    labels = {revision: revision_label(revision) for revision in arguments.revisions}
    with ExitStack() as stack:
        settings = {}
        for revision in arguments.revisions:
            tree = stack.enter_context(
                ab.checked_out(None if revision == WORKING_TREE else revision)
            )
            settings[revision] = compare.Settings(
                server_core=arguments.server_core,
                profile=False,
                profile_dir=compare.RESULTS_DIR,
                picomq_tree=tree,
                picomq_env=environment,
            )
        work_root = stack.enter_context(compare.work_area(keep=False))
        for part in parts:
            # The loads of a part run back to back in each rep: a ratio between them
            # (disk-appends) compares runs seconds apart, as this machine's speed drifts.
            print("\n" + "\n".join(load.title.format(**vars(options)) for load in part))
            for rep in range(arguments.reps):
                # Odd reps reverse both orders: no revision and no load always runs
                # in another's wake (its deletes, its dirty pages, its warmed caches).
                forward = rep % 2 == 0
                order = arguments.revisions if forward else arguments.revisions[::-1]
                for revision, load in itertools.product(order, part if forward else part[::-1]):
                    work_dir = work_root / f"{load.name}-{len(runs)}"
                    work_dir.mkdir()
                    run = compare.measure(
                        load, "picomq", rep, work_dir, options, settings[revision]
                    )
                    run.server = labels[revision]
                    runs.append(run)
                    summary = summarize(load, run)
                    print(f"  rep {rep + 1} {run.server} {load.name}: {summary}", flush=True)
    print(f"\n{format_table(chosen, runs, list(labels.values()), options)}")
    print(compare.format_notes(runs))
    for run in runs:
        for detail in run.details:
            print(f"- {run.load}, {run.server}, rep {run.rep + 1}: {detail}")
    compare.save(machine, command, stamp, runs, kind="many-streams")


def revision_label(revision: str) -> str:
    """A revision as the table's column names it: as given, and the commit it is."""
    if revision == WORKING_TREE:
        return f"working tree ({compare.git('describe', '--always', '--dirty')})"
    return f"{revision} ({compare.git('rev-parse', '--short', revision) or 'unknown'})"


def summarize(load: Load, run: compare.Run) -> str:
    if run.error:
        return f"FAILED: {run.error.splitlines()[0][:200]}"
    return " · ".join(
        f"{figure_of(key).label} {figure_of(key).format.format(run.figures[key])}"
        for key in load.figures
        if key in run.figures
    )


def figure_of(key: str) -> Figure | compare.Figure:
    return FIGURES.get(key) or compare.FIGURES[key]


def format_table(
    measured: list[Load], runs: list[compare.Run], revisions: list[str], options: Options
) -> str:
    """One row per figure, one column per revision: the median of its reps (min–max)."""
    lines = [
        "| part | figure | " + " | ".join(revisions) + " |",
        "|---|---|" + "---:|" * len(revisions),
    ]
    for load in measured:
        title = load.title.format(**vars(options))
        for row, key in enumerate(load.figures):
            figure = figure_of(key)
            cells = []
            for revision in revisions:
                mine = [run for run in runs if run.load == load.name and run.server == revision]
                values = [run.figures[key] for run in mine if key in run.figures]
                failed = sum(1 for run in mine if run.error)
                cell = compare.spread(values, figure.format)
                cells.append(cell + (f" ({failed} failed)" if failed else ""))
            lines.append(f"| {title if row == 0 else ''} | {figure.label} | {' | '.join(cells)} |")
    if all(name in {load.name for load in measured} for name in DISK_LOADS):
        cells = [compare.spread(disk_ratios(runs, revision), "{:.2f}") for revision in revisions]
        lines.append(f"| local disk | {FIGURES['ratio'].label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def disk_ratios(runs: list[compare.Run], revision: str) -> list[float]:
    """appends-1000 ÷ appends-1 of one revision, rep by rep."""
    rates = {
        (run.load, run.rep): run.figures.get("msgs_per_s")
        for run in runs
        if run.server == revision and run.load in DISK_LOADS
    }
    reps = sorted({rep for _, rep in rates})
    return [
        rates[("appends-1000", rep)] / rates[("appends-1", rep)]
        for rep in reps
        if rates.get(("appends-1000", rep)) and rates.get(("appends-1", rep))
    ]


if __name__ == "__main__":
    main()
