"""Sample PicoMQ's worker with py-spy and perf while a load runs, and summarize where
time went.

py-spy is a profiling tool, not a dependency: `.venv/bin/pip install py-spy`. It pauses
the worker for each sample (100 a second), so figures from a profiled run are a little
low; profile to find hot spots, measure without `--profile`.

The collapsed stacks (py-spy's raw format, one "frame;frame;… count" line per stack) are
kept for flame graphs (speedscope.app or flamegraph.pl read them); the summary lists the
functions with the most samples on top of the stack (self) and, among PicoMQ's own
modules, the most samples anywhere in the stack (inclusive). Only the thread holding
the GIL is sampled (`--gil`): the threadpool's threads blocked in fsync or in S3 calls
would otherwise count as busy, and the samples are meant to be the worker's CPU time.

py-spy stops the worker to read its stacks, and on a VM those stops land at the return
of a system call more often than elsewhere: it put 14.5 % of one stream's append
samples on `getpid`, which costs 0.07 % of the core. So `perf` (Debian: `apt-get install
linux-perf`; not a dependency either) records the worker alongside, with call chains,
and the summary splits its time by where it ran (the interpreter, the kernel, libc,
each C extension) and names the system calls the kernel's share went to.
py-spy's stops run in the kernel too, so the kernel's share reads higher than in a run
without py-spy (one stream's appends: 25–30 % against 22 %). Without perf, or without the
right to record the worker, only py-spy's summary is printed.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from servers import BIN_DIR, REPO_DIR, Server

FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
OWN_MODULES = {path.name for path in REPO_DIR.glob("*.py")}
STOP_DEADLINE_SECONDS = 30.0
TOP = 12
PERF_HERTZ = "999"
# `perf report` lines: "  65.53%  libpython3.11.so.1.0", "  11.39%  0.02%  [k] __x64_sys_sendto"
PERF_SHARE = re.compile(r"^\s*(?P<share>[0-9.]+)%\s+(?:[0-9.]+%\s+)?(?P<name>\S.*?)\s*$")
# A call's entry points. Some kernels inline __x64_sys_write and __x64_sys_read into
# ksys_write and ksys_read, so those are the only frames a write or read leaves.
SYSTEM_CALL = re.compile(r"\[k\] (?:__x64_sys|__do_sys|ksys)_(?P<call>\w+)$")


@contextmanager
def profiled(server: Server, output: Path, summary: list[str]) -> Iterator[None]:
    """Record the server's worker into `output` (py-spy) and into `output` with `.perf`
    added (perf); append a summary of each to `summary`."""
    with sampled_stacks(server, output, summary), time_split(server, output, summary):
        yield


@contextmanager
def sampled_stacks(server: Server, output: Path, summary: list[str]) -> Iterator[None]:
    py_spy = BIN_DIR / "py-spy"
    if not py_spy.exists():
        raise RuntimeError(f"{py_spy} not found: `.venv/bin/pip install py-spy` to profile")
    worker = server.processes()[-1]  # gunicorn's master, then its one worker
    output.parent.mkdir(parents=True, exist_ok=True)
    command = [str(py_spy), "record", "--gil", "--pid", str(worker), "--format", "raw"]
    with recorded([*command, "--output", str(output)], output, summary, lambda: summarize(output)):
        yield


@contextmanager
def time_split(server: Server, output: Path, summary: list[str]) -> Iterator[None]:
    """Record the worker with perf while the load runs; summarize where its time went."""
    perf = shutil.which("perf")
    if perf is None:
        summary.append("perf not found (Debian: apt-get install linux-perf): no time split")
        yield
        return
    recording = output.with_name(output.name + ".perf")
    worker = str(server.processes()[-1])
    command = [perf, "record", "-g", "-F", PERF_HERTZ, "-p", worker, "-o", str(recording)]
    with recorded(command, recording, summary, lambda: split_by_place(perf, recording)):
        yield


@contextmanager
def recorded(
    command: list[str], output: Path, summary: list[str], report: Callable[[], list[str]]
) -> Iterator[None]:
    """Run a recorder while the block runs, then stop it and add its summary to `summary`.

    py-spy and perf both write `output` when interrupted (SIGINT)."""
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)
        try:
            _, errors = recorder.communicate(timeout=STOP_DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            recorder.kill()
            _, errors = recorder.communicate()
        if output.exists():
            summary.extend(report())
        else:
            name = Path(command[0]).name
            summary.append(f"{name} wrote nothing: {errors.decode(errors='replace')[-500:]}")


def split_by_place(perf: str, recording: Path) -> list[str]:
    """The worker's time by shared object, and its system calls' shares of it."""
    report = [perf, "report", "-i", str(recording), "--stdio"]
    places = perf_shares([*report, "--no-children", "--sort", "dso", "-g", "none"])
    calls: dict[str, float] = {}  # the first (largest) share of each call's entry points
    for share, name in perf_shares([*report, "--children", "--sort", "sym", "-g", "none"]):
        if match := SYSTEM_CALL.search(name):
            calls.setdefault(match["call"], share)
    if not places:
        return [f"perf recorded no samples of the worker in {recording}"]
    return [
        f"time split (perf, {PERF_HERTZ} a second, call chains) in {recording}:",
        "  the worker's time by where it ran:",
        *(f"    {share:5.1f}%  {name}" for share, name in places[:TOP]),
        "  system calls, with what the kernel did for them:",
        *(f"    {share:5.1f}%  {name}" for name, share in list(calls.items())[:TOP]),
    ]


def perf_shares(command: list[str]) -> list[tuple[float, str]]:
    """(percent, name) of each line of a `perf report --stdio` table, as printed."""
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=STOP_DEADLINE_SECONDS, check=False
    )
    shares = []
    for line in completed.stdout.splitlines():
        match = None if line.startswith("#") else PERF_SHARE.match(line)
        if match is not None:
            shares.append((float(match["share"]), match["name"]))
    return shares


def summarize(collapsed: Path) -> list[str]:
    leaf: Counter[str] = Counter()
    leaf_module: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = [parse_frame(frame) for frame in stack.split(";")]
        function, file = frames[-1]
        leaf[f"{function} ({file})"] += count
        leaf_module[file.split("/")[0] if "/" in file else file] += count
        for function, file in set(frames):
            if file in OWN_MODULES:
                own[f"{function} ({file})"] += count
    if not total:
        return ["py-spy recorded no samples"]

    def top(counter: Counter[str]) -> list[str]:
        return [f"    {100 * n / total:5.1f}%  {name}" for name, n in counter.most_common(TOP)]

    return [
        f"profile: {total} samples (100 a second while on CPU) in {collapsed}",
        "  self, by package or module:",
        *top(leaf_module),
        "  self, by function:",
        *top(leaf),
        "  inclusive, PicoMQ's own modules:",
        *top(own),
    ]


def parse_frame(frame: str) -> tuple[str, str]:
    """'function (gevent/hub.py:647)' -> ('function', 'gevent/hub.py')."""
    match = FRAME.match(frame)
    return (frame, "?") if match is None else (match["function"], match["file"])
