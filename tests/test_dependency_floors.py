"""The lower bounds pyproject declares are the versions `make test-oldest` tests (constraints-oldest.txt).

A floor below what the code uses breaks a user's `pip install` where an older version is already there:
`aiohttp>=3.9` let node-agent fail with a TypeError on `TCPConnector(socket_factory=...)` (3.12), and
`prometheus-client>=0.17` let the server fail on `disable_created_metrics()` (0.18)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _runtime_floors() -> dict[str, str]:
    """pyproject's [project] dependencies as name -> lower bound (tomllib is 3.11+; the suite runs on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert block is not None, "pyproject.toml: no [project] dependencies list"
    floors = dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][^",;]*)"', block.group(1)))
    assert floors, "pyproject.toml: no `name>=version` dependency found"
    return floors


def _oldest_pins() -> dict[str, str]:
    lines = (ROOT / "constraints-oldest.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in (ln.strip() for ln in lines) if line and not line.startswith("#"))


def test_constraints_oldest_pins_exactly_pyprojects_floors() -> None:
    assert _oldest_pins() == {name: _at_least_three_parts(v) for name, v in _runtime_floors().items()}


def test_every_runtime_dependency_has_a_floor() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert block is not None
    named = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block.group(1), re.M)
    assert set(named) == set(_runtime_floors()), f"a dependency without a `>=` floor among {named}"


def _at_least_three_parts(version: str) -> str:
    """`3.12` -> `3.12.0`: the release pip installs for `>=3.12`."""
    parts = version.split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))
