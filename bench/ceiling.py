"""Measure the floors under PicoMQ's append rates and live latency on this machine.

1. The stack. A trivial Flask app (bench/trivial_app.py: read the body, answer 204),
   served exactly as PicoMQ is (`gunicorn -c gunicorn.conf.py`, one PicoMQWorker,
   pinned to the server core), takes compare.py's appends-1 load: wrk, 64 connections,
   one 100-byte JSON message per POST, on the client core. Then PicoMQ itself, one
   stream, takes the same load. No Flask handler served this way answers faster than
   the trivial one. The same pair then takes compare.py's batch load (JSON arrays of
   1,000 messages, 8 connections), and PicoMQ once more with the same bodies sent as
   application/octet-stream: everything but its JSON work. That work (depth and
   UTF-8 checks, msgspec's split, the join) is then timed alone on one such body.
   Last, the JSON batch load once more with PicoMQ's data on tmpfs (/dev/shm, where
   Linux has it): storing is then a memory copy and an fsync costs nothing, so what
   remains is the stack and PicoMQ's own work.
   Both PicoMQ loads, one stream and batched, then go once more to PicoMQ's store
   behind a bare WSGI callable (bench/bare_append_app.py): each POST's body goes
   straight to the JSON split and `StreamStore.append`, with no Flask request, hooks,
   metrics or access line. The difference is what PicoMQ's HTTP layer costs an append.
   Then compare.py's appends-1000 load (the same POSTs, round-robin over 1,000
   streams, so no two appends share a commit) to PicoMQ, to its store without Flask,
   and to that store with its data on tmpfs: the most the store takes over 1,000
   streams when its writes cost nothing but the work of each commit. Then the same
   load to PicoMQ with its store's appends answered at once (bench/storeless_app.py):
   the most PicoMQ could take with a store that cost nothing.
   Under all of these, a bare WSGI callable (`bench.trivial_app:bare`: read the body,
   answer 204, no Flask) takes the single-append load: the most this worker serves.
   First of all, the trivial app answers one POST at a time on one connection: an HTTP
   round trip alone.
2. Durability. Durable create-only writes of a 200-byte object as PicoMQ's local
   store makes them. One at a time as it creates metadata (`localdisk.create_durably`:
   temporary file, fsync, link, directory fsync), then the same steps with each fsync
   timed alone, then one at a time as it creates segments (`localdisk.publish_then_sync`:
   temporary file, link, one syncfs), then segments from 64 concurrent callers over
   1,000 directories, batched as PicoMQ batches them (`localdisk.BatchedCreates`: one
   syncfs per batch of segments), with the CPU time each costs. These run on the
   server core, where PicoMQ's worker makes them.
3. Live latency. compare.py's live loads send one event at a time with a pause between
   them, so the server's caches are cold at every event. The bare callable and the
   trivial app take one POST at a time with that pause: the round trip those loads
   can get at best. Then PicoMQ takes the live SSE and long-poll loads themselves,
   with its data on disk and on tmpfs, where an fsync costs nothing: what is left on
   tmpfs is what the stack and PicoMQ's own work cost an event.

    .venv/bin/python bench/ceiling.py                  # ≈ 2 min; more on a slow disk
    .venv/bin/python bench/ceiling.py --duration 5

Servers listen on 127.0.0.1 only and are stopped by PID. Everything is written in a
temporary directory under bench/results/ (the repository's filesystem, which is what
PicoMQ's data would be on here), removed at the end; the figures are also saved as
bench/results/ceiling-*.json.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import gevent
import loads
import servers
from compare import MAX_DURATION_SECONDS, RESULTS_DIR, describe_run, evict_from_page_cache
from loads import Options, Result, Target, percentile

sys.path.insert(0, str(servers.REPO_DIR))
from localdisk import (  # noqa: E402
    BatchedCreates,
    create_durably,
    fsync_directory,
    publish_then_sync,
)
from objectstore import run_in_threadpool  # noqa: E402
from protocol import parse_json_payload  # noqa: E402
from settings import Settings  # noqa: E402

OBJECT = b"x" * 200
OCTETS = "application/octet-stream"
SEQUENTIAL_DEADLINE_SECONDS = 10.0  # per sequential phase: a slow disk stops it early
JOIN_GRACE_SECONDS = 10.0  # parallel phase: for the creates under way at its end
PARALLEL_DIRECTORIES = 1000
PARALLEL_CALLERS = 64  # as many as compare.py's appends have connections

Figures = dict[str, float]


def wrk_trivial(target: Target, options: Options) -> Result:
    """compare.py's appends-1 load, less the stream creation the trivial app has no use for."""
    return loads.wrk_load(target, options, loads.Posts.single(1, options.connections))


