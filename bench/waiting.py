"""What readers that wait cost PicoMQ when nothing is appended: its worker's CPU use.

A long-poll (or an SSE subscriber) at the tail of a stream costs no request or
storage read while it waits, but its process looks for segments that other
processes (other workers, other nodes) may have written: on local disk when an
inotify watch on the stream's segment directory says one was added, and a stat of
the next segment once a second besides (every PICOMQ_POLL_INTERVAL, 50 ms, where no
watch can be added), per stream with waiting readers. This starts PicoMQ as
compare.py does (one gevent worker pinned to one core, data under bench/results/),
opens one long-poll at the tail of each of `--streams` streams, and prints the
worker's CPU use while they wait. Asserts nothing.

    .venv/bin/python bench/waiting.py --streams 1000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import servers
from client import Connection
from loads import STREAM_PREFIX, create_streams
from servers import Server

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SETTLE_SECONDS = 2.0  # every long-poll arrives and starts waiting


async def measure(server: Server, streams: int, seconds: float) -> float:
    """CPU use of the server's processes, in % of one core, while the long-polls wait."""
    paths = [f"{STREAM_PREFIX}waiting-{number}" for number in range(streams)]
    tail = await create_streams(server.port, paths)
    connections = [Connection(server.port) for _ in paths]
    waits = [
        asyncio.create_task(connection.request("GET", f"{path}?offset={tail}&live=long-poll"))
        for connection, path in zip(connections, paths, strict=True)
    ]
    try:
        await asyncio.sleep(SETTLE_SECONDS)
        before = server.cpu_seconds()
        await asyncio.sleep(seconds)
        return 100 * (server.cpu_seconds() - before) / seconds
    finally:
        for wait in waits:
            wait.cancel()
        for connection in connections:
            await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams, one long-poll each")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to measure (≤ 15)")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    options = parser.parse_args()
    seconds = min(options.seconds, 15.0)  # under the 20 s long-poll timeout
    os.sched_setaffinity(0, {options.client_core})
    servers.raise_open_file_limit()
    RESULTS_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=RESULTS_DIR, prefix="waiting-") as work_dir:
        server = servers.picomq(Path(work_dir), options.server_core).start()
        try:
            used = asyncio.run(measure(server, options.streams, seconds))
        finally:
            server.stop()
    print(
        f"{options.streams:,} long-polls waiting on as many streams, nothing appended:"
        f" PicoMQ used {used:.1f} % of a core over {seconds:g} s"
    )


if __name__ == "__main__":
    main()
