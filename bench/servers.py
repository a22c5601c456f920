"""The servers a benchmark runs: PicoMQ, the reference server and moto, on 127.0.0.1 only.

Each starts in its own session (so a stop reaches its whole process group), pinned to
the server core with `taskset`, with its output in a log file, and is polled for
readiness with a deadline. A server that exits or never answers raises `ProcessFailed`
with its output. Stopping is SIGTERM, a deadline, then SIGKILL to the group — only
ever the processes started here, by PID.

Also here: resident memory and CPU time of a server's process tree, read from /proc.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import sys
from collections import Counter
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
BIN_DIR = Path(sys.executable).parent
sys.path.insert(0, str(REPO_DIR / "tests"))  # the process handling the tests use too
from processes import HOST, ManagedProcess, ProcessFailed, free_port  # noqa: E402

READINESS_PATH = "/v1/stream/__readiness-probe"
# Past this deadline after the stop signal, the process group is killed.
STOP_DEADLINE_SECONDS = 15.0
LONG_POLL_TIMEOUT_SECONDS = 20  # PicoMQ's default; the reference is given the same
# 10,000 SSE subscribers need 10,000 descriptors in the client and in the server, plus
# a few; children inherit the limit raised here.
WANTED_OPEN_FILES = 65536
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def raise_open_file_limit() -> int:
    """Raise RLIMIT_NOFILE as far as allowed (children inherit it); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        wanted = max(hard, WANTED_OPEN_FILES)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Server(ManagedProcess):
    """A benchmarked server: a managed process, plus its tree's memory and CPU time."""

    def start(self) -> Server:  # type: ignore[override]
        super().start()
        return self

    def processes(self) -> list[int]:
        """The server's PID and all its descendants' (a gunicorn master and its worker)."""
        found, pending = [], [self.pid]
        while pending:
            pid = pending.pop()
            found.append(pid)
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            pending.extend(int(child) for child in children)
        return found

    def resident_mib(self) -> float:
        """Resident memory of the whole process tree, in MiB."""
        return sum(read_resident_kib(pid) for pid in self.processes()) / 1024

    def cpu_seconds(self) -> float:
        """User + system CPU time used so far by the whole process tree."""
        return sum(self.cpu_times())

    def cpu_times(self) -> tuple[float, float]:
        """User and system CPU time used so far by the whole process tree."""
        times = [read_cpu_times(pid) for pid in self.processes()]
        return sum(user for user, _ in times), sum(system for _, system in times)


def read_resident_kib(pid: int) -> int:
    return read_status_kib(pid, "VmRSS")


def read_status_kib(pid: int, name: str) -> int:
    """A memory figure of /proc/<pid>/status in KiB (VmRSS, VmHWM, …); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def read_cpu_times(pid: int) -> tuple[float, float]:
    """Its user and system CPU time (utime, stime); none once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def pinned(core: int | None, command: list[str]) -> list[str]:
    return command if core is None else ["taskset", "-c", str(core), *command]


def picomq(
    work_dir: Path,
    core: int | None,
    extra_env: dict[str, str] | None = None,
    tree: Path = REPO_DIR,
) -> Server:
    """PicoMQ as deployed: gunicorn.conf.py, one gevent worker, data in work_dir/data;
    the code of `tree` (a checkout of this repository; bench/ab.py passes another)."""
    return served_as_picomq("picomq", "wsgi:app", work_dir, core, extra_env, tree)


def served_as_picomq(
    name: str,
    app: str,
    work_dir: Path,
    core: int | None,
    extra_env: dict[str, str] | None = None,
    tree: Path = REPO_DIR,
) -> Server:
    """The WSGI `app` ("module:variable") of `tree` served exactly as PicoMQ is.

    gunicorn.conf.py (its worker class and settings), one worker, PICOMQ_* settings
    from `extra_env` only, pinned to `core`, data in work_dir/data. bench/ceiling.py
    serves a trivial Flask app this way, to measure the stack without PicoMQ.
    """
    port = free_port()
    data_dir = work_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PICOMQ_")}
    env.update(PICOMQ_WORKERS="1", PICOMQ_STORAGE_URL=str(data_dir), PYTHONUNBUFFERED="1")
    env.update(extra_env or {})
    command = [
        str(BIN_DIR / "gunicorn"),
        "-c",
        "gunicorn.conf.py",
        "--bind",
        f"{HOST}:{port}",
        app,
    ]
    # SIGQUIT is gunicorn's quick shutdown: the bench has abandoned its clients, and the
    # data is thrown away. bench/restart.py measures the graceful one (SIGTERM).
    return Server(
        name=name,
        command=pinned(core, command),
        cwd=tree,
        env=env,
        log_path=work_dir / "server.log",
        port=port,
        readiness_path=READINESS_PATH,
        stop_signal=signal.SIGQUIT,
        stop_deadline_seconds=STOP_DEADLINE_SECONDS,
    )


def reference(work_dir: Path, core: int | None) -> Server:
    """The reference server (bench/reference_server.mjs) with its file store in work_dir/data."""
    if not (BENCH_DIR / "node_modules" / "@durable-streams" / "server").exists():
        raise ProcessFailed("reference server not installed: run `npm ci` in bench/")
    port = free_port()
    data_dir = work_dir / "data"
    command = [
        "node",
        "reference_server.mjs",
        str(port),
        str(data_dir),
        str(LONG_POLL_TIMEOUT_SECONDS * 1000),
    ]
    env = dict(os.environ)
    return Server(
        name="reference",
        command=pinned(core, command),
        cwd=BENCH_DIR,
        env=env,
        log_path=work_dir / "server.log",
        port=port,
        readiness_path=READINESS_PATH,
        stop_deadline_seconds=STOP_DEADLINE_SECONDS,
    )


def moto(work_dir: Path) -> Server:
    """moto_server for S3; it logs one line per request, which `count_s3_requests` reads."""
    port = free_port()
    command = [str(BIN_DIR / "moto_server"), "-H", HOST, "-p", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Free to run on any core (the harness's own affinity would tie it to the client's):
    # the S3 rows count requests, and moto is the slowest part of that load.
    every_core = f"0-{os.cpu_count() - 1}"
    return Server(
        name="moto",
        command=["taskset", "-c", every_core, *command],
        cwd=work_dir,
        env=env,
        log_path=work_dir / "moto.log",
        port=port,
        stop_deadline_seconds=STOP_DEADLINE_SECONDS,
    )


# werkzeug's access log line; answers other than 200 have the request in ANSI styles,
# one code (404: yellow) or two (any other 2xx, 4xx or 5xx: bold and a colour).
S3_REQUEST_LINE = re.compile(
    rb'"(?:\x1b\[[\d;]*m)*(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP/1\.[01](?:\x1b\[[\d;]*m)*" (\d{3})'
)


def count_s3_requests(log_path: Path, start: int) -> tuple[Counter[str], int]:
    """Requests moto logged after byte `start` of its log, by kind; and the log's new end.

    Kinds: PUT, GET (an object), LIST (a GET on the bucket), HEAD, DELETE, POST.
    """
    with log_path.open("rb") as log:
        log.seek(start)
        text = log.read()
    text = text[: text.rfind(b"\n") + 1]  # a line still being written waits for next time
    counts: Counter[str] = Counter()
    for match in S3_REQUEST_LINE.finditer(text):
        method, path = match[1].decode(), match[2].split(b"?", 1)[0]
        is_bucket = path.strip(b"/").count(b"/") == 0
        counts["LIST" if method == "GET" and is_bucket else method] += 1
    return counts, start + len(text)
