"""The loads bench/compare.py runs; each gets one fresh server and returns its figures.

A load never asserts on speed: it measures, and notes anything that went wrong (non-2xx
answers, socket errors, lost events) next to its figures. Every timed part is bounded
by `Options.duration` (at most 30 s) or its own deadline, and stops by itself.

Messages are ≈100-byte JSON objects. The POST loads run wrk (bench/append.lua) on the
client core; the read, live and fan-out loads run the asyncio client in this process,
which compare.py pins to the client core. Client CPU is this process plus the children
it reaped during the load (wrk), as a percentage of one core.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import resource
import subprocess
import threading
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import servers
from client import Connection, HttpError, SseSubscriber, find_message_ids, subscribe
from servers import Server

MESSAGE_BYTES = 100
BATCH_MESSAGES = 1000
POPULATE_MESSAGES = 10_000  # per POST while filling the catch-up stream (≈1 MB)
JSON_TYPE = "application/json"
JSON_HEADERS = {"Content-Type": JSON_TYPE}
STREAM_PREFIX = "/v1/stream/bench/"
SETUP_CONCURRENCY = 16
WRK_TIMEOUT = "10s"  # an answer slower than this counts as a wrk timeout error
LIVE_PAUSE_SECONDS = 0.005  # between live events, so the next long-poll is waiting
LIVE_EVENT_TIMEOUT_SECONDS = 5.0
CONNECT_DEADLINE_SECONDS = 20.0  # fan-out: connect + 30 s + grace stays under the 60 s SSE limit
CONNECT_CONCURRENCY = 200
FANOUT_GRACE_SECONDS = 5.0
POST_TIMEOUT_SECONDS = 10.0
PRODUCER_CONNECTIONS = 4  # fan-out: enough for 5 msg/s unless answers take > 0.8 s
MEMORY_SAMPLE_SECONDS = 0.1
ERROR_LINE = re.compile(r"\[(?:ERROR|error|CRITICAL)\]|\bERROR\b|Traceback|Exception")
S3_BUCKET = "picomq-bench"
S3_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


@dataclass(frozen=True)
class Options:
    duration: int = 10  # seconds per timed load, at most 30
    connections: int = 64
    streams: int = 1000
    batch_connections: int = 8
    catchup_mb: int = 50
    events: int = 500
    fanout_rate: float = 5.0
    idle_streams: int = 10
    client_core: int | None = 1


@dataclass
class Target:
    """The server under test; `moto` is set for the S3 loads."""

    server: Server
    work_dir: Path
    moto: Server | None = None

    @property
    def port(self) -> int:
        return self.server.port


@dataclass
class Result:
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what went wrong: printed with the table
    details: list[str] = field(default_factory=list)  # what happened: kept in the results file


@dataclass(frozen=True)
class Load:
    name: str
    title: str  # formatted with the Options' fields
    run: Callable[[Target, Options], Result]
    figures: tuple[str, ...]  # which figures the table shows, in order
    s3: bool = False  # PicoMQ on moto only: no reference row


def message(number: int = 0) -> bytes:
    """A JSON object of exactly MESSAGE_BYTES bytes carrying its number as "i"."""
    head = b'{"i":%d,"kind":"bench","pad":"' % number
    return head + b"x" * (MESSAGE_BYTES - len(head) - 2) + b'"}'


def batch(count: int) -> bytes:
    return b"[" + b",".join(message(number) for number in range(count)) + b"]"


def percentile(values: list[float] | array, fraction: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


@contextmanager
def cpu_use(target: Target, result: Result) -> Iterator[None]:
    """Adds client_cpu_pct and server_cpu_pct: CPU time over wall time, % of one core;
    and the server's part of it in its own code and in the kernel (server_user_pct,
    server_system_pct), which tell the interpreter's work from the filesystem's."""
    client_before, (user_before, system_before) = client_cpu_seconds(), target.server.cpu_times()
    started = time.monotonic()
    try:
        yield
    finally:
        elapsed = time.monotonic() - started
        user, system = target.server.cpu_times()
        user, system = user - user_before, system - system_before
        result.figures["client_cpu_pct"] = 100 * (client_cpu_seconds() - client_before) / elapsed
        result.figures["server_cpu_pct"] = 100 * (user + system) / elapsed
        result.figures["server_user_pct"] = 100 * user / elapsed
        result.figures["server_system_pct"] = 100 * system / elapsed


def client_cpu_seconds() -> float:
    """CPU time of this process and of the children it has reaped (wrk)."""
    usages = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(usage.ru_utime + usage.ru_stime for usage in usages)


@contextmanager
def peak_memory(target: Target, result: Result) -> Iterator[None]:
    """Adds rss_mib: the server's peak resident memory (its whole process tree), in MiB."""
    peak = [target.server.resident_mib()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(MEMORY_SAMPLE_SECONDS):
            peak[0] = max(peak[0], target.server.resident_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        result.figures["rss_mib"] = max(peak[0], target.server.resident_mib())


def ignore(number: int, arrived_at: float) -> None:
    """A message handler for readers whose messages nobody counts."""


def check(response_status: int, what: str) -> None:
    if not 200 <= response_status < 300:
        raise HttpError(f"{what} answered {response_status}")


async def create_streams(port: int, paths: list[str], content_type: str = JSON_TYPE) -> str:
    """PUT each path (a JSON stream by default); returns the last one's Stream-Next-Offset."""
    pending = iter(paths)
    tails: list[str] = []

    async def create() -> None:
        connection = Connection(port)
        for path in pending:
            response = await connection.request("PUT", path, {"Content-Type": content_type})
            check(response.status, f"PUT {path}")
            tails.append(response.headers["stream-next-offset"])
        await connection.close()

    await asyncio.gather(*(create() for _ in range(min(SETUP_CONCURRENCY, len(paths)))))
    return tails[-1]


def server_log_errors(target: Target, limit: int = 5) -> list[str]:
    """The first few lines of the server's log that look like errors."""
    text = target.server.log_path.read_text(errors="replace")
    lines = [line for line in text.splitlines() if ERROR_LINE.search(line)]
    return [f"server log: {line[:200]}" for line in lines[:limit]]


# (1) and (2): POST loads through wrk


@dataclass(frozen=True)
class Posts:
    """What a wrk load sends: one body, to `streams` streams in turn, on `connections`."""

    body: bytes
    messages_per_post: int
    streams: int
    connections: int
    content_type: str = JSON_TYPE
    token: str | None = None  # sent as a bearer token, when tokens are checked

    @staticmethod
    def single(streams: int, connections: int) -> Posts:
        """Load (1): one 100-byte message per POST."""
        return Posts(message(), 1, streams, connections)

    @staticmethod
    def batches(connections: int, content_type: str = JSON_TYPE) -> Posts:
        """Load (2): JSON arrays of BATCH_MESSAGES messages to one stream."""
        return Posts(batch(BATCH_MESSAGES), BATCH_MESSAGES, 1, connections, content_type)


def run_wrk(target: Target, options: Options, posts: Posts) -> dict:
    body_file = target.work_dir / "body.json"
    body_file.write_bytes(posts.body)
    env = {
        **os.environ,
        "BENCH_BODY_FILE": str(body_file),
        "BENCH_STREAMS": str(posts.streams),
        "BENCH_PREFIX": f"{STREAM_PREFIX}s",
        "BENCH_CONTENT_TYPE": posts.content_type,
        **({"BENCH_TOKEN": posts.token} if posts.token else {}),
    }
    command = [
        "wrk",
        "-t1",
        f"-c{posts.connections}",
        f"-d{options.duration}s",
        "--timeout",
        WRK_TIMEOUT,
        "-s",
        str(servers.BENCH_DIR / "append.lua"),
        target.server.url,
    ]
    completed = subprocess.run(
        servers.pinned(options.client_core, command),
        env=env,
        capture_output=True,
        text=True,
        timeout=options.duration + 60,
    )
    for line in completed.stdout.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[len("BENCH ") :])
    raise RuntimeError(f"wrk printed no summary:\n{completed.stdout}\n{completed.stderr}")


def post_load(target: Target, options: Options, posts: Posts) -> Result:
    """Create the streams, then POST to them with wrk."""
    paths = [f"{STREAM_PREFIX}s{number}" for number in range(posts.streams)]
    asyncio.run(create_streams(target.port, paths, posts.content_type))
    return wrk_load(target, options, posts)


def wrk_load(target: Target, options: Options, posts: Posts) -> Result:
    """POST with wrk to streams that exist (or to any app that takes POSTs)."""
    result = Result()
    with cpu_use(target, result):
        summary = run_wrk(target, options, posts)
    seconds = summary["duration_us"] / 1e6
    socket_errors = sum(
        summary[key] for key in ("connect_errors", "read_errors", "write_errors", "timeouts")
    )
    succeeded = sum(count for status, count in summary["statuses"].items() if status[0] == "2")
    failed = summary["requests"] - succeeded + socket_errors
    result.figures.update(
        messages=succeeded * posts.messages_per_post,
        msgs_per_s=succeeded * posts.messages_per_post / seconds,
        mb_per_s=succeeded * len(posts.body) / seconds / 1e6,
        p50_ms=summary["p50_us"] / 1000,
        p99_ms=summary["p99_us"] / 1000,
        errors_pct=100 * failed / max(1, summary["requests"] + socket_errors),
    )
    if failed:
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(summary["statuses"].items()))
        result.notes.append(
            f"{failed} failed POSTs of {summary['requests'] + socket_errors} (statuses {statuses};"
            f" socket errors: connect {summary['connect_errors']}, read {summary['read_errors']},"
            f" write {summary['write_errors']}, timeout {summary['timeouts']})"
        )
        result.notes += server_log_errors(target)
    return result


def appends_one_stream(target: Target, options: Options) -> Result:
    return post_load(target, options, Posts.single(1, options.connections))


def appends_many_streams(target: Target, options: Options) -> Result:
    return post_load(target, options, Posts.single(options.streams, options.connections))


def batched_appends(target: Target, options: Options) -> Result:
    return post_load(target, options, Posts.batches(options.batch_connections))


# (3) catch-up read


def catch_up(target: Target, options: Options) -> Result:
    return asyncio.run(catch_up_async(target, options))


async def catch_up_async(target: Target, options: Options) -> Result:
    path = f"{STREAM_PREFIX}large"
    await create_streams(target.port, [path])
    body = batch(POPULATE_MESSAGES)
    posts = math.ceil(options.catchup_mb * 1e6 / len(body))
    writer = Connection(target.port)
    for _ in range(posts):
        response = await asyncio.wait_for(
            writer.request("POST", path, JSON_HEADERS, body), POST_TIMEOUT_SECONDS * 3
        )
        check(response.status, "POST")
    await writer.close()
    result = Result()
    with peak_memory(target, result), cpu_use(target, result):
        total, responses, first_byte, elapsed = await read_to_tail(target.port, path)
    result.figures.update(mb_per_s=total / elapsed / 1e6, ttfb_ms=first_byte * 1000)
    # Each response is "[" + its messages joined by commas + "]": one byte per message
    # besides the message itself, plus one per response.
    expected = posts * (len(body) - 1) + responses
    if total != expected:
        result.notes.append(f"read {total:,} bytes in {responses} responses, expected {expected:,}")
    result.details.append(f"{total / 1e6:.1f} MB read in {responses} responses")
    return result


