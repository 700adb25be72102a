"""The type checker and the linter are part of the suite: CI fails on them like on any test.

Settings live in pyproject.toml ([tool.mypy], [tool.ruff]). mypy checks protocol/, rdzv_server/
and node_agent/ with every function typed, so a misspelt attribute in a rule module is an error.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_finds_no_errors():
    # No cache: a cached result can miss an edit made in the same second as the last run.
    done = run("mypy", "--no-incremental", "--cache-dir", os.devnull)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_finds_nothing():
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr
