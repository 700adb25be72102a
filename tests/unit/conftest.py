"""Fixtures of the unit tests: `memory`, a worker's memory directory ($NODE_AGENT_MEMORY_DIR) with no limit."""
from __future__ import annotations

import sys

import pytest

from node_agent.training import snapshot


@pytest.fixture
def memory(tmp_path, monkeypatch, request) -> str:
    where = tmp_path / "mem"
    where.mkdir()
    monkeypatch.setenv(snapshot.DIR_VAR, str(where))
    monkeypatch.delenv(snapshot.LIMIT_VAR, raising=False)
    # A test's protect calls stand each for a new process's first (a restart, simulated in one process); a script's
    # second call (its own snapshots only, the first call's hooks ended) is tested with `script_calls`
    protection = sys.modules.get("node_agent.training.protection")     # (imported by the test's module, or not)
    if protection is not None and "script_calls" not in request.fixturenames:
        monkeypatch.setattr(protection, "_next_call", lambda: 0)
        monkeypatch.setattr(protection, "_end_earlier", protection._LIVE.clear)
    return str(where)


@pytest.fixture
def script_calls(memory, monkeypatch) -> str:
    """`memory`, with protect's calls numbered and ended as one script's, from its first."""
    from node_agent.training import protection
    monkeypatch.setattr(protection, "_CALLS", [0])
    monkeypatch.setattr(protection, "_LIVE", [])
    monkeypatch.setattr(protection, "_NUMBERED", [0])
    return memory