async def read_to_tail(port: int, path: str) -> tuple[int, int, float, float]:
    """Read from -1 following Stream-Next-Offset; (bytes, responses, first byte s, total s)."""
    total = [0]

    def count(piece: bytes) -> None:
        total[0] += len(piece)

    reader = Connection(port)
    offset, responses, first_byte = "-1", 0, math.nan
    started = time.monotonic()
    deadline = started + 30
    while time.monotonic() < deadline:
        response = await asyncio.wait_for(
            reader.request("GET", f"{path}?offset={offset}", sink=count),
            deadline - time.monotonic(),
        )
        check(response.status, "catch-up GET")
        if responses == 0:
            first_byte = response.first_byte_at - started
        responses += 1
        offset = response.headers["stream-next-offset"]
        if response.headers.get("stream-up-to-date") == "true":
            break
    elapsed = time.monotonic() - started
    await reader.close()
    return total[0], responses, first_byte, elapsed


# (4) live latency: append start -> event received, one event at a time


def live_sse(target: Target, options: Options) -> Result:
    return asyncio.run(live_latency(target, options, "sse"))


def live_long_poll(target: Target, options: Options) -> Result:
    return asyncio.run(live_latency(target, options, "long-poll"))


async def live_latency(target: Target, options: Options, mode: str) -> Result:
    path = f"{STREAM_PREFIX}live"
    tail = await create_streams(target.port, [path])
    loop = asyncio.get_running_loop()
    waiting: dict[int, asyncio.Future[float]] = {}

    def on_message(number: int, arrived_at: float) -> None:
        future = waiting.get(number)
        if future is not None and not future.done():
            future.set_result(arrived_at)

    if mode == "sse":
        subscriber = await subscribe(target.port, f"{path}?offset={tail}&live=sse", on_message)
        await asyncio.wait_for(subscriber.ready, 10)
        stop_reader: Callable[[], None] = subscriber.close
    else:
        task = asyncio.create_task(long_poll_reader(target.port, path, tail, on_message))
        stop_reader = task.cancel
    result = Result()
    latencies: list[float] = []
    missed = 0
    writer = Connection(target.port)
    deadline = time.monotonic() + 30
    with cpu_use(target, result):
        for number in range(options.events):
            if time.monotonic() > deadline:
                result.notes.append(f"stopped at the 30 s limit after {number} events")
                break
            waiting[number] = loop.create_future()
            started = time.monotonic()
            response = await writer.request("POST", path, JSON_HEADERS, message(number))
            check(response.status, "POST")
            try:
                arrived_at = await asyncio.wait_for(waiting[number], LIVE_EVENT_TIMEOUT_SECONDS)
                latencies.append(arrived_at - started)
            except TimeoutError:
                missed += 1
            await asyncio.sleep(LIVE_PAUSE_SECONDS)
    stop_reader()
    await writer.close()
    result.figures.update(
        p50_ms=1000 * percentile(latencies, 0.50), p99_ms=1000 * percentile(latencies, 0.99)
    )
    result.details.append(f"{len(latencies)} events timed")
    if missed:
        result.notes.append(f"{missed} events not received within {LIVE_EVENT_TIMEOUT_SECONDS} s")
    return result


