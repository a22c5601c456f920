"""Write a large stream, read it end to end, and report throughput and server memory.

Starts its own gunicorn (one gevent worker) on 127.0.0.1 with a temporary data
directory, appends `--mib` MiB in `--chunk-mib` POSTs, then reads the stream from -1
following Stream-Next-Offset while sampling the worker's resident memory. Prints
figures; asserts nothing about speed. Stops its server when done.

    .venv/bin/python bench/read_large.py --mib 1024
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_server(data_dir: str, port: int) -> subprocess.Popen[bytes]:
    environment = {**os.environ, "PICOMQ_STORAGE_URL": data_dir}
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "gunicorn"), "-c", "gunicorn.conf.py",
         "--bind", f"127.0.0.1:{port}", "wsgi:app"],
        cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            requests.head(f"http://127.0.0.1:{port}/v1/stream/probe", timeout=1)
            return server
        except requests.ConnectionError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("server did not start")


def worker_pid(master: int) -> int:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return int(children[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="stream size in MiB")
    parser.add_argument("--chunk-mib", type=int, default=8, help="MiB per append")
    options = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as data_dir:
        server = start_server(data_dir, port)
        try:
            run(f"http://127.0.0.1:{port}/v1/stream/large", worker_pid(server.pid), options)
        finally:
            server.terminate()
            server.wait(timeout=30)


def run(url: str, worker: int, options: argparse.Namespace) -> None:
    session = requests.Session()
    session.put(url, headers={"Content-Type": "application/octet-stream"}).raise_for_status()
    chunk = os.urandom(options.chunk_mib * 1024 * 1024)
    started = time.monotonic()
    for _ in range(options.mib // options.chunk_mib):
        answer = session.post(url, data=chunk, headers={"Content-Type": "application/octet-stream"})
        answer.raise_for_status()
    written = time.monotonic() - started
    print(
        f"wrote {options.mib} MiB in {written:.1f} s ({options.mib / written:.0f} MiB/s, fsynced)"
    )

    peak = [resident_mib(worker)]
    baseline = peak[0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], resident_mib(worker))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    offset, total, responses, first_byte = "-1", 0, 0, None
    started = time.monotonic()
    while True:
        with session.get(url, params={"offset": offset}, stream=True) as answer:
            answer.raise_for_status()
            for piece in answer.iter_content(1024 * 1024):
                if first_byte is None:
                    first_byte = time.monotonic() - started
                total += len(piece)
            responses += 1
            offset = answer.headers["Stream-Next-Offset"]
            if answer.headers.get("Stream-Up-To-Date") == "true":
                break
    elapsed = time.monotonic() - started
    done.set()
    sampler.join()
    assert total == options.mib * 1024 * 1024, f"read {total} bytes"
    print(f"read {total / 2**20:.0f} MiB in {elapsed:.1f} s ({total / 2**20 / elapsed:.0f} MiB/s)"
          f" over {responses} responses; first byte after {first_byte * 1000:.1f} ms")  # fmt: skip
    print(f"worker RSS: {baseline:.0f} MiB before the read, peak {peak[0]:.0f} MiB during it")


if __name__ == "__main__":
    main()
