"""PicoMQ against itself: two versions alternated rep by rep on one load of compare.py.

A change that claims a few per cent needs its figure measured against the code before
it in the same hour: this VM's speed moves more than that from hour to hour. Each rep
starts a fresh PicoMQ of each version (one gunicorn gevent worker, a new data
directory, pinned to the server core, as compare.py runs it), the base first on even
reps, the new one first on odd ones, and prints per figure the medians, min–max, and
new ÷ base of each rep's pair and of the medians.

The base is a git revision, checked out into a temporary worktree removed at the end;
the new version is the working tree as it is (uncommitted changes included) unless
`--new` names a revision too. `--env-base` and `--env-new` set environment variables
(PICOMQ_* settings and the like) for one side only, so one version can be measured
against itself with a setting changed.

    .venv/bin/python bench/ab.py HEAD~1 --load appends-1000            # 4 reps, 8 s
    .venv/bin/python bench/ab.py HEAD --load live-sse --env-new PICOMQ_POLL_INTERVAL=0.01
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path

import compare
import servers
from compare import FIGURES, RESULTS_DIR, Run, Settings
from loads import LOADS, Options

SIDES = ("base", "new")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("base", help="git revision of the base version")
    parser.add_argument("--new", help="git revision of the new version (default: the working tree)")
    names = [load.name for load in LOADS]
    parser.add_argument("--load", required=True, choices=names, help="one load of compare.py")
    compare.add_harness_arguments(parser, reps=4, duration=8)
    for side in SIDES:
        parser.add_argument(
            f"--env-{side}",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"an environment variable for the {side} version's server (repeatable)",
        )
    arguments = parser.parse_args()
    compare.check_harness_arguments(parser, arguments)
    arguments.environments = {}
    for side in SIDES:
        pairs = getattr(arguments, f"env_{side}")
        if any("=" not in pair for pair in pairs):
            parser.error(f"--env-{side} takes NAME=VALUE")
        arguments.environments[side] = dict(pair.split("=", 1) for pair in pairs)
    arguments.selected = next(load for load in LOADS if load.name == arguments.load)
    return arguments


@contextmanager
def checked_out(revision: str | None) -> Iterator[Path]:
    """A temporary worktree of `revision`, removed afterwards; None: the working tree."""
    if revision is None:
        yield servers.REPO_DIR
        return
    tree = Path(tempfile.mkdtemp(prefix="picomq-ab-"))
    try:
        compare.git("worktree", "add", "--detach", str(tree), revision, check=True)
    except subprocess.CalledProcessError as error:
        shutil.rmtree(tree, ignore_errors=True)
        raise SystemExit(f"ab.py: cannot check out {revision!r}: {error.stderr.strip()}") from None
    try:
        yield tree
    finally:
        compare.git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tree, ignore_errors=True)


def main() -> None:
    arguments = parse_arguments()
    load = arguments.selected
    options = Options(duration=arguments.duration, client_core=arguments.client_core)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    os.sched_setaffinity(0, {arguments.client_core})
    open_files = servers.raise_open_file_limit()
    machine, command = compare.describe_run("bench/ab.py", open_files)
    runs: list[Run] = []
    with ExitStack() as stack:
        trees = {
            "base": stack.enter_context(checked_out(arguments.base)),
            "new": stack.enter_context(checked_out(arguments.new)),
        }
        settings = {
            side: Settings(
                server_core=arguments.server_core,
                profile=False,
                profile_dir=RESULTS_DIR,
                picomq_tree=trees[side],
                picomq_env=arguments.environments[side],
            )
            for side in SIDES
        }
        work_root = stack.enter_context(compare.work_area(keep=False))
        new = arguments.new or "the working tree"
        print(
            f"\n{load.title.format(**asdict(options))}: {arguments.base} against {new}", flush=True
        )
        for rep in range(arguments.reps):
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                work_dir = work_root / f"{side}-{rep}"
                work_dir.mkdir()
                run = compare.measure(load, "picomq", rep, work_dir, options, settings[side])
                run.server = side
                runs.append(run)
                print(f"  rep {rep + 1} {side:4} {compare.summarize(load, run)}", flush=True)
    print(f"\n{format_table(load.figures, runs)}\n{compare.format_notes(runs)}")
    compare.save(machine, command, stamp, runs, kind="ab")


def format_table(figures: tuple[str, ...], runs: list[Run]) -> str:
    lines = [
        "| figure | base median (min–max) | new median (min–max) | new ÷ base, each rep "
        "| ÷ medians |",
        "|---|---:|---:|---:|---:|",
    ]
    for key in figures:
        figure = FIGURES[key]
        by_rep = {
            side: {run.rep: run.figures.get(key) for run in runs if run.server == side}
            for side in SIDES
        }
        measured = {side: [v for v in by_rep[side].values() if v is not None] for side in SIDES}
        cells = [compare.spread(measured[side], figure.format) for side in SIDES]
        each, middle = "—", "—"
        if figure.ratio and measured["base"] and measured["new"]:
            pairs = [
                by_rep["new"][rep] / base
                for rep, base in by_rep["base"].items()
                if base and by_rep["new"].get(rep) is not None
            ]
            each = " · ".join(compare.format_ratio(pair) for pair in pairs) or "—"
            base_median = statistics.median(measured["base"])
            if base_median:
                middle = compare.format_ratio(statistics.median(measured["new"]) / base_median)
        lines.append(f"| {figure.label} | {cells[0]} | {cells[1]} | {each} | {middle} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