async def long_poll_reader(
    port: int, path: str, offset: str, on_message: Callable[[int, float], None]
) -> None:
    """Follow the stream with long-poll until cancelled, reporting each message's arrival."""
    connection = Connection(port)
    cursor = ""
    try:
        while True:
            query = f"{path}?offset={offset}&live=long-poll" + (
                f"&cursor={cursor}" if cursor else ""
            )
            response = await connection.request("GET", query)
            arrived_at = time.monotonic()
            if response.status == 200:
                for number in find_message_ids(response.body):
                    on_message(number, arrived_at)
            elif response.status != 204:
                raise HttpError(f"long-poll answered {response.status}")
            offset = response.headers["stream-next-offset"]
            cursor = response.headers.get("stream-cursor", "")
    finally:
        await connection.close()


# (5) fan-out: many SSE subscribers on one stream, one producer at a fixed rate


def fanout(subscribers: int) -> Callable[[Target, Options], Result]:
    def run(target: Target, options: Options) -> Result:
        return asyncio.run(fanout_async(target, options, subscribers))

    return run


async def fanout_async(target: Target, options: Options, count: int) -> Result:
    """Subscribers join at the tail, then the producer writes `rate × duration` messages.

    A message's latency runs from its scheduled send time to its arrival at a subscriber;
    "delivered" counts arrivals within FANOUT_GRACE_SECONDS of the last POST's answer,
    over subscribers asked for × messages scheduled.
    """
    path = f"{STREAM_PREFIX}fan"
    tail = await create_streams(target.port, [path])
    scheduled: dict[int, float] = {}
    latencies = array("d")
    result = Result()

    def on_message(number: int, arrived_at: float) -> None:
        latencies.append(arrived_at - scheduled[number])

    producers = [Connection(target.port) for _ in range(PRODUCER_CONNECTIONS)]
    connecting = time.monotonic()
    with peak_memory(target, result):
        async with kept_busy(producers, path):
            subscribers, failures = await connect_subscribers(
                target.port, f"{path}?offset={tail}&live=sse", on_message, count
            )
        result.figures["connected"] = len(subscribers)
        result.details.append(
            f"{len(subscribers)} subscribers ready after {time.monotonic() - connecting:.1f} s"
        )
        for failure, times in failures.most_common(3):
            result.notes.append(f"{times} subscribers not connected: {failure}")
        messages = int(options.fanout_rate * options.duration)
        with cpu_use(target, result):
            accepted = await produce(
                path, options.fanout_rate, messages, scheduled, producers, result
            )
            deadline = time.monotonic() + FANOUT_GRACE_SECONDS
            while len(latencies) < len(subscribers) * accepted and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
    ended = sum(1 for subscriber in subscribers if subscriber.lost.done())
    for subscriber in subscribers:
        subscriber.close()
    expected = count * messages
    result.figures.update(
        delivered_pct=100 * len(latencies) / expected if expected else 0.0,
        p50_ms=1000 * percentile(latencies, 0.50),
        p99_ms=1000 * percentile(latencies, 0.99),
    )
    (result.notes if len(latencies) < expected else result.details).append(
        f"{messages} messages sent, {accepted} POSTs answered 2xx;"
        f" {len(latencies):,} of {expected:,} deliveries made"
    )
    if ended:
        result.notes.append(f"{ended} subscriptions ended before the load did")
    return result


