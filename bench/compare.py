"""Benchmark PicoMQ against the Durable Streams reference server, side by side.

For each load (see loads.py), each rep starts a fresh PicoMQ (one gunicorn gevent worker)
and a fresh reference server (@durable-streams/server 0.3.7, file-backed), each with a
new data directory and pinned to the server core, and measures them one after the other
— PicoMQ first on even reps, the reference first on odd ones. The load generators (wrk
and this process's asyncio client) run on the client core. Prints, per figure, the
median and min–max of each server and the PicoMQ ÷ reference ratio of every rep: the
machine is shared and noisy, so only same-run ratios mean anything. The S3 loads run
PicoMQ alone, on moto_server.

    cd bench && npm ci && cd ..              # once: the reference server
    .venv/bin/python bench/compare.py        # everything, 3 reps, 10 s loads
    .venv/bin/python bench/compare.py --only appends,fanout --reps 3 --duration 3

Raw figures and notes go to bench/results/ (ignored by git); `--readme` also replaces
the figures section of bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import loads
import requests
import servers
from loads import LOADS, Load, Options, Result, Target
from profiling import profiled

RESULTS_DIR = servers.BENCH_DIR / "results"
README = servers.BENCH_DIR / "README.md"
README_START, README_END = "<!-- figures:start -->", "<!-- figures:end -->"
MAX_DURATION_SECONDS = 30
NAMES = ("picomq", "reference")


@dataclass(frozen=True)
class Figure:
    label: str
    format: str
    ratio: bool = True  # whether a PicoMQ ÷ reference ratio means anything


FIGURES = {
    "msgs_per_s": Figure("messages/s", "{:,.0f}"),
    "mb_per_s": Figure("MB/s", "{:,.1f}"),
    "p50_ms": Figure("p50 ms", "{:,.2f}"),
    "p99_ms": Figure("p99 ms", "{:,.2f}"),
    "errors_pct": Figure("errors %", "{:.1f}", ratio=False),
    "ttfb_ms": Figure("first byte ms", "{:,.1f}"),
    "rss_mib": Figure("server RSS peak MiB", "{:,.0f}"),
    "connected": Figure("subscribers connected", "{:,.0f}", ratio=False),
    "delivered_pct": Figure("delivered %", "{:.2f}", ratio=False),
    "client_cpu_pct": Figure("client CPU % of a core", "{:.0f}", ratio=False),
    "server_cpu_pct": Figure("server CPU % of a core", "{:.0f}", ratio=False),
    "put_per_1000": Figure("PUT per 1,000 messages", "{:,.1f}"),
    "get_per_1000": Figure("GET per 1,000 messages", "{:,.1f}"),
    "list_per_1000": Figure("LIST per 1,000 messages", "{:,.1f}"),
    "head_per_1000": Figure("HEAD per 1,000 messages", "{:,.1f}"),
    "msgs_per_put": Figure("messages per PUT", "{:,.1f}"),
    "idle_per_stream_min": Figure("requests per idle stream per minute", "{:,.2f}"),
    "long_poll_per_stream_min": Figure(
        "requests per stream per minute, one long-poll waiting", "{:,.2f}"
    ),
}


@dataclass(frozen=True)
class Settings:
    """How the harness runs, as opposed to what the loads do (loads.Options)."""

    server_core: int
    profile: bool
    profile_dir: Path
    picomq_tree: Path = servers.REPO_DIR  # whose code PicoMQ runs (bench/ab.py: two trees)
    picomq_env: dict[str, str] = field(default_factory=dict)  # PICOMQ_* and the like


@dataclass
class Run:
    """One server's measurement in one rep: its figures, or the error that stopped it."""

    load: str
    server: str
    rep: int
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    profile: list[str] = field(default_factory=list)
    error: str | None = None


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [load.name for load in LOADS]
    parser.add_argument(
        "--only",
        default="all",
        help=f"comma-separated loads or groups: {', '.join([*loads.GROUPS, *names])}",
    )
    add_harness_arguments(parser, reps=3, duration=10)
    parser.add_argument("--connections", type=int, default=64, help="wrk connections, load 1")
    parser.add_argument("--streams", type=int, default=1000, help="streams for load 1's spread")
    parser.add_argument("--batch-connections", type=int, default=8, help="wrk connections, load 2")
    parser.add_argument("--catchup-mb", type=int, default=50, help="stream size for load 3, MB")
    parser.add_argument("--events", type=int, default=500, help="live events timed, load 4")
    parser.add_argument("--idle-streams", type=int, default=10, help="streams for the S3 idle load")
    parser.add_argument(
        "--readme", action="store_true", help="write the figures into bench/README.md"
    )
    parser.add_argument("--keep", action="store_true", help="keep data directories and logs")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample PicoMQ's worker with py-spy and perf during each load"
        " (figures read a little low)",
    )
    arguments = parser.parse_args()
    check_harness_arguments(parser, arguments)
    selected = []
    for name in arguments.only.split(","):
        name = name.strip()
        if name == "all":
            selected += names
        elif name in loads.GROUPS:
            selected += loads.GROUPS[name]
        elif name in names:
            selected.append(name)
        else:
            parser.error(f"unknown load {name!r}")
    arguments.selected = [load for load in LOADS if load.name in selected]
    return arguments


