"""CPU time per append of PicoMQ's store alone, in one process: no HTTP, no Flask.

Through HTTP a change of a few per cent needs 6 alternated reps of bench/ab.py to
show; the store alone shows what it does to a commit within a couple of µs. Here 64
greenlets (as many as compare.py's connections) append one 100-byte JSON message at
a time to `--streams` streams in turn, through `StreamStore.append` on local storage
as PicoMQ's worker makes it: the process serves every stream alone (as a worker does
once it claims their partitions), so each commit goes through the member's log (group
commit, log flush, records held for the rewrite), on the thread pool. Over 1,000
streams nearly every append is a commit of its own. It prints appends/s and the
process's CPU time (the event loop's thread and the pool's) per append.

Times on a shared VM swing by a fifth from one minute to the next. `--instructions`
runs the same appends under valgrind's callgrind (not a dependency: Debian's
`valgrind`) twice, `--appends` and three times as many, and prints the instructions
per append between the two: the same to a fraction of a per cent run after run,
whatever else the machine does, and about 50 times slower to get.

`--rewrite` adds the rewrite of the records the appends left held (rewrites.py) to
what is measured, as a sustained load pays it once they come due. Under
`--instructions` both runs rewrite as many streams, so the difference holds a
record's share of the rewrite and not a stream's: over 1,000 streams taking 5,000
appends a second, about 150 records share each stream's segment.

By default the data goes to tmpfs (/dev/shm), where writing and syncing cost next to
nothing: what is left is the store's own work. `--dir` puts it elsewhere; on ext4
without a journal leave a minute after any run that deleted files (README). Pin it to
one core, as the worker is, and alternate runs of the two versions to compare:

    taskset -c 0 .venv/bin/python bench/store_cpu.py --streams 1000
    taskset -c 0 .venv/bin/python bench/store_cpu.py --streams 1 --appends 60000
    .venv/bin/python bench/store_cpu.py --streams 1000 --appends 2000 --instructions
    .venv/bin/python bench/store_cpu.py --streams 1000 --appends 6000 --instructions --rewrite
"""

from gevent import monkey

monkey.patch_all()  # as gunicorn's gevent worker does before it loads PicoMQ

import argparse  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
from loads import JSON_TYPE, Options, message  # noqa: E402
from servers import REPO_DIR  # noqa: E402

sys.path.insert(0, str(REPO_DIR))
from storage import StreamStore, open_objects  # noqa: E402
from streams import AppendRequest, CreateRequest, Payload, StoreSettings  # noqa: E402

MAX_APPENDS = 1_000_000  # bounded: about a minute on one core
MAX_COUNTED_APPENDS = 20_000  # under callgrind: about 10 minutes
MEMBER = "store-cpu"
REWRITE_BOUND_SECONDS = 600
COLLECTED = re.compile(r"Collected : (\d+)")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams appended to in turn")
    parser.add_argument("--appends", type=int, default=30000, help="appends in all")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where the data goes")
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions per append (valgrind)"
    )
    parser.add_argument(
        "--rewrite", action="store_true", help="count the rewrite of what they held, too"
    )
    arguments = parser.parse_args()
    if not 1 <= arguments.streams <= arguments.appends <= MAX_APPENDS:
        parser.error(f"need 1 <= --streams <= --appends <= {MAX_APPENDS:,}")
    if arguments.instructions and 3 * arguments.appends > MAX_COUNTED_APPENDS:
        parser.error(f"--instructions counts at most {MAX_COUNTED_APPENDS:,} appends in all")
    return arguments


def count_instructions(arguments: argparse.Namespace) -> None:
    """Instructions per append: two runs under callgrind, `--appends` and three times as
    many; the difference leaves out the start and the creates."""
    counts = []
    for appends in (arguments.appends, 3 * arguments.appends):
        command = [
            "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
            sys.executable, __file__, "--streams", str(arguments.streams),
            "--appends", str(appends), "--dir", str(arguments.dir),
            *(["--rewrite"] if arguments.rewrite else []),
        ]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=True)
        counts.append(int(COLLECTED.findall(run.stderr)[-1]))
    per_append = (counts[1] - counts[0]) / (2 * arguments.appends)
    rewrite = ", its rewrite included" if arguments.rewrite else ""
    print(f"{arguments.streams:,} streams: {per_append:,.0f} instructions per append{rewrite}")


def main() -> None:
    arguments = parse_arguments()
    if arguments.instructions:
        count_instructions(arguments)
        return
    root = tempfile.mkdtemp(prefix="store-cpu-", dir=arguments.dir)
    try:
        store = StreamStore(open_objects(root), StoreSettings())
        store.serves_alone = lambda path: True
        store.log.begin(MEMBER)
        paths = [f"s{number}" for number in range(arguments.streams)]
        for path in paths:
            store.create(path, CreateRequest(JSON_TYPE))
        request = AppendRequest(JSON_TYPE, Payload.from_messages([message()]), False, None, None)
        turns = iter(range(arguments.appends))

        def append_in_turn() -> None:
            for turn in turns:
                store.append(paths[turn % len(paths)], request)

        appenders = [gevent.spawn(append_in_turn) for _ in range(Options.connections)]
        cpu_before, started = time.process_time(), time.perf_counter()
        gevent.joinall(appenders, raise_error=True)
        if arguments.rewrite and not store.rewrites.rewrite_all(REWRITE_BOUND_SECONDS):
            raise RuntimeError(f"the rewrite took over {REWRITE_BOUND_SECONDS} s")
        cpu, seconds = time.process_time() - cpu_before, time.perf_counter() - started
    finally:
        shutil.rmtree(root, ignore_errors=True)
    streams = f"{arguments.streams:,} stream{'s' if arguments.streams > 1 else ''}"
    rewrite = " and their rewrite" if arguments.rewrite else ""
    print(
        f"{arguments.appends:,} appends{rewrite} over {streams} in {root}: "
        f"{arguments.appends / seconds:,.0f} appends/s, "
        f"{1e6 * cpu / arguments.appends:.1f} µs of CPU per append"
    )


if __name__ == "__main__":
    main()
