"""CPU time per append of PicoMQ's store alone, in one process: no HTTP, no Flask.

Through HTTP a change of a few per cent needs 6 alternated reps of bench/ab.py to
show; the store alone shows what it does to a commit within a couple of µs. Here 64
greenlets (as many as compare.py's connections) append one 100-byte JSON message at
a time to `--streams` streams in turn, through `StreamStore.append` on local storage
as PicoMQ's worker makes it: group commit, `BatchedCreates`, the thread pool. Over
1,000 streams nearly every append is a commit of its own. It prints appends/s and
the process's CPU time (the event loop's thread and the pool's) per append.

By default the data goes to tmpfs (/dev/shm), where writing and syncing cost next to
nothing: what is left is the store's own work. `--dir` puts it elsewhere; on ext4
without a journal leave a minute after any run that deleted files (README). Pin it to
one core, as the worker is, and alternate runs of the two versions to compare:

    taskset -c 0 .venv/bin/python bench/store_cpu.py --streams 1000
    taskset -c 0 .venv/bin/python bench/store_cpu.py --streams 1 --appends 60000
"""

from gevent import monkey

monkey.patch_all()  # as gunicorn's gevent worker does before it loads PicoMQ

import argparse  # noqa: E402
import shutil  # noqa: E402
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


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams appended to in turn")
    parser.add_argument("--appends", type=int, default=30000, help="appends in all")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where the data goes")
    arguments = parser.parse_args()
    if not 1 <= arguments.streams <= arguments.appends <= MAX_APPENDS:
        parser.error(f"need 1 <= --streams <= --appends <= {MAX_APPENDS:,}")
    return arguments


def main() -> None:
    arguments = parse_arguments()
    root = tempfile.mkdtemp(prefix="store-cpu-", dir=arguments.dir)
    try:
        store = StreamStore(open_objects(root), StoreSettings())
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
        cpu, seconds = time.process_time() - cpu_before, time.perf_counter() - started
    finally:
        shutil.rmtree(root, ignore_errors=True)
    streams = f"{arguments.streams:,} stream{'s' if arguments.streams > 1 else ''}"
    print(
        f"{arguments.appends:,} appends over {streams} in {root}: "
        f"{arguments.appends / seconds:,.0f} appends/s, "
        f"{1e6 * cpu / arguments.appends:.1f} µs of CPU per append"
    )


if __name__ == "__main__":
    main()