def wrk_trivial_batch(target: Target, options: Options) -> Result:
    """compare.py's batch load (JSON arrays of 1,000 messages), to the trivial app."""
    return loads.wrk_load(target, options, loads.Posts.batches(options.batch_connections))


def serial_round_trips(target: Target, options: Options) -> Result:
    """One 100-byte POST at a time on one kept-alive connection: an HTTP round trip alone.

    The least time between a producer starting an append and anything seeing it, before
    any storage is touched: with the durable create below, the floor of live latency.
    """
    return round_trips(target, options, pause=0.0)


def paced_round_trips(target: Target, options: Options) -> Result:
    """The same, with compare.py's pause between live events after each answer.

    The live loads send one event at a time with that pause, and the server's caches
    go cold between events: this is the round trip those loads can get at best.
    """
    return round_trips(target, options, pause=loads.LIVE_PAUSE_SECONDS)


def round_trips(target: Target, options: Options, *, pause: float) -> Result:
    connection = http.client.HTTPConnection(servers.HOST, target.port, timeout=10)
    body, headers = loads.message(), {"Content-Type": "application/json"}
    latencies: list[float] = []
    started_all = time.monotonic()
    while len(latencies) < SERIAL_REQUESTS and time.monotonic() - started_all < options.duration:
        started = time.perf_counter()
        connection.request("POST", "/serial", body, headers)
        connection.getresponse().read()
        latencies.append(time.perf_counter() - started)
        time.sleep(pause)
    connection.close()
    figures = latency_figures(latencies)
    figures["msgs_per_s"] = len(latencies) / sum(latencies)
    return Result(figures=figures)


def batched_bytes(target: Target, options: Options) -> Result:
    """The batch load's bodies to an octet-stream stream: PicoMQ minus its JSON work."""
    return loads.post_load(target, options, loads.Posts.batches(options.batch_connections, OCTETS))


