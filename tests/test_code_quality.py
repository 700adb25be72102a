"""The type checker and the linter are part of the suite: CI fails on them like on any test.

Settings live in pyproject.toml ([tool.mypy], [tool.ruff]). mypy checks protocol/, rdzv_server/
node_agent/ and rdzv_ctl/ with every function typed, so a misspelt attribute in a rule module is an error.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.packages import ROOT, modules


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_finds_no_errors():
    # No cache: a cached result can miss an edit made in the same second as the last run.
    done = run("mypy", "--no-incremental", "--cache-dir", os.devnull)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_finds_nothing():
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


MAX_LINES = 400


def imports_at_load(path: str, known: set[str]) -> set[str]:
    """Our modules that `path` imports at module level, those under `if TYPE_CHECKING:` included (a
    cycle hidden from the interpreter is still two modules that need each other); not those inside
    functions (run later, by choice)."""
    out: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for stmt in statements:
            if isinstance(stmt, ast.Import):
                out.update(a.name for a in stmt.names if a.name in known)
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                base = stmt.module
                for alias in stmt.names:
                    out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
            elif isinstance(stmt, ast.If):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                visit(stmt.body)
                for handler in stmt.handlers:
                    visit(handler.body)
    with open(path) as f:
        visit(ast.parse(f.read()).body)
    return {m for m in out if m in known}


def test_no_import_cycle_among_the_packages():
    found = modules()
    graph = {m: imports_at_load(path, set(found)) - {m} for m, path in found.items()}
    state: dict[str, int] = {}        # 1: on the current path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path[path.index(dep):], dep])
            if dep not in state:
                walk(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert len(graph) > 50          # the walk saw the packages


def test_no_module_is_over_400_lines():
    too_long = {}
    for module, path in modules().items():
        with open(path) as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            too_long[module] = lines
    assert not too_long, f"split these (over {MAX_LINES} lines): {too_long}"
