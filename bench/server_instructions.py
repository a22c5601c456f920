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
`--revision REV` (repeatable) measures another git revision, as many_streams.py does.

    .venv/bin/python bench/server_instructions.py --revision e13c0b1 --revision .  # 10 min
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
SUMMARY = re.compile(rb"^summary: (\d+)$", re.MULTILINE)
JSON = {"Content-Type": "application/json"}
BODY = b'{"event":"progress","n":1}'


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000, help="streams of the many case")
    parser.add_argument("--appends", type=int, default=1000, help="appends of the shorter run")
    parser.add_argument("--revision", action="append", help="a git revision ('.': working tree)")
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
                streams: instructions_per_append(tree, streams, arguments.appends)
                for streams in (1, arguments.streams)
            }
            one, many = per_append[1], per_append[arguments.streams]
            print(
                f"{revision_label(revision)}: {one:,.0f} instructions per append over 1"
                f" stream, {many:,.0f} over {arguments.streams:,};"
                f" ratio {one / many:.3f}"
            )


def instructions_per_append(tree: Path, streams: int, appends: int) -> float:
    shorter = worker_instructions(tree, streams, appends)
    longer = worker_instructions(tree, streams, 4 * appends)
    return (longer - shorter) / (3 * appends)


def worker_instructions(tree: Path, streams: int, appends: int) -> int:
    """The worker's instructions from its start to its exit, with `appends` appends."""
    with tempfile.TemporaryDirectory(prefix="picomq-instructions-") as work:
        work_dir = Path(work)
        server = servers.picomq(work_dir, None, SETTINGS, tree)
        server.command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={work_dir}/callgrind.%p",
            *server.command,
        ]
        server.stop_deadline_seconds = STOP_SECONDS  # the worker writes its counts as it exits
        server.start()
        try:
            [worker] = server.processes()[1:]
            asyncio.run(append(server.port, streams, appends))
        finally:
            server.stop()
        [summary] = SUMMARY.findall((work_dir / f"callgrind.{worker}").read_bytes())
        return int(summary)


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
