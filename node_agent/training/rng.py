"""The random number generators a training step draws from, kept with a snapshot so that a resumed run draws
what the uninterrupted one would have (dropout masks, data augmentation): torch's CPU and CUDA generators,
Python's `random`, and numpy's global one when the script uses numpy. Held as tensors and plain values (no
pickled objects). A generator the snapshot lacks, or one of another size (another number of GPUs), is left as it
is rather than guessed."""
from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.copy()), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached": float(cached)}
    return out


def restore(saved: dict[str, Any]) -> None:
    if isinstance(saved.get("torch"), torch.Tensor):
        torch.set_rng_state(saved["torch"])
    python = saved.get("python")
    if isinstance(python, tuple) and len(python) == 3:
        random.setstate((python[0], tuple(python[1]), python[2]))
    cuda = saved.get("cuda")
    if isinstance(cuda, list) and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    np = sys.modules.get("numpy")
    state = saved.get("numpy")
    if np is not None and isinstance(state, dict):
        np.random.set_state((state["kind"], state["keys"].numpy(), state["pos"], state["has_gauss"],
                             state["cached"]))
