"""Sample PicoMQ's worker with py-spy while a load runs, and summarize where time went.

py-spy is a profiling tool, not a dependency: `.venv/bin/pip install py-spy`. It pauses
the worker for each sample (100 a second), so figures from a profiled run are a little
low; profile to find hot spots, measure without `--profile`.

The collapsed stacks (py-spy's raw format, one "frame;frame;… count" line per stack) are
kept for flame graphs (speedscope.app or flamegraph.pl read them); the summary lists the
functions with the most samples on top of the stack (self) and, among PicoMQ's own
modules, the most samples anywhere in the stack (inclusive). Only the thread holding
the GIL is sampled (`--gil`): the threadpool's threads blocked in fsync or in S3 calls
would otherwise count as busy, and the samples are meant to be the worker's CPU time.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from servers import BIN_DIR, REPO_DIR, Server

FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
OWN_MODULES = {path.name for path in REPO_DIR.glob("*.py")}
STOP_DEADLINE_SECONDS = 30.0
TOP = 12


@contextmanager
def profiled(server: Server, output: Path, summary: list[str]) -> Iterator[None]:
    """Record the server's worker processes into `output` and append a summary to `summary`."""
    py_spy = BIN_DIR / "py-spy"
    if not py_spy.exists():
        raise RuntimeError(f"{py_spy} not found: `.venv/bin/pip install py-spy` to profile")
    worker = server.processes()[-1]  # gunicorn's master, then its one worker
    output.parent.mkdir(parents=True, exist_ok=True)
    recorder = subprocess.Popen(
        [str(py_spy), "record", "--gil", "--pid", str(worker), "--format", "raw"]
        + ["--output", str(output)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
        try:
            _, errors = recorder.communicate(timeout=STOP_DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            recorder.kill()
            _, errors = recorder.communicate()
        if output.exists():
            summary.extend(summarize(output))
        else:
            summary.append(f"py-spy wrote nothing: {errors.decode(errors='replace')[-500:]}")


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
