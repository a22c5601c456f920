"""Appends over many streams as a share of one stream's rate, from interleaved slices.

many_streams.py's `disk-appends` pairs two 10-second loads run on fresh servers about
half a minute apart, and this machine's speed drifts within that: one revision's pairs
ranged from 0.69 to 1.02 in one evening. Here two servers of one revision run side by
side on the server core, one with a stream and one with `--streams` streams, and wrk
(64 connections, one 100-byte message per POST, compare.py's `appends-1` and
`appends-1000`) loads them in turn for `--slice-seconds` each, `--slices` times, with
the idle one stopped (SIGSTOP): its background work runs in its own slices, not in the
other's. The first slice of each is a warm-up, not counted. It prints each pair of
slices' share (many over one), their median, and the share of the mean rates.

What a sustained load costs includes rewriting the shared log's records into each
stream's segments (rewrites.py), which a 10-second load never reaches: its first
records are due after PICOMQ_REWRITE_SECONDS. Each server here runs about half of the
wall-clock time, so both get REWRITE_SECONDS, twice the default: in their own running
time, their records are rewritten about as often as by default, and the default run
(31 slices of each, two minutes of wall-clock time) holds a round of rewrites.

    .venv/bin/python bench/interleaved_share.py                      # about 3 minutes
    .venv/bin/python bench/interleaved_share.py --revision a0e0ac3 --slices 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import ab
import compare
import servers
from loads import STREAM_PREFIX, Options, Posts, Target, create_streams, wrk_load

WORKING_TREE = "."
REWRITE_SECONDS = "60"  # the default 30 s, in each server's own running time


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--revision", default=WORKING_TREE, help="git revision ('.': this tree)")
    parser.add_argument("--streams", type=int, default=1000, help="streams of the other server")
    parser.add_argument("--slices", type=int, default=30, help="counted slices of each load")
    parser.add_argument("--slice-seconds", type=int, default=2, help="seconds of each slice")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    arguments = parser.parse_args()
    if not 1 <= arguments.slices <= 60 or not 1 <= arguments.slice_seconds <= 10:
        parser.error("at most 60 slices of at most 10 seconds: the run must stay bounded")
    return arguments


@contextmanager
def running(server: servers.Server) -> Iterator[None]:
    """Let a stopped server run for the length of the block, then stop it again."""
    signal_all(server, signal.SIGCONT)
    try:
        yield
    finally:
        signal_all(server, signal.SIGSTOP)


def signal_all(server: servers.Server, number: signal.Signals) -> None:
    for pid in server.processes():
        os.kill(pid, number)


def started_with_streams(
    stack: ExitStack, tree: Path, work_dir: Path, core: int, count: int
) -> Target:
    """A PicoMQ of `tree` with `count` streams, stopped (SIGSTOP) until its first slice."""
    server = servers.picomq(work_dir, core, {"PICOMQ_REWRITE_SECONDS": REWRITE_SECONDS}, tree)
    stack.callback(server.stop)
    stack.callback(signal_all, server, signal.SIGCONT)  # a stopped server cannot stop
    server.start()
    paths = [f"{STREAM_PREFIX}s{number}" for number in range(count)]
    asyncio.run(create_streams(server.port, paths))
    signal_all(server, signal.SIGSTOP)
    return Target(server, work_dir)


def slice_rate(target: Target, options: Options, streams: int) -> float:
    """Appends per second through one slice of wrk, with the server let run meanwhile."""
    with running(target.server):
        result = wrk_load(target, options, Posts.single(streams, options.connections))
    if result.notes:
        raise RuntimeError(f"failed appends in a slice: {result.notes}")
    return result.figures["msgs_per_s"]


def main() -> None:
    arguments = parse_arguments()
    options = Options(duration=arguments.slice_seconds, client_core=arguments.client_core)
    os.sched_setaffinity(0, {arguments.client_core})
    servers.raise_open_file_limit()
    revision = None if arguments.revision == WORKING_TREE else arguments.revision
    label = compare.git("rev-parse", "--short", revision or "HEAD") or "unknown"
    print(f"{time.strftime('%Y-%m-%d %H:%M')} revision {arguments.revision} ({label})")
    with ExitStack() as stack:
        tree = stack.enter_context(ab.checked_out(revision))
        work_root = stack.enter_context(compare.work_area(keep=False))
        counts = {"one": 1, "many": arguments.streams}
        targets = {
            name: started_with_streams(stack, tree, work_root / name, arguments.server_core, n)
            for name, n in counts.items()
        }
        rates: dict[str, list[float]] = {name: [] for name in counts}
        for number in range(arguments.slices + 1):
            order = list(counts) if number % 2 == 0 else list(counts)[::-1]
            measured = {name: slice_rate(targets[name], options, counts[name]) for name in order}
            if number == 0:
                continue  # warm-up
            for name, rate in measured.items():
                rates[name].append(rate)
            print(
                f"  slice {number}: one {measured['one']:,.0f}/s, many {measured['many']:,.0f}/s,"
                f" share {measured['many'] / measured['one']:.3f}",
                flush=True,
            )
    shares = [many / one for one, many in zip(rates["one"], rates["many"], strict=True)]
    print(
        f"{arguments.streams:,} streams over 1: median share {statistics.median(shares):.3f}"
        f" ({min(shares):.3f}-{max(shares):.3f}); share of the means"
        f" {statistics.fmean(rates['many']) / statistics.fmean(rates['one']):.3f};"
        f" one stream {statistics.median(rates['one']):,.0f}/s,"
        f" {arguments.streams:,} streams {statistics.median(rates['many']):,.0f}/s (medians)"
    )


if __name__ == "__main__":
    main()
