"""What a restart costs: the time PicoMQ answers no one, with an SSE reader connected.

Starts PicoMQ as compare.py does (gunicorn.conf.py, one gevent worker, data under
bench/results/), connects an SSE reader at the tail of a stream, and probes the port
every PROBE_SECONDS with a new connection (GET /healthz). Then restarts it as
`systemctl restart` does: SIGTERM, wait for the exit, start again on the same port. It
prints, from the SIGTERM: when the SSE response ended (and whether with a whole last
control event, which a client resumes from), when the process exited, when a probe
was first refused or unanswered, and when the new server first answered one: the
outage. With `--reload`, sends SIGHUP instead (`systemctl reload`): gunicorn starts new
workers and stops the old ones, and this prints how many probes failed (none should)
and the longest wait for an answer. Repeats `--reps` times. Asserts nothing.

    .venv/bin/python bench/restart.py --reps 5
    .venv/bin/python bench/restart.py --reps 3 --reload
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import servers
from servers import HOST, Server

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROBE_SECONDS = 0.01
PROBE_TIMEOUT_SECONDS = 1.0
WAIT_SECONDS = 90.0  # past gunicorn's graceful_timeout (75 s): the old figure fits
RELOAD_SECONDS = 3.0  # after a SIGHUP: the new workers are up and answering


@dataclass
class Probes:
    """Each probe's start and, if it was answered 200, its answer's (time.monotonic()).

    A probe sent while the new server boots is taken into its listening socket's queue
    and answered once the worker is up: the outage ends with that answer."""

    port: int
    results: list[tuple[float, float | None]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.done.is_set():
            started = time.monotonic()
            answered = time.monotonic() if answers(self.port) else None
            self.results.append((started, answered))
            time.sleep(max(0.0, started + PROBE_SECONDS - time.monotonic()))

    def outage(self, since: float) -> tuple[float, float]:
        """From `since`: the first probe refused or unanswered, and the first answer to a
        probe sent after it."""
        after = [(started, answered) for started, answered in self.results if started >= since]
        failed = next(started for started, answered in after if answered is None)
        back = next(answered for started, answered in after if answered and started > failed)
        return failed - since, back - since


def answers(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=PROBE_TIMEOUT_SECONDS) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return sock.recv(12) == b"HTTP/1.1 200"
    except OSError:
        return False


@dataclass
class SseReader:
    """An SSE response read to its end: when it ended, and whether it ended whole."""

    port: int
    path: str
    ended_at: float = 0.0
    whole: bool = False
    last_event: str = ""

    def run(self) -> None:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=WAIT_SECONDS)
        try:
            connection.request("GET", f"{self.path}?offset=now&live=sse")
            response = connection.getresponse()
            body = response.read()  # IncompleteRead if the response is cut short
            self.whole = body.endswith(b"\n\n")
            self.last_event = body.decode().strip("\n").rsplit("\n\n", 1)[-1]
        except (OSError, http.client.HTTPException):
            self.whole = False
        finally:
            self.ended_at = time.monotonic()
            connection.close()


@dataclass
class Watch:
    """An SSE reader at the tail of a new stream, and the probes, both running."""

    reader: SseReader
    probes: Probes
    threads: list[threading.Thread]

    @classmethod
    def start(cls, server: Server) -> Watch:
        path = f"/v1/stream/restart-{time.monotonic_ns()}"
        url = f"http://{HOST}:{server.port}{path}"
        requests.put(url, headers={"Content-Type": "text/plain"}, timeout=10).raise_for_status()
        watch = cls(SseReader(server.port, path), Probes(server.port), [])
        for run in (watch.reader.run, watch.probes.run):
            watch.threads.append(threading.Thread(target=run, daemon=True))
            watch.threads[-1].start()
        time.sleep(1.0)  # the reader is parked at the tail, the probes answered
        return watch

    def stop(self) -> None:
        self.probes.done.set()
        for thread in self.threads:
            thread.join(WAIT_SECONDS)

    def sse_whole(self) -> bool:
        return self.reader.whole and self.reader.last_event.startswith("event: control")


@dataclass(frozen=True)
class Restart:
    sse_ended: float
    sse_whole: bool
    exited: float
    refused: float
    outage: float


def restart_once(server: Server) -> Restart:
    """SIGTERM, the exit, a start on the same port: as `systemctl restart`."""
    watch = Watch.start(server)
    signalled = time.monotonic()
    os.kill(server.pid, signal.SIGTERM)
    assert server.process is not None
    server.process.wait(timeout=WAIT_SECONDS)
    exited = time.monotonic() - signalled
    server.stop()  # forgets the exited process
    server.start()
    time.sleep(0.2)  # a few probes answered by the new server
    watch.stop()
    refused, outage = watch.probes.outage(signalled)
    sse_ended = watch.reader.ended_at - signalled
    return Restart(sse_ended, watch.sse_whole(), exited, refused, outage)


@dataclass(frozen=True)
class Reload:
    sse_ended: float
    sse_whole: bool
    probes: int
    failed: int
    longest_wait: float


def reload_once(server: Server) -> Reload:
    """SIGHUP, as `systemctl reload`: new workers, the old ones stopped; the master keeps
    the listening socket, so probes wait for an answer at most, and none is refused."""
    watch = Watch.start(server)
    signalled = time.monotonic()
    os.kill(server.pid, signal.SIGHUP)
    time.sleep(RELOAD_SECONDS)
    watch.stop()
    after = [
        (started, answered) for started, answered in watch.probes.results if started >= signalled
    ]
    failed = sum(answered is None for _, answered in after)
    longest = max(answered - started for started, answered in after if answered is not None)
    sse_ended = watch.reader.ended_at - signalled
    return Reload(sse_ended, watch.sse_whole(), len(after), failed, longest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="restarts, at most 20")
    parser.add_argument("--reload", action="store_true", help="SIGHUP instead of a restart")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    options = parser.parse_args()
    os.sched_setaffinity(0, {options.client_core})
    RESULTS_DIR.mkdir(exist_ok=True)
    restarts = []
    with tempfile.TemporaryDirectory(dir=RESULTS_DIR, prefix="restart-") as work_dir:
        server = servers.picomq(Path(work_dir), options.server_core)
        server.stop_signal = signal.SIGTERM  # as systemd stops it
        server.start()
        try:
            for rep in range(min(options.reps, 20)):
                if options.reload:
                    print_reload(f"reload {rep + 1}", reload_once(server))
                else:
                    restarts.append(restart_once(server))
                    print_restart(f"restart {rep + 1}", restarts[-1])
        finally:
            server.stop()
    if restarts:
        outages = [restart.outage for restart in restarts]
        print(
            f"outage over {len(outages)} restarts: median {statistics.median(outages):.2f} s,"
            f" {min(outages):.2f}–{max(outages):.2f} s"
        )


def describe_sse(ended: float, whole: bool) -> str:
    ending = "with a whole last control event" if whole else "CUT SHORT"
    return f"the SSE response ended at {ended:.2f} s ({ending})"


def print_restart(name: str, restart: Restart) -> None:
    print(
        f"{name}: after SIGTERM, {describe_sse(restart.sse_ended, restart.sse_whole)},"
        f" the process exited at {restart.exited:.2f} s, connections failed from"
        f" {restart.refused:.2f} s; the new server answered at {restart.outage:.2f} s"
    )


def print_reload(name: str, reload: Reload) -> None:
    print(
        f"{name}: after SIGHUP, {describe_sse(reload.sse_ended, reload.sse_whole)};"
        f" {reload.failed} of {reload.probes} connections failed, the longest waited"
        f" {reload.longest_wait:.2f} s for its answer"
    )


if __name__ == "__main__":
    main()
