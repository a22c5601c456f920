"""The agent-run example's backend: it runs a long task and reports progress to PicoMQ.

    PICOMQ_URL=http://127.0.0.1:4437 python examples/agent_run/app.py --port 8000

`POST /runs` starts a run and answers at once with its id and stream; the task then
appends one event per step to the JSON stream `agents/<run id>` and closes it when done.
The page (index.html) follows that stream, and after a reload reads it again from the
start to rebuild its view: it never asks this backend to run anything twice.

Every event carries an `id` (`<run>:<seq>`) so consumers can apply each event once even
if they see it twice, and every append is sent as an idempotent producer (Producer-Id is
the run, Producer-Seq the event's number), so retrying an append whose answer was lost
can never store the event twice.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import requests
from flask import Flask, jsonify, send_from_directory

HERE = Path(__file__).resolve().parent
PICOMQ_URL = os.environ.get("PICOMQ_URL", "http://127.0.0.1:4437").rstrip("/")
STEPS = int(os.environ.get("AGENT_STEPS", "8"))
STEP_SECONDS = float(os.environ.get("AGENT_STEP_SECONDS", "1.5"))
RETRY_DELAYS_SECONDS = (0.2, 0.5, 1, 2, 4)
JSON = "application/json"

app = Flask(__name__)
started_runs: list[str] = []


def stream_url(run_id: str) -> str:
    return f"{PICOMQ_URL}/v1/stream/agents/{run_id}"


class ProgressReporter:
    """Appends a run's events in order; each may be retried, none is stored twice."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.seq = 0
        self.session = requests.Session()

    def report(self, kind: str, step: int, message: str, *, last: bool = False) -> None:
        event = {
            "id": f"{self.run_id}:{self.seq}",
            "type": kind,
            "step": step,
            "total": STEPS,
            "message": message,
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        headers = {
            "Content-Type": JSON,
            "Producer-Id": self.run_id,
            "Producer-Epoch": "0",
            "Producer-Seq": str(self.seq),
        }
        if last:
            headers["Stream-Closed"] = "true"  # the final event and the end, in one append
        self.send([event], headers)
        self.seq += 1

    def send(self, body: list[dict], headers: dict[str, str]) -> None:
        for delay in (*RETRY_DELAYS_SECONDS, None):
            try:
                response = self.session.post(
                    stream_url(self.run_id), json=body, headers=headers, timeout=10
                )
                if response.status_code < 500:
                    response.raise_for_status()  # 4xx: a bug here, not a hiccup; stop
                    return
            except requests.ConnectionError:
                pass
            if delay is None:
                raise RuntimeError(f"could not report progress of run {self.run_id}")
            time.sleep(delay)  # the same seq again: the server drops it if it was stored


def perform(run_id: str) -> None:
    """The long task: here, a few slow steps standing in for an agent's work."""
    reporter = ProgressReporter(run_id)
    reporter.report("started", 0, f"run {run_id} started")
    for step in range(1, STEPS + 1):
        time.sleep(STEP_SECONDS)
        reporter.report("progress", step, f"step {step} of {STEPS} done")
    reporter.report("finished", STEPS, "all steps done", last=True)


@app.post("/runs")
def start_run() -> tuple[object, int]:
    run_id = uuid.uuid4().hex[:12]
    response = requests.put(stream_url(run_id), headers={"Content-Type": JSON}, timeout=10)
    response.raise_for_status()
    started_runs.append(run_id)
    threading.Thread(target=perform, args=(run_id,), daemon=True).start()
    return jsonify(run=run_id, stream=stream_url(run_id)), 202


@app.get("/runs")
def count_runs() -> object:
    """How many runs this process has started (the test checks a reload starts none)."""
    return jsonify(started=len(started_runs))


@app.get("/config.json")
def config() -> object:
    return jsonify(picomqUrl=PICOMQ_URL)


@app.get("/")
@app.get("/<any('run.js'):name>")
def page(name: str = "index.html") -> object:
    return send_from_directory(HERE, name, max_age=0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    arguments = parser.parse_args()
    app.run(host=arguments.host, port=arguments.port, threaded=True)
