"""The shape of PicoMQ's modules: imports that never go round in a circle.

A circle means two modules that cannot be read, tested or changed one without the
other, and one of them importing the other inside a function to break the loop at
import time. Every import counts: at the top, inside a function, under `if
TYPE_CHECKING:`. Run alone: `.venv/bin/python -m pytest tests/test_architecture.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parent.parent
# The app's assembly and its HTTP modules import at the top, never inside a function:
# their imports are the order they are read in, and nothing waits for a call to load.
HTTP_MODULES = (
    "wsgi",
    "picomq",
    "protocol",
    "live",
    "fastpath",
    "auth",
    "ops",
    "subscriptions",
    "webhooks",
    "worker",
)


def project_modules() -> dict[str, Path]:
    """The top-level modules by import name (`gunicorn.conf.py` is `gunicorn.conf`)."""
    return {path.name.removesuffix(".py"): path for path in REPO_DIR.glob("*.py")}


def imported_names(tree: ast.AST) -> set[str]:
    """The top-level package of every absolute import anywhere in `tree`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def import_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        imported = imported_names(ast.parse(path.read_text(), str(path))) & modules.keys()
        graph[name] = imported - {name}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the modules along it (the first again at the end)."""
    done: set[str] = set()  # modules from which no circle can be reached
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]  # the depth-first walk's current path, each with its successors left
        successors = [iter(sorted(graph[start]))]
        while path:
            successor = next(successors[-1], None)
            if successor is None:
                successors.pop()
                done.add(path.pop())
            elif successor in path:
                return path[path.index(successor) :] + [successor]
            elif successor not in done:
                path.append(successor)
                successors.append(iter(sorted(graph[successor])))
    return None


def test_no_module_imports_itself_round_a_circle() -> None:
    circle = find_circle(import_graph())
    assert circle is None, "an import circle: " + " -> ".join(circle or [])


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(graph) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_kind_of_import_counts() -> None:
    source = (
        "import x.y\nfrom z import w\nfrom . import local\n"
        "if TYPE_CHECKING:\n    from t import T\n"
        "def f():\n    import inner\n"
    )
    assert imported_names(ast.parse(source)) == {"x", "z", "t", "inner"}


@pytest.mark.parametrize("module", HTTP_MODULES)
def test_http_modules_import_only_at_the_top(module: str) -> None:
    path = project_modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    late = [
        f"{path.name}:{inner.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(node)
        if isinstance(inner, ast.Import | ast.ImportFrom)
    ]
    assert not late, f"imports inside functions: {', '.join(late)}"
