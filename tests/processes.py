"""Starting and stopping the servers that tests and benchmarks run, on 127.0.0.1 only.

Shared by tests/conftest.py and bench/servers.py. A process starts in a new session,
so a stop or a kill reaches its whole group (a gunicorn master and its workers); its
output goes to a log file; readiness is polled with a deadline. Only processes
started here are ever signalled, by their PID.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
READY_DEADLINE_SECONDS = 30.0
OUTPUT_TAIL_CHARS = 8000


class ProcessFailed(RuntimeError):
    """A server exited early or never answered HTTP; the message carries its output."""


def free_port() -> int:
    """Ask the kernel for a free loopback port (free now; a race with others is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def answers_http(port: int, path: str) -> bool:
    """True if anything on 127.0.0.1:port answers an HTTP GET, whatever the status."""
    connection = http.client.HTTPConnection(HOST, port, timeout=2)
    try:
        connection.request("GET", path)
        connection.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        connection.close()


@dataclass
class ManagedProcess:
    """One server process: `start()` waits until it answers, `stop()` ends its group."""

    name: str
    command: list[str]
    cwd: Path
    env: dict[str, str]
    log_path: Path
    port: int
    readiness_path: str = "/"
    stop_signal: signal.Signals = signal.SIGTERM
    # A graceful stop ends live reads at once (worker.py), so it is quick; past this
    # deadline the process group is killed.
    stop_deadline_seconds: float = 30.0
    ready_deadline_seconds: float = READY_DEADLINE_SECONDS  # longer under valgrind
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} is not running"
        return self.process.pid

    def start(self) -> None:
        """Start the process and wait until it answers HTTP; `ProcessFailed` if it does not."""
        assert self.process is None, f"{self.name} is already running"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.ready_deadline_seconds
        while not answers_http(self.port, self.readiness_path):
            if self.process.poll() is not None:
                self.process = None
                raise ProcessFailed(
                    f"{self.name} exited before answering HTTP\n{self.output_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill9()
                raise ProcessFailed(
                    f"{self.name} did not answer HTTP within {self.ready_deadline_seconds} s\n"
                    f"{self.output_tail()}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """`stop_signal`, wait for a graceful exit, then SIGKILL the process group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(self.stop_signal)
            try:
                self.process.wait(timeout=self.stop_deadline_seconds)
            except subprocess.TimeoutExpired:
                self.kill9()
                return
        self.process = None

    def kill9(self) -> None:
        """SIGKILL the whole process group at once, as a crash of the machine would."""
        if self.process is None:
            return
        # Signal the group only while its leader is unreaped: its PID, and so the group
        # ID, cannot have been reused by anyone else yet.
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def output(self) -> str:
        """Everything the process has written to stdout and stderr, all runs included."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def output_tail(self) -> str:
        text = self.output()
        if len(text) > OUTPUT_TAIL_CHARS:
            text = "...\n" + text[-OUTPUT_TAIL_CHARS:]
        return f"--- {self.name} output ({self.log_path}) ---\n{text}"
