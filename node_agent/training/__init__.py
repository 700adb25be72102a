"""What runs inside a training process (the worker side), in one package:
- standard library only, safe to import anywhere (the agent reads their names and rules): `probe.py`, the progress
  probe every worker runs (loaded by file path: it imports nothing of ours; `boot/` starts it in a cold worker);
  `heartbeat.py` (`beat()`: a step said by a script that steps no torch optimizer); `snapshot.py` (the memory
  directory's snapshots, torch-free);
- importing torch, used from the user's script only: `protect` (snapshots in one call: protection.py, capture.py,
  resume.py, trees.py, rng.py), `lightning.py` and `hf.py` (the same for Lightning and transformers' Trainer).
Importing this package imports no torch: `protect` is loaded when first asked for."""
from __future__ import annotations

from typing import Any

__all__ = ["protect"]


def __getattr__(name: str) -> Any:
    if name == "protect":
        from node_agent.training.protection import protect
        return protect
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
