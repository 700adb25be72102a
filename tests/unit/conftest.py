"""Fixtures of the unit tests: `memory`, a worker's memory directory ($NODE_AGENT_MEMORY_DIR) with no limit."""
from __future__ import annotations

import pytest

from node_agent.training import snapshot


@pytest.fixture
def memory(tmp_path, monkeypatch) -> str:
    where = tmp_path / "mem"
    where.mkdir()
    monkeypatch.setenv(snapshot.DIR_VAR, str(where))
    monkeypatch.delenv(snapshot.LIMIT_VAR, raising=False)
    return str(where)