MEMORY_FILESYSTEM = Path("/dev/shm")
BARE_STORE_APP = "bench.bare_append_app:app"
# (name, app, load, data on MEMORY_FILESYSTEM rather than next to bench/results)
STACKS: tuple[tuple[str, str, Callable[[Target, Options], Result], bool], ...] = (
    ("trivial_serial", "bench.trivial_app:app", serial_round_trips, False),
    ("trivial", "bench.trivial_app:app", wrk_trivial, False),
    ("bare_wsgi", "bench.trivial_app:bare", wrk_trivial, False),
    ("picomq", "wsgi:app", loads.appends_one_stream, False),
    ("trivial_batch", "bench.trivial_app:app", wrk_trivial_batch, False),
    ("picomq_batch", "wsgi:app", loads.batched_appends, False),
    ("picomq_bytes", "wsgi:app", batched_bytes, False),
    ("picomq_batch_memory", "wsgi:app", loads.batched_appends, True),
    ("bare_store", BARE_STORE_APP, loads.appends_one_stream, False),
    ("bare_store_batch", BARE_STORE_APP, loads.batched_appends, False),
    ("picomq_many", "wsgi:app", loads.appends_many_streams, False),
    ("bare_store_many", BARE_STORE_APP, loads.appends_many_streams, False),
    ("bare_store_many_memory", BARE_STORE_APP, loads.appends_many_streams, True),
    ("storeless_many", "bench.storeless_app:app", loads.appends_many_streams, False),
    ("paced_bare", "bench.trivial_app:bare", paced_round_trips, False),
    ("paced_trivial", "bench.trivial_app:app", paced_round_trips, False),
    ("live_sse", "wsgi:app", loads.live_sse, False),
    ("live_sse_memory", "wsgi:app", loads.live_sse, True),
    ("live_long_poll", "wsgi:app", loads.live_long_poll, False),
    ("live_long_poll_memory", "wsgi:app", loads.live_long_poll, True),
)
JSON_PARSES = 200
SERIAL_REQUESTS = 2000


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration",
        type=int,
        default=8,
        help=f"seconds of each wrk load, 1–{MAX_DURATION_SECONDS} (default 8)",
    )
    parser.add_argument("--connections", type=int, default=64, help="wrk connections")
    parser.add_argument("--creates", type=int, default=500, help="sequential durable creates")
    parser.add_argument(
        "--parallel-seconds", type=float, default=3.0, help="seconds of parallel creates"
    )
    parser.add_argument("--server-core", type=int, default=0, help="core the servers run on")
    parser.add_argument("--client-core", type=int, default=1, help="core wrk runs on")
    arguments = parser.parse_args()
    if not 1 <= arguments.duration <= MAX_DURATION_SECONDS:
        parser.error(f"--duration must be 1–{MAX_DURATION_SECONDS} seconds")
    if not 0 < arguments.parallel_seconds <= MAX_DURATION_SECONDS:
        parser.error(f"--parallel-seconds must be above 0 and at most {MAX_DURATION_SECONDS}")
    return arguments


def main() -> None:
    arguments = parse_arguments()
    options = Options(
        duration=arguments.duration,
        connections=arguments.connections,
        client_core=arguments.client_core,
    )
    open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    machine, command = describe_run("bench/ceiling.py", open_files)
    RESULTS_DIR.mkdir(exist_ok=True)
    work_root = Path(tempfile.mkdtemp(prefix="ceiling-", dir=RESULTS_DIR))
    print(f"files on {describe_filesystem(work_root)}\n", flush=True)
    figures: dict[str, Figures] = {}
    notes: list[str] = []
    try:
        os.sched_setaffinity(0, {arguments.client_core})
        for name, app, load, in_memory in STACKS:
            if in_memory and not MEMORY_FILESYSTEM.is_dir():
                notes.append(f"{name}: skipped, no {MEMORY_FILESYSTEM} here")
                continue
            figures[name] = measure_stack(
                name, app, load, work_root, options, arguments, notes, in_memory=in_memory
            )
        # PicoMQ's worker, and the thread pool it fsyncs from, run on the server core.
        os.sched_setaffinity(0, {arguments.server_core})
        figures.update(measure_durability(work_root, arguments, notes))
        figures["json_parse"] = time_json_parse(JSON_PARSES)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    print(f"\n{format_table(figures, arguments)}")
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {note}" for note in notes))
    path = RESULTS_DIR / f"ceiling-{time.strftime('%Y%m%d-%H%M%S')}.json"
    record = {**machine, "command": command, "figures": figures, "notes": notes}
    path.write_text(json.dumps(record, indent=1))
    print(f"raw figures: {path.relative_to(servers.REPO_DIR)}")