@asynccontextmanager
async def kept_busy(producers: list[Connection], path: str) -> AsyncIterator[None]:
    """Keep the producer's connections in use (a HEAD a second) while subscribers connect.

    As if the producer were already writing when they arrived: servers close connections
    left idle before their first request, and a server full of subscribers may then not
    accept the producer again. So a connection limit turns away the last subscribers,
    which the figures show, not the producer.
    """
    stop = asyncio.Event()

    async def ping() -> None:
        while not stop.is_set():
            for producer in producers:
                await producer.request("HEAD", path)
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    pinger = asyncio.create_task(ping())
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(pinger, POST_TIMEOUT_SECONDS)


async def connect_subscribers(
    port: int, query: str, on_message: Callable[[int, float], None], count: int
) -> tuple[list[SseSubscriber], Counter[str]]:
    """Open `count` SSE subscriptions, at most CONNECT_CONCURRENCY at a time, by a deadline."""
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def connect() -> SseSubscriber:
        async with gate:
            subscriber = await subscribe(port, query, on_message)
            try:
                await subscriber.ready
            except BaseException:
                subscriber.close()
                raise
            return subscriber

    tasks = [asyncio.create_task(connect()) for _ in range(count)]
    done, pending = await asyncio.wait(tasks, timeout=CONNECT_DEADLINE_SECONDS)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    failures: Counter[str] = Counter()
    connected = []
    for task in done:
        if task.exception() is None:
            connected.append(task.result())
        else:
            failures[f"{type(task.exception()).__name__}: {task.exception()}"[:120]] += 1
    if pending:
        failures[f"not ready within {CONNECT_DEADLINE_SECONDS:.0f} s"] += len(pending)
    return connected, failures


