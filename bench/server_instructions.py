"""Instructions a PicoMQ worker spends per append, over one stream and over many.

bench/many_streams.py's `disk-appends` times appends over 1 and 1,000 streams with
wrk; on this shared VM times swing by a fifth from one minute to the next, more than
most changes to a commit move them. Here the worker runs under valgrind's callgrind
(not a dependency: Debian's `valgrind`), about 30 times slower, as compare.py runs it
otherwise (gunicorn.conf.py, one gevent worker, data on local disk), and a client of
64 connections, as many as wrk's, appends one small JSON message at a time to
`--streams` streams in turn. Each case runs twice, `--appends` and four times as
many, after two appends per stream that load it; the worker's instructions between
the two runs, per append between them, leave out its start, the creates and the
loading. Rewrites of the log are put off (PICOMQ_REWRITE_SECONDS): 30 s under
callgrind hold far fewer appends than at full speed, so they would weigh far more.

Instructions leave out the kernel's work (a quarter of an append on disk) and what
cache misses cost, so the ratio of rates is lower than the ratio printed here; runs
differ by a few per cent, as the log's flushes group commits differently each time.
`--caches` also simulates this machine's caches (callgrind's `--cache-sim`: a 48 KiB
first level and, as the last, one core's 1 MiB second level) and prints the data
misses per append of that last level: the reads and writes that wait for the shared
third level or for memory. Over many streams an append touches its stream's objects
after a thousand other appends have, and those misses are most of what its extra
time is; their cost in time depends on what the machine's other tenants do, so the
count is the steadier figure.
`--revision REV` (repeatable) measures another git revision, as many_streams.py does.

    .venv/bin/python bench/server_instructions.py --revision e13c0b1 --revision .  # 10 min
    .venv/bin/python bench/server_instructions.py --caches  # 7 min
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
from contextlib import ExitStack
from pathlib import Path

import ab
import servers
from client import Connection
from many_streams import WORKING_TREE, revision_label

CONNECTIONS = 64
STOP_SECONDS = 120.0
APPEND_TIMEOUT_SECONDS = 60.0
SETTINGS = {"PICOMQ_REWRITE_SECONDS": "3600"}
READY_SECONDS = 300.0  # a worker under valgrind boots slowly, slower with caches simulated
CACHES = ("--cache-sim=yes", "--I1=32768,8,64", "--D1=49152,12,64", "--LL=1048576,8,64")
EVENTS = re.compile(rb"^events: (.+)$", re.MULTILINE)
SUMMARY = re.compile(rb"^summary: (.+)$", re.MULTILINE)
LAST_LEVEL_DATA_MISSES = ("DLmr", "DLmw")
JSON = {"Content-Type": "application/json"}
BODY = b'{"event":"progress","n":1}'


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000, help="streams of the many case")
    parser.add_argument("--appends", type=int, default=1000, help="appends of the shorter run")
    parser.add_argument("--revision", action="append", help="a git revision ('.': working tree)")
    parser.add_argument(
        "--caches", action="store_true", help="also count misses of simulated caches"
    )
    arguments = parser.parse_args()
    if not 1 <= arguments.appends <= 10_000 or not 2 <= arguments.streams <= 10_000:
        parser.error("need 1 <= --appends <= 10,000 and 2 <= --streams <= 10,000")
    arguments.revisions = arguments.revision or [WORKING_TREE]
    return arguments


def main() -> None:
    arguments = parse_arguments()
    with ExitStack() as stack:
        for revision in arguments.revisions:
            tree = stack.enter_context(
                ab.checked_out(None if revision == WORKING_TREE else revision)
            )
            per_append = {
                streams: counts_per_append(tree, streams, arguments.appends, arguments.caches)
                for streams in (1, arguments.streams)
            }
            one, many = per_append[1], per_append[arguments.streams]
            line = (
                f"{revision_label(revision)}: {one['Ir']:,.0f} instructions per append over 1"
                f" stream, {many['Ir']:,.0f} over {arguments.streams:,};"
                f" ratio {one['Ir'] / many['Ir']:.3f}"
            )
            if arguments.caches:
                misses = [
                    sum(counts[event] for event in LAST_LEVEL_DATA_MISSES) for counts in (one, many)
                ]
                line += f"; last-level data misses per append {misses[0]:,.0f} and {misses[1]:,.0f}"
            print(line)


def counts_per_append(tree: Path, streams: int, appends: int, caches: bool) -> dict[str, float]:
    """callgrind's counts per append (`Ir`: instructions; the misses with `caches`)."""
    shorter = worker_counts(tree, streams, appends, caches)
    longer = worker_counts(tree, streams, 4 * appends, caches)
    return {event: (longer[event] - shorter[event]) / (3 * appends) for event in longer}


def worker_counts(tree: Path, streams: int, appends: int, caches: bool) -> dict[str, int]:
    """The worker's counts from its start to its exit, with `appends` appends."""
    with tempfile.TemporaryDirectory(prefix="picomq-instructions-") as work:
        work_dir = Path(work)
        server = servers.picomq(work_dir, None, SETTINGS, tree)
        server.command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={work_dir}/callgrind.%p",
            *(CACHES if caches else ()),
            *server.command,
        ]
        server.ready_deadline_seconds = READY_SECONDS
        server.stop_deadline_seconds = STOP_SECONDS  # the worker writes its counts as it exits
        server.start()
        try:
            [worker] = server.processes()[1:]
            asyncio.run(append(server.port, streams, appends))
        finally:
            server.stop()
        counts = (work_dir / f"callgrind.{worker}").read_bytes()
        [events], [summary] = EVENTS.findall(counts), SUMMARY.findall(counts)
        return dict(zip(events.decode().split(), map(int, summary.split()), strict=True))


async def append(port: int, streams: int, appends: int) -> None:
    """Create the streams, append twice to each (which loads it), then `appends` more."""
    paths = [f"/v1/stream/instructions-{number}" for number in range(streams)]
    connections = [Connection(port) for _ in range(CONNECTIONS)]
    for connection in connections:
        await connection.open()
    for path in paths:
        response = await connections[0].request("PUT", path, JSON, b"")
        assert response.status == 201, response.status
    await append_in_turn(connections, paths, 2 * streams)
    await append_in_turn(connections, paths, appends)
    for connection in connections:
        await connection.close()


async def append_in_turn(connections: list[Connection], paths: list[str], appends: int) -> None:
    turns = iter(range(appends))

    async def send(connection: Connection) -> None:
        for turn in turns:
            request = connection.request("POST", paths[turn % len(paths)], JSON, BODY)
            response = await asyncio.wait_for(request, APPEND_TIMEOUT_SECONDS)
            assert response.status == 204, response.status

    await asyncio.gather(*(send(connection) for connection in connections))


if __name__ == "__main__":
    main()