def measure_stack(
    name: str,
    app: str,
    load: Callable[[Target, Options], Result],
    work_root: Path,
    options: Options,
    arguments: argparse.Namespace,
    notes: list[str],
    *,
    in_memory: bool,
) -> Figures:
    """Start `app` as PicoMQ is served, run the wrk load, stop it; {} if anything failed."""
    work_dir = work_root / name
    work_dir.mkdir()
    # On disk, the data stays until the run ends: deleting it would slow the next loads.
    memory_dir = Path(tempfile.mkdtemp(dir=MEMORY_FILESYSTEM)) if in_memory else None
    in_memory_env = {"PICOMQ_STORAGE_URL": str(memory_dir)} if memory_dir else None
    server = servers.served_as_picomq(name, app, work_dir, arguments.server_core, in_memory_env)
    try:
        result = load(Target(server.start(), work_dir), options)
    except Exception as error:  # noqa: BLE001 - the other measurements still run
        notes.append(f"{name}: {''.join(traceback.format_exception_only(error)).strip()}")
        if not isinstance(error, servers.ProcessFailed):  # which carries the output already
            notes.append(server.output_tail())
        return {}
    finally:
        server.stop()
        evict_from_page_cache(work_dir)  # as compare.py does: the next load starts alike
        if memory_dir is not None:
            shutil.rmtree(memory_dir, ignore_errors=True)  # tmpfs keeps it in memory till then
    notes += [f"{name}: {note}" for note in result.notes]
    figures = result.figures
    line = f"{name:22} p50 {figures['p50_ms']:.2f} ms · p99 {figures['p99_ms']:.2f} ms"
    if "msgs_per_s" in figures:  # all but the live loads
        line += f" · {figures['msgs_per_s']:,.0f} messages/s"
    if "mb_per_s" in figures:  # the wrk loads
        line += f" · {figures['mb_per_s']:.1f} MB/s · server CPU {figures['server_cpu_pct']:.0f} %"
    print(line, flush=True)
    return figures


def measure_durability(
    work_root: Path, arguments: argparse.Namespace, notes: list[str]
) -> dict[str, Figures]:
    creates = time_sequential_creates(work_root / "sequential", create_durably, arguments.creates)
    file_fsyncs, directory_fsyncs = time_fsyncs(work_root / "fsyncs", arguments.creates)
    segments = time_sequential_creates(work_root / "segments", publish_then_sync, arguments.creates)
    parallel, elapsed, cpu_seconds = time_parallel_creates(
        work_root / "parallel", PARALLEL_CALLERS, arguments.parallel_seconds, notes
    )
    for what, done in (
        ("sequential creates", creates),
        ("fsyncs alone", file_fsyncs),
        ("sequential segment creates", segments),
    ):
        if len(done) < arguments.creates:
            notes.append(f"{what}: {len(done)} of {arguments.creates} within the deadline")
    figures = {
        "create": latency_figures(creates),
        "file_fsync": latency_figures(file_fsyncs),
        "directory_fsync": latency_figures(directory_fsyncs),
        "segment_create": latency_figures(segments),
        "parallel": latency_figures(parallel),
    }
    for key, done in (("create", creates), ("segment_create", segments)):
        figures[key]["per_s"] = len(done) / sum(done) if done else 0.0
    figures["parallel"]["per_s"] = len(parallel) / elapsed
    figures["parallel"]["cpu_ms"] = 1000 * cpu_seconds / len(parallel) if parallel else 0.0
    print(
        f"durable create {figures['create']['p50_ms']:.2f} ms p50 one at a time, "
        f"segment {figures['segment_create']['p50_ms']:.2f} ms · "
        f"{figures['parallel']['per_s']:,.0f}/s batched from {PARALLEL_CALLERS} callers",
        flush=True,
    )
    return figures


def time_json_parse(count: int) -> Figures:
    """PicoMQ's JSON work on the batch load's body: check it, split it, join the messages."""
    body = loads.batch(loads.BATCH_MESSAGES)
    defaults = Settings.from_environment({})  # the server's limits, as it parses appends
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        parse_json_payload(
            body,
            allow_empty=False,
            max_depth=defaults.max_json_depth,
            max_messages=defaults.max_append_messages,
        )
        latencies.append(time.perf_counter() - started)
    figures = latency_figures(latencies)
    figures["mb_per_s"] = len(body) / percentile(latencies, 0.5) / 1e6
    return figures


