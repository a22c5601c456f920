"""What a subscription costs in storage requests: per wake, and while idle.

Starts PicoMQ (gunicorn.conf.py, `--workers` of them) on local disk or on moto's S3, a
webhook receiver on 127.0.0.1 that answers every wake `{"done": true}`, and one webhook
subscription whose pattern links the streams the wakes use. From the storage request
counters of /metrics (every worker's, summed) it prints, by operation:

- per append to a stream no subscription links: the baseline;
- per wake: an append to a linked stream, its delivery and the done reply that ends it
  and acknowledges the tail, one at a time, minus the baseline;
- idle: every request in `--idle` seconds once the last wake has settled (the directory's
  read after the last commit, and the members' leases, have run out).

Asserts nothing. Each run takes about a minute plus `--idle`:

    .venv/bin/python bench/subscription_costs.py --storage disk
    .venv/bin/python bench/subscription_costs.py --storage s3
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
import servers

sys.path.insert(0, str(servers.REPO_DIR))
from directory import REFRESH_SECONDS  # noqa: E402

REQUEST_LINE = re.compile(r'storage_requests_total\{operation="(\w+)"\} (\S+)')
LEASE_SECONDS = 10.0  # PICOMQ_LEASE_SECONDS's default
SETTLE_SECONDS = REFRESH_SECONDS + 2 * LEASE_SECONDS
WAKE_SECONDS = 10.0


def storage_requests(url: str) -> Counter[str]:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return Counter({op: round(float(count)) for op, count in REQUEST_LINE.findall(text)})


def start_receiver() -> tuple[ThreadingHTTPServer, queue.Queue[dict]]:
    """A webhook receiver that ends every wake with `{"done": true}`."""
    deliveries: queue.Queue[dict] = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the http.server API)
            deliveries.put(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            data = b'{"done": true}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    receiver = ThreadingHTTPServer((servers.HOST, 0), Handler)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    return receiver, deliveries


def append(base: str, path: str, number: int) -> None:
    url = f"{base}/v1/stream/{path}"
    answer = requests.post(url, json={"n": number}, timeout=10)
    if answer.status_code == 404:
        body = json.dumps([{"n": number}])
        answer = requests.put(url, data=body, headers={"Content-Type": "application/json"})
    answer.raise_for_status()


def acked(base: str, subscription_id: str) -> dict[str, str]:
    url = f"{base}/v1/stream/__ds/subscriptions/{subscription_id}"
    streams = requests.get(url, timeout=10).json()["streams"]
    return {stream["path"]: stream["acked_offset"] for stream in streams}


def measure(base: str, appends: int, subscription_id: str, prefix: str, deliveries) -> dict:
    """Requests per baseline append, per wake, and in the idle window."""
    before = storage_requests(base)
    for number in range(appends):
        append(base, f"unlinked-{prefix}/{number % 4}", number)
    baseline = storage_requests(base) - before

    before = storage_requests(base)
    for number in range(appends):
        path = f"{prefix}/{number % 4}"
        append(base, path, number)
        streams = deliveries.get(timeout=WAKE_SECONDS)["streams"]
        tail = next(stream["tail_offset"] for stream in streams if stream["path"] == path)
        deadline = time.monotonic() + WAKE_SECONDS
        while acked(base, subscription_id).get(path) != tail and time.monotonic() < deadline:
            time.sleep(0.01)  # the done reply is recorded just after the delivery
    woken = storage_requests(base) - before
    return {"baseline": baseline, "woken": woken}


def run(storage: str, workers: int, appends: int, idle: float) -> None:
    work_dir = Path(tempfile.mkdtemp(prefix="subscription-costs-"))
    env = {"PICOMQ_WORKERS": str(workers), "PICOMQ_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32"}
    started = []
    if storage == "s3":
        moto = servers.moto(work_dir).start()
        started.append(moto)
        bucket = f"costs-{uuid.uuid4().hex[:8]}"
        requests.put(f"{moto.url}/{bucket}", timeout=10).raise_for_status()
        env.update(PICOMQ_STORAGE_URL=f"s3://{bucket}/picomq", AWS_ENDPOINT_URL=moto.url,
                   AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_REGION="us-east-1")  # fmt: skip
    receiver, deliveries = start_receiver()
    try:
        picomq = servers.picomq(work_dir, None, env).start()
        started.append(picomq)
        base, subscription_id, prefix = picomq.url, "costs", "linked"
        webhook = f"http://{servers.HOST}:{receiver.server_address[1]}/"
        config = {"type": "webhook", "pattern": f"{prefix}/*", "webhook": {"url": webhook}}
        url = f"{base}/v1/stream/__ds/subscriptions/{subscription_id}"
        requests.put(url, json=config, timeout=10).raise_for_status()
        figures = measure(base, appends, subscription_id, prefix, deliveries)
        time.sleep(SETTLE_SECONDS)
        before = storage_requests(base)
        time.sleep(idle)
        figures["idle"] = storage_requests(base) - before
        report(storage, workers, appends, idle, figures)
    finally:
        receiver.shutdown()
        for server in reversed(started):
            server.stop()


def report(storage: str, workers: int, appends: int, idle: float, figures: dict) -> None:
    baseline, woken = figures["baseline"], figures["woken"]
    print(f"{storage}, {workers} workers, {appends} wakes, idle window {idle:.0f} s")
    for op in sorted(set(baseline) | set(woken) | set(figures["idle"])):
        per_append, per_wake = baseline[op] / appends, woken[op] / appends
        print(f"  {op:6} per unlinked append {per_append:5.2f}   per wake (append included)"
              f" {per_wake:5.2f}   wake alone {per_wake - per_append:5.2f}"
              f"   idle {figures['idle'][op]}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", choices=["disk", "s3"], default="disk")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--wakes", type=int, default=40)
    parser.add_argument("--idle", type=float, default=60.0)
    arguments = parser.parse_args()
    run(arguments.storage, arguments.workers, arguments.wakes, arguments.idle)


if __name__ == "__main__":
    main()