async def produce(
    path: str,
    rate: float,
    messages: int,
    scheduled: dict[int, float],
    connections: list[Connection],
    result: Result,
) -> int:
    """POST numbered messages on a fixed schedule of `rate` a second; returns how many succeeded.

    Open loop: each POST is due at its scheduled time and goes out on the first idle
    connection of `connections`, so a slow server is offered the same load as a fast one
    and the wait for a connection counts in the latency. A POST not answered within
    POST_TIMEOUT_SECONDS of its time fails (its message may still be delivered later).
    """
    idle: asyncio.Queue[Connection] = asyncio.Queue()
    for connection in connections:
        idle.put_nowait(connection)
    answered: list[float] = []
    failures: Counter[str] = Counter()

    async def post(number: int) -> bool:
        connection = None
        try:
            async with asyncio.timeout(POST_TIMEOUT_SECONDS):
                connection = await idle.get()
                response = await connection.request("POST", path, JSON_HEADERS, message(number))
            check(response.status, "POST")
            answered.append(time.monotonic() - scheduled[number])
            return True
        except (HttpError, OSError, TimeoutError) as error:
            failures[repr(error)] += 1
            if connection is not None:
                await connection.close()  # its state is unknown; the next request reopens it
            return False
        finally:
            if connection is not None:
                idle.put_nowait(connection)

    started = time.monotonic()
    posts = []
    for number in range(messages):
        scheduled[number] = started + number / rate
        await asyncio.sleep(max(0.0, scheduled[number] - time.monotonic()))
        posts.append(asyncio.create_task(post(number)))
    succeeded = sum(await asyncio.gather(*posts))
    for connection in connections:
        await connection.close()
    for error, times in failures.items():
        result.notes.append(f"{times} producer POSTs failed: {error}")
    result.details.append(
        f"producer POSTs answered {1000 * percentile(answered, 0.5):.0f} ms (p50),"
        f" {1000 * percentile(answered, 0.99):.0f} ms (p99) after their scheduled time"
    )
    return succeeded


# (6) S3: requests moto serves per 1,000 messages, and per idle stream


def s3_appends(target: Target, options: Options) -> Result:
    assert target.moto is not None
    path = f"{STREAM_PREFIX}s0"
    asyncio.run(create_streams(target.port, [path]))
    mark = target.moto.log_path.stat().st_size  # the stream's creation is not counted
    result = wrk_load(target, options, Posts.single(1, options.connections))
    counts, _ = servers.count_s3_requests(target.moto.log_path, mark)
    messages = result.figures["messages"]
    for kind in ("PUT", "GET", "LIST", "HEAD"):
        result.figures[f"{kind.lower()}_per_1000"] = 1000 * counts[kind] / max(1.0, messages)
    result.figures["msgs_per_put"] = messages / max(1, counts["PUT"])
    others = {kind: n for kind, n in counts.items() if kind not in ("PUT", "GET", "LIST", "HEAD")}
    result.details.append(f"moto saw {dict(counts)} for {messages:,.0f} messages")
    if others:
        result.notes.append(f"other S3 requests: {others}")
    return result


def s3_idle(target: Target, options: Options) -> Result:
    return asyncio.run(s3_idle_async(target, options))


async def s3_idle_async(target: Target, options: Options) -> Result:
    """Count requests while K written-to streams sit idle, then while a long-poll waits on each."""
    assert target.moto is not None
    paths = [f"{STREAM_PREFIX}idle{number}" for number in range(options.idle_streams)]
    tails = {}
    for path in paths:
        await create_streams(target.port, [path])
    writer = Connection(target.port)
    for path in paths:
        response = await writer.request("POST", path, JSON_HEADERS, message())
        check(response.status, "POST")
        tails[path] = response.headers["stream-next-offset"]
        check((await writer.request("GET", f"{path}?offset=-1")).status, "GET")
    await writer.close()
    await asyncio.sleep(1)  # let anything the writes started settle
    result = Result()
    minutes = options.duration / 60
    mark = target.moto.log_path.stat().st_size
    with cpu_use(target, result):
        await asyncio.sleep(options.duration)
    counts, mark = servers.count_s3_requests(target.moto.log_path, mark)
    result.figures["idle_per_stream_min"] = sum(counts.values()) / len(paths) / minutes
    result.details.append(f"idle: moto saw {dict(counts)} in {options.duration} s")
    readers = [
        asyncio.create_task(long_poll_reader(target.port, path, tails[path], ignore))
        for path in paths
    ]
    await asyncio.sleep(0.5)
    mark = target.moto.log_path.stat().st_size
    await asyncio.sleep(options.duration)
    counts, _ = servers.count_s3_requests(target.moto.log_path, mark)
    for reader in readers:
        reader.cancel()
    outcomes = await asyncio.gather(*readers, return_exceptions=True)
    for outcome in outcomes:
        if not isinstance(outcome, asyncio.CancelledError):
            result.notes.append(f"a long-poll reader failed: {outcome!r}")
    result.figures["long_poll_per_stream_min"] = sum(counts.values()) / len(paths) / minutes
    result.details.append(f"one long-poll waiting per stream: moto saw {dict(counts)}")
    return result