def add_harness_arguments(parser: argparse.ArgumentParser, *, reps: int, duration: int) -> None:
    """The options compare.py and ab.py share: reps, each load's length, the two cores."""
    parser.add_argument("--reps", type=int, default=reps, help=f"reps of each (default {reps})")
    parser.add_argument(
        "--duration",
        type=int,
        default=duration,
        help=f"seconds of each timed load, 1–{MAX_DURATION_SECONDS} (default {duration})",
    )
    parser.add_argument("--server-core", type=int, default=0, help="core the servers run on")
    parser.add_argument("--client-core", type=int, default=1, help="core the clients run on")


def check_harness_arguments(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> None:
    if not 1 <= arguments.duration <= MAX_DURATION_SECONDS:
        parser.error(f"--duration must be 1–{MAX_DURATION_SECONDS} seconds")
    if arguments.reps < 1:
        parser.error("--reps must be at least 1")


def main() -> None:
    arguments = parse_arguments()
    options = Options(
        duration=arguments.duration,
        connections=arguments.connections,
        streams=arguments.streams,
        batch_connections=arguments.batch_connections,
        catchup_mb=arguments.catchup_mb,
        events=arguments.events,
        idle_streams=arguments.idle_streams,
        client_core=arguments.client_core,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    settings = Settings(arguments.server_core, arguments.profile, RESULTS_DIR / f"profiles-{stamp}")
    os.sched_setaffinity(0, {arguments.client_core})
    open_files = servers.raise_open_file_limit()
    machine, command = describe_run("bench/compare.py", open_files)
    print(flush=True)
    runs: list[Run] = []
    with work_area(arguments.keep) as work_root:
        for load in arguments.selected:
            print(load.title.format(**asdict(options)), flush=True)
            for rep in range(arguments.reps):
                order = ("picomq",) if load.s3 else NAMES if rep % 2 == 0 else NAMES[::-1]
                for name in order:
                    work_dir = work_root / f"{load.name}-{name}-{rep}"
                    work_dir.mkdir()
                    run = measure(load, name, rep, work_dir, options, settings)
                    runs.append(run)
                    print(f"  rep {rep + 1} {name:9} {summarize(load, run)}", flush=True)
    table = format_table(arguments.selected, runs, options)
    notes = format_notes(runs)
    print(f"\n{table}\n{notes}")
    for run in runs:
        if run.profile:
            print(f"\n{run.load}, rep {run.rep + 1}, PicoMQ's worker:\n" + "\n".join(run.profile))
    save(machine, command, stamp, runs)
    if arguments.readme:
        update_readme(machine, command, table, notes)


@contextmanager
def work_area(keep: bool) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="picomq-bench-"))
    try:
        yield root
    finally:
        if keep:
            print(f"data and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            # Written back, the deleted inodes hold up the next run's creates for 60 s
            # instead of up to 360 (ext4 without a journal; bench/README.md, ab.py).
            os.sync()


def measure(
    load: Load, name: str, rep: int, work_dir: Path, options: Options, settings: Settings
) -> Run:
    """Start a fresh server (and moto for S3), run the load, stop everything started.

    The data stays until the whole run ends (`work_area`), out of the page cache
    (`evict_from_page_cache`). Deleting a rep's thousands
    of segment files slowed the creates of the reps after it: on this machine's ext4,
    which has no journal, new inodes skip those deleted in the last minutes, and the
    deletion's metadata was still being written back (appends over 1,000 streams fell
    from 1,290/s to 874/s over three reps; with the data kept, 1,205–1,262/s).
    """
    run = Run(load.name, name, rep)
    started: list[servers.Server] = []
    try:
        target = start_target(load, name, work_dir, settings, started)
        profile = settings.profile_dir / f"{load.name}-rep{rep + 1}.txt"
        with (
            profiled(target.server, profile, run.profile)
            if settings.profile and name == "picomq"
            else nullcontext()
        ):
            result: Result = load.run(target, options)
        run.figures, run.notes, run.details = result.figures, result.notes, result.details
    except Exception as error:  # noqa: BLE001 - one failed run must not stop the others
        run.error = f"{type(error).__name__}: {error}"
        run.notes.append("".join(traceback.format_exception_only(error)).strip())
        for server in started:
            run.notes.append(server.output_tail())
    finally:
        for server in reversed(started):
            server.stop()
        evict_from_page_cache(work_dir)
    return run


def evict_from_page_cache(root: Path) -> None:
    """Write a finished rep's files back and drop them from the page cache.

    On this VM (DAMON pages out cold memory; virtio-balloon reports free pages to the
    host), a page-cache page the guest has not used lately costs a host fault the first
    time it is written. As kept reps filled the cache, each rep wrote into colder memory:
    the batch load fell from 91 to 72 MB/s over 4 reps, the kernel's copy into the page
    cache (`copy_folio_from_iter_atomic`) growing from 1.5 % to 19 % of the worker's
    time. Dropped from the cache, a rep's pages are free for the next rep, as if its
    files had been deleted, without the deleted-inode slowdown (see `measure`): 88–93
    MB/s over 4 reps. Every rep of both servers then starts from the same memory.
    """
    if not hasattr(os, "posix_fadvise"):
        return  # not Linux: nothing to equalise by this means
    os.sync()
    for directory, _, names in os.walk(root):
        for name in names:
            try:
                descriptor = os.open(os.path.join(directory, name), os.O_RDONLY)
            except OSError:
                continue  # a socket, or gone
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def start_target(
    load: Load, name: str, work_dir: Path, settings: Settings, started: list[servers.Server]
) -> Target:
    core = settings.server_core
    if not load.s3:
        if name == "picomq":
            server = servers.picomq(work_dir, core, settings.picomq_env, settings.picomq_tree)
        else:
            server = servers.reference(work_dir, core)
        started.append(server)
        return Target(server.start(), work_dir)
    moto = servers.moto(work_dir)
    started.append(moto)
    moto.start()
    requests.put(f"{moto.url}/{loads.S3_BUCKET}", timeout=10).raise_for_status()
    environment = {
        **loads.S3_ENVIRONMENT,
        **settings.picomq_env,
        "AWS_ENDPOINT_URL": moto.url,
        "PICOMQ_STORAGE_URL": f"s3://{loads.S3_BUCKET}/picomq",
    }
    server = servers.picomq(work_dir, core, environment, settings.picomq_tree)
    started.append(server)
    return Target(server.start(), work_dir, moto)


def summarize(load: Load, run: Run) -> str:
    if run.error:
        return f"FAILED: {run.error.splitlines()[0][:200]}"
    shown = [
        f"{FIGURES[key].label} {FIGURES[key].format.format(run.figures[key])}"
        for key in load.figures
        if key in run.figures
    ]
    return " · ".join(shown)


def spread(values: list[float], style: str) -> str:
    values = [value for value in values if not math.isnan(value)]
    if not values:
        return "—"
    middle = style.format(statistics.median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({style.format(min(values))}–{style.format(max(values))})"


def format_table(selected: list[Load], runs: list[Run], options: Options) -> str:
    header = (
        "| load | figure | PicoMQ median (min–max) | reference median (min–max) "
        "| PicoMQ ÷ reference, each rep | ÷ median |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|"]
    for load in selected:
        mine = [run for run in runs if run.load == load.name]
        by_server = {name: [run for run in mine if run.server == name] for name in NAMES}
        for row, key in enumerate(load.figures):
            figure = FIGURES[key]
            title = load.title.format(**asdict(options)) if row == 0 else ""
            cells = []
            for name in NAMES:
                values = [run.figures[key] for run in by_server[name] if key in run.figures]
                failed = sum(1 for run in by_server[name] if run.error)
                cell = spread(values, figure.format) if by_server[name] else "—"
                cells.append(cell + (f" ({failed} failed)" if failed else ""))
            ratios = rep_ratios(by_server, key) if figure.ratio else []
            each = " · ".join(format_ratio(ratio) for ratio in ratios) or "—"
            middle = format_ratio(statistics.median(ratios)) if ratios else "—"
            lines.append(
                f"| {title} | {figure.label} | {cells[0]} | {cells[1]} | {each} | {middle} |"
            )
    return "\n".join(lines)


def format_ratio(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def rep_ratios(by_server: dict[str, list[Run]], key: str) -> list[float]:
    ratios = []
    for mine in by_server["picomq"]:
        theirs = [run for run in by_server["reference"] if run.rep == mine.rep]
        if not theirs or key not in mine.figures or key not in theirs[0].figures:
            continue
        numerator, denominator = mine.figures[key], theirs[0].figures[key]
        if denominator and not math.isnan(numerator) and not math.isnan(denominator):
            ratios.append(numerator / denominator)
    return ratios


def format_notes(runs: list[Run]) -> str:
    lines = []
    for run in runs:
        for note in run.notes:
            first, *rest = note.splitlines()
            lines.append(f"- {run.load}, {run.server}, rep {run.rep + 1}: {first}")
            lines += [f"    {line}" for line in rest[-15:]]
    return "Notes:\n" + "\n".join(lines) if lines else ""


def describe_run(script: str, open_files: int) -> tuple[dict[str, str], str]:
    """This run's machine and command line, printed first: saved figures name both."""
    machine = describe_machine(open_files)
    command = shlex.join([".venv/bin/python", script, *sys.argv[1:]])
    print(f"{headline(machine)}\n{command}", flush=True)
    return machine, command


def headline(machine: dict[str, str]) -> str:
    return f"{machine['date']} · {machine['machine']} · PicoMQ {machine['commit']}"


def describe_machine(open_files: int) -> dict[str, str]:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    commit = git("describe", "--always", "--dirty")
    if commit.endswith("-dirty"):  # name the working tree measured, not just its base
        digest = hashlib.sha1(git("diff", "HEAD").encode()).hexdigest()[:10]
        commit += f" (diff {digest})"
    load_average = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} × {cpu}, Linux {platform.release()}, "
        f"Python {platform.python_version()}, Node {node}, load average {load_average} at start",
        "commit": commit,
        "open_files": str(open_files),
    }


def git(*arguments: str, check: bool = False) -> str:
    """git's output in this repository; `check`: raise CalledProcessError if it fails."""
    command = ["git", "-C", str(servers.REPO_DIR), *arguments]
    return subprocess.run(command, capture_output=True, text=True, check=check).stdout.strip()


def save(
    machine: dict[str, str], command: str, stamp: str, runs: list[Run], kind: str = "compare"
) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{kind}-{stamp}.json"
    record = {**machine, "command": command, "runs": [asdict(run) for run in runs]}
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"raw figures: {path.relative_to(servers.REPO_DIR)}")


def update_readme(machine: dict[str, str], command: str, table: str, notes: str) -> None:
    text = README.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{README} has no {README_START} … {README_END} section")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    section = f"\n{headline(machine)}\n\n```sh\n{command}\n```\n\n{table}\n\n{notes}\n"
    README.write_text(head + README_START + section + README_END + tail)
    print(f"figures written to {README.relative_to(servers.REPO_DIR)}")


if __name__ == "__main__":
    main()