def time_sequential_creates(
    directory: Path, create: Callable[[str, bytes], None], count: int
) -> list[float]:
    """Seconds each durable create took, one after the other, in one existing directory."""
    directory.mkdir()
    latencies: list[float] = []
    deadline = time.monotonic() + SEQUENTIAL_DEADLINE_SECONDS
    for number in range(count):
        if time.monotonic() > deadline:
            break
        started = time.perf_counter()
        create(f"{directory}/{number:08d}", OBJECT)
        latencies.append(time.perf_counter() - started)
    return latencies


def time_fsyncs(directory: Path, count: int) -> tuple[list[float], list[float]]:
    """The two fsyncs of a durable create timed apart: the new file's, then its directory's.

    The steps of localdisk.create_durably, in its order, with a clock around each fsync.
    """
    directory.mkdir()
    files: list[float] = []
    directories: list[float] = []
    deadline = time.monotonic() + SEQUENTIAL_DEADLINE_SECONDS
    for number in range(count):
        if time.monotonic() > deadline:
            break
        temporary = f"{directory}/.tmp-{number}"
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(descriptor, OBJECT)
            started = time.perf_counter()
            os.fsync(descriptor)
            files.append(time.perf_counter() - started)
        finally:
            os.close(descriptor)
        os.link(temporary, f"{directory}/{number:08d}")
        os.unlink(temporary)
        started = time.perf_counter()
        fsync_directory(str(directory))
        directories.append(time.perf_counter() - started)
    return files, directories


def time_parallel_creates(
    root: Path, callers: int, seconds: float, notes: list[str]
) -> tuple[list[float], float, float]:
    """Durable creates from `callers` greenlets for `seconds`, spread round-robin over
    PARALLEL_DIRECTORIES existing directories (as appends to that many streams would be),
    batched as PicoMQ's local store batches them (`localdisk.BatchedCreates` on
    gevent's thread pool).

    Returns each create's seconds, the time until the last caller finished, and the CPU
    time (user and system) this process spent meanwhile: what each create costs the
    core, which an append to a stream of its own pays in full.
    """
    directories = [root / f"d{number:04d}" for number in range(PARALLEL_DIRECTORIES)]
    for directory in directories:
        directory.mkdir(parents=True)
    creates = BatchedCreates(run_in_threadpool)
    turns = itertools.count()
    latencies: list[float] = []
    cpu_before = os.times()
    started = time.monotonic()
    deadline = started + seconds

    def create() -> None:
        while time.monotonic() < deadline:
            number = next(turns)
            path = f"{directories[number % len(directories)]}/{number:08d}"
            began = time.perf_counter()
            try:
                creates.create(path, OBJECT, verified_on_load=True)
            except OSError as error:
                notes.append(f"parallel create failed: {error!r}")
                return
            latencies.append(time.perf_counter() - began)

    running = [gevent.spawn(create) for _ in range(callers)]
    gevent.joinall(running, timeout=seconds + JOIN_GRACE_SECONDS)
    stuck = sum(not greenlet.dead for greenlet in running)
    if stuck:
        notes.append(f"{stuck} callers still in a create {JOIN_GRACE_SECONDS:.0f} s after the end")
        gevent.killall(running, block=False)
    cpu_after = os.times()
    cpu_seconds = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    return list(latencies), time.monotonic() - started, cpu_seconds


def latency_figures(latencies: list[float]) -> Figures:
    return {
        "count": len(latencies),
        "p50_ms": 1000 * percentile(latencies, 0.50),
        "p99_ms": 1000 * percentile(latencies, 0.99),
    }