LOADS = (
    Load(
        "appends-1",
        "(1) single-message appends, 1 stream, {connections} connections",
        appends_one_stream,
        ("msgs_per_s", "p50_ms", "p99_ms", "errors_pct", "client_cpu_pct", "server_cpu_pct"),
    ),
    Load(
        "appends-1000",
        "(1) single-message appends, {streams:,} streams, {connections} connections",
        appends_many_streams,
        ("msgs_per_s", "p50_ms", "p99_ms", "errors_pct", "client_cpu_pct", "server_cpu_pct"),
    ),
    Load(
        "batch",
        "(2) batched appends, 1,000 messages per POST, {batch_connections} connections",
        batched_appends,
        ("mb_per_s", "msgs_per_s", "p50_ms", "errors_pct", "client_cpu_pct", "server_cpu_pct"),
    ),
    Load(
        "catchup",
        "(3) catch-up read of a {catchup_mb} MB JSON stream from -1",
        catch_up,
        ("mb_per_s", "ttfb_ms", "rss_mib", "client_cpu_pct", "server_cpu_pct"),
    ),
    Load(
        "live-sse",
        "(4) live latency, append start → SSE event, {events} events",
        live_sse,
        ("p50_ms", "p99_ms", "client_cpu_pct"),
    ),
    Load(
        "live-long-poll",
        "(4) live latency, append start → long-poll answer, {events} events",
        live_long_poll,
        ("p50_ms", "p99_ms", "client_cpu_pct"),
    ),
    Load(
        "fanout-100",
        "(5) fan-out to 100 SSE subscribers, {fanout_rate:g} msg/s for {duration} s",
        fanout(100),
        ("delivered_pct", "p50_ms", "p99_ms", "rss_mib", "client_cpu_pct"),
    ),
    Load(
        "fanout-1000",
        "(5) fan-out to 1,000 SSE subscribers, {fanout_rate:g} msg/s for {duration} s",
        fanout(1000),
        ("delivered_pct", "p50_ms", "p99_ms", "rss_mib", "client_cpu_pct"),
    ),
    Load(
        "fanout-10000",
        "(5) fan-out to 10,000 SSE subscribers, {fanout_rate:g} msg/s for {duration} s",
        fanout(10_000),
        ("connected", "delivered_pct", "p50_ms", "p99_ms", "rss_mib", "client_cpu_pct"),
    ),
    Load(
        "s3-appends",
        "(6) S3 (moto): single-message appends, 1 stream, {connections} connections",
        s3_appends,
        (
            "msgs_per_s",
            "put_per_1000",
            "get_per_1000",
            "list_per_1000",
            "head_per_1000",
            "msgs_per_put",
            "errors_pct",
        ),
        s3=True,
    ),
    Load(
        "s3-idle",
        "(6) S3 (moto): requests per stream per minute, {idle_streams} streams",
        s3_idle,
        ("idle_per_stream_min", "long_poll_per_stream_min"),
        s3=True,
    ),
)
GROUPS = {
    "appends": ("appends-1", "appends-1000"),
    "live": ("live-sse", "live-long-poll"),
    "fanout": ("fanout-100", "fanout-1000", "fanout-10000"),
    "s3": ("s3-appends", "s3-idle"),
}
