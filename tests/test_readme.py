"""README's journey with curl, run as written against a real PicoMQ, so it cannot drift.

The commands of the section's sh block run in one bash script, in order, with the README's
base URL turned into the test server's. The lines the README shows under a command (as
`#   ...` comments) must be among the lines that command prints, in the same order; `…`
in a shown line stands for any text (a cursor, say). A command that prints anything must
show at least one line of it, so no step of the journey goes unchecked.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conftest import StartServer

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## The journey, with curl"
README_BASE_URL = "http://127.0.0.1:4437"  # what ./serve.sh listens on
SHOWN = "#   "
MARKER = "@@ step {} @@"
SCRIPT_TIMEOUT_SECONDS = 60


@dataclass
class Step:
    """One command of the journey and the lines of its output the README shows."""

    command: str
    shown: list[str] = field(default_factory=list)
    printed: list[str] = field(default_factory=list)


def journey_lines() -> list[str]:
    """The lines of the first sh block after the journey's heading."""
    _, found, after = README.read_text().partition(SECTION)
    assert found, f"README has no {SECTION!r}"
    _, found, block = after.partition("```sh\n")
    assert found, f"no sh block after {SECTION!r}"
    return block.partition("\n```")[0].splitlines()


def parse_steps(lines: list[str]) -> list[Step]:
    """Each line that is not a comment is a command; `#   ` lines below it, its output."""
    steps: list[Step] = []
    for line in lines:
        if line.startswith(SHOWN):
            assert steps, f"output shown before any command: {line!r}"
            steps[-1].shown.append(line.removeprefix(SHOWN))
        elif line.strip() and not line.startswith("#"):
            steps.append(Step(line))
    return steps


def run_steps(steps: list[Step], base_url: str, directory: Path) -> None:
    """Run every step in one bash script (they share its variables); fill in `printed`."""
    script = ["set -eu"]
    for number, step in enumerate(steps):
        script += [f"printf '\\n{MARKER.format(number)}\\n'", step.command]
    source = "\n".join(script)
    assert source.count(README_BASE_URL) == 1, f"the journey should name {README_BASE_URL} once"
    result = subprocess.run(
        ["bash", "-c", source.replace(README_BASE_URL, base_url)],
        cwd=directory,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_SECONDS,
    )
    assert result.returncode == 0, f"{result.returncode}\n{result.stdout}\n{result.stderr}"
    outputs = re.split(r"\n@@ step \d+ @@\n", result.stdout)[1:]
    assert len(outputs) == len(steps), result.stdout
    for step, output in zip(steps, outputs, strict=True):
        step.printed = [line.rstrip("\r") for line in output.splitlines() if line.strip()]


def matches(shown: str, printed: str) -> bool:
    return re.fullmatch(".*".join(map(re.escape, shown.split("…"))), printed) is not None


def shows_in_order(shown: list[str], printed: list[str]) -> bool:
    """Whether the shown lines are among the printed ones, in the same order."""
    remaining = iter(printed)
    return all(any(matches(line, candidate) for candidate in remaining) for line in shown)


def describe_problem(step: Step) -> str | None:
    """What is wrong with a step that ran, with its command and both outputs; None if right."""
    if step.printed and not step.shown:
        found = "prints output the README does not show"
    elif not shows_in_order(step.shown, step.printed):
        found = "prints other lines than the README shows"
    else:
        return None
    shown = "".join(f"\n    {line}" for line in step.shown)
    printed = "".join(f"\n    {line}" for line in step.printed)
    return f"$ {step.command}\n  {found}\n  shown:{shown}\n  printed:{printed}"


def test_readme_journey_prints_what_it_shows(start_server: StartServer, tmp_path: Path) -> None:
    # Its live reads end within a second: the SSE step has no Ctrl-C here.
    server = start_server(env={"PICOMQ_SSE_MAX_DURATION": "1"})
    steps = parse_steps(journey_lines())
    assert any(step.shown for step in steps), f"no command of {SECTION!r} shows its output"
    run_steps(steps, server.url, tmp_path)
    problems = [found for step in steps if (found := describe_problem(step)) is not None]
    assert not problems, "\n".join(problems)