def describe_filesystem(path: Path) -> str:
    """The mount holding `path`, from /proc/self/mounts: device, type, mount point."""
    found = ("?", "?", "")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        device, mount_point, kind = line.split()[:3]
        inside = path == Path(mount_point) or Path(mount_point) in path.parents
        if inside and len(mount_point) > len(found[2]):
            found = (device, kind, mount_point)
    return f"{found[0]} ({found[1]}, mounted on {found[2]})"


def format_table(figures: dict[str, Figures], arguments: argparse.Namespace) -> str:
    load = f"{arguments.connections} connections, 100-byte JSON POSTs, {arguments.duration} s"
    served = (
        ("p50_ms", "p50 ms", "{:,.2f}"),
        ("p99_ms", "p99 ms", "{:,.2f}"),
        ("errors_pct", "errors %", "{:.1f}"),
        ("server_cpu_pct", "server CPU % of a core", "{:.0f}"),
        ("client_cpu_pct", "client CPU % of a core", "{:.0f}"),
    )
    messages = (("msgs_per_s", "messages/s (2xx)", "{:,.0f}"), *served)
    megabytes = (("mb_per_s", "MB/s of bodies (2xx)", "{:,.1f}"), *served)
    latency = (("p50_ms", "p50 ms", "{:,.2f}"), ("p99_ms", "p99 ms", "{:,.2f}"))
    one_at_a_time = f"{len(OBJECT)}-byte objects, {arguments.creates} one at a time"
    batch_kb = len(loads.batch(loads.BATCH_MESSAGES)) // 1000
    batched = (
        f"{loads.BATCH_MESSAGES:,}-message JSON arrays (≈{batch_kb} KB) per POST, "
        f"{Options.batch_connections} connections"
    )
    round_trip = (("p50_ms", "round trip p50 ms", "{:,.2f}"), ("p99_ms", "p99 ms", "{:,.2f}"))
    event = (("p50_ms", "append start → event p50 ms", "{:,.2f}"), ("p99_ms", "p99 ms", "{:,.2f}"))
    pause_ms = 1000 * loads.LIVE_PAUSE_SECONDS
    live = f"{Options.events} events, one at a time, {pause_ms:g} ms apart"
    sections = (
        (
            f"(1) trivial Flask app, one 100-byte POST at a time, {SERIAL_REQUESTS:,} of them",
            "trivial_serial",
            round_trip,
        ),
        (
            f"(1) trivial Flask app served as PicoMQ is, {load}",
            "trivial",
            (("msgs_per_s", "requests/s (2xx)", "{:,.0f}"), *served),
        ),
        (
            f"(1) bare WSGI callable (read the body, answer 204), {load}",
            "bare_wsgi",
            (("msgs_per_s", "requests/s (2xx)", "{:,.0f}"), *served),
        ),
        (
            f"(1) PicoMQ, 1 stream, {load}",
            "picomq",
            messages,
        ),
        (
            f"(1) trivial Flask app, {batched}",
            "trivial_batch",
            megabytes,
        ),
        (
            f"(1) PicoMQ, 1 stream, {batched}",
            "picomq_batch",
            megabytes,
        ),
        (
            f"(1) PicoMQ, 1 stream, the same bodies as {OCTETS} (no JSON work)",
            "picomq_bytes",
            megabytes,
        ),
        (
            f"(1) PicoMQ, 1 stream, {batched}, data on tmpfs ({MEMORY_FILESYSTEM})",
            "picomq_batch_memory",
            megabytes,
        ),
        (
            f"(1) PicoMQ's store without Flask (bench/bare_append_app.py), 1 stream, {load}",
            "bare_store",
            messages,
        ),
        (
            f"(1) PicoMQ's store without Flask, 1 stream, {batched}",
            "bare_store_batch",
            megabytes,
        ),
        (
            f"(1) PicoMQ, round-robin over {Options.streams:,} streams, {load}",
            "picomq_many",
            messages,
        ),
        (
            f"(1) PicoMQ's store without Flask, {Options.streams:,} streams, {load}",
            "bare_store_many",
            messages,
        ),
        (
            f"(1) the same, data on tmpfs ({MEMORY_FILESYSTEM}): no disk work",
            "bare_store_many_memory",
            messages,
        ),
        (
            "(1) PicoMQ, its store's appends answered at once (bench/storeless_app.py), "
            f"{Options.streams:,} streams, {load}",
            "storeless_many",
            messages,
        ),
        (
            f"(1) PicoMQ's JSON check and split of one such body, {JSON_PARSES} times, here",
            "json_parse",
            (*latency, ("mb_per_s", "MB/s (1 ÷ p50)", "{:,.1f}")),
        ),
        (
            f"(2) durable create (`create_durably`), {one_at_a_time}",
            "create",
            (*latency, ("per_s", "creates/s (1 ÷ mean)", "{:,.0f}")),
        ),
        (f"(2) its file fsync alone, {one_at_a_time}", "file_fsync", latency),
        (f"(2) its directory fsync alone, {one_at_a_time}", "directory_fsync", latency),
        (
            f"(2) durable segment create (`publish_then_sync`), {one_at_a_time}",
            "segment_create",
            (*latency, ("per_s", "creates/s (1 ÷ mean)", "{:,.0f}")),
        ),
        (
            f"(2) batched durable segment creates from {PARALLEL_CALLERS} callers over "
            f"{PARALLEL_DIRECTORIES:,} directories, {arguments.parallel_seconds:g} s",
            "parallel",
            (
                ("per_s", "creates/s", "{:,.0f}"),
                *latency,
                ("cpu_ms", "CPU ms per create (user + system)", "{:.3f}"),
            ),
        ),
        (
            f"(3) bare WSGI callable, one 100-byte POST every {pause_ms:g} ms",
            "paced_bare",
            round_trip,
        ),
        (
            f"(3) trivial Flask app, one 100-byte POST every {pause_ms:g} ms",
            "paced_trivial",
            round_trip,
        ),
        (f"(3) PicoMQ, compare.py's live SSE load ({live})", "live_sse", event),
        (f"(3) the same, data on tmpfs ({MEMORY_FILESYSTEM})", "live_sse_memory", event),
        (f"(3) PicoMQ, compare.py's live long-poll load ({live})", "live_long_poll", event),
        ("(3) the same, data on tmpfs", "live_long_poll_memory", event),
    )
    lines = ["| measure | figure | value |", "|---|---|---:|"]
    for title, key, shown in sections:
        for row, (figure, label, style) in enumerate(shown):
            value = figures.get(key, {}).get(figure)
            cell = "—" if value is None else style.format(value)
            lines.append(f"| {title if row == 0 else ''} | {label} | {cell} |")
    picomq = figures.get("picomq", {})
    for floor, name in (("trivial", "trivial app"), ("bare_wsgi", "bare WSGI callable")):
        if figures.get(floor, {}).get("msgs_per_s") and "msgs_per_s" in picomq:
            ratio = picomq["msgs_per_s"] / figures[floor]["msgs_per_s"]
            lines.append(f"| (1) PicoMQ ÷ {name} | requests/s | {ratio:.2f} |")
    for served_by, bare, figure, unit in (
        ("picomq", "bare_store", "msgs_per_s", "messages/s"),
        ("picomq_batch", "bare_store_batch", "mb_per_s", "MB/s"),
        ("picomq_many", "bare_store_many", "msgs_per_s", "messages/s"),
    ):
        through_flask, without = figures.get(served_by, {}), figures.get(bare, {})
        if without.get(figure) and figure in through_flask:
            ratio = through_flask[figure] / without[figure]
            title = f"(1) PicoMQ ÷ its store without Flask, {served_by}"
            lines.append(f"| {title} | {unit} | {ratio:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
