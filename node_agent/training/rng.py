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


def is_generator(obj: Any) -> bool:
    """A generator a loop draws from, as `protect`'s `extra` may hold it: a torch.Generator, a numpy Generator
    (`np.random.default_rng`, or on any bit generator) or RandomState, or a `random.Random` (not SystemRandom: the
    OS's, it has no state). Its state is taken as the optimizer step left it, as the global ones are: taken at the
    next forward (as a Stateful is), it was past the batch drawn before it, and a resumed run drew another (a
    review: a wrapped default_rng in `extra`, other weights)."""
    np = sys.modules.get("numpy")
    return isinstance(obj, torch.Generator) or isinstance(obj, random.Random) \
        and not isinstance(obj, random.SystemRandom) \
        or (np is not None and isinstance(obj, np.random.Generator | np.random.RandomState))


def state_of(obj: Any) -> Any:
    """A generator's state as a snapshot holds it (a tensor, plain values), else the object's state_dict. A numpy
    one's arrays (MT19937's key, Philox's counter, a RandomState's) as tensors: refused as arbitrary objects, only
    PCG64's state was taken (a review: `Generator(Philox())` in `extra` was a TypeError)."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, random.Random):
        return obj.getstate()
    if not is_generator(obj):
        return obj.state_dict()
    np = sys.modules["numpy"]
    state = obj.bit_generator.state if isinstance(obj, np.random.Generator) else obj.get_state(legacy=False)
    return _arrays(state, lambda a: torch.from_numpy(a.copy()) if isinstance(a, np.ndarray) else a)


def load_into(obj: Any, saved: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(saved)
    elif isinstance(obj, random.Random):
        obj.setstate((saved[0], tuple(saved[1]), saved[2]))
    elif is_generator(obj):
        state = _arrays(saved, lambda t: t.numpy().copy() if isinstance(t, torch.Tensor) else t)
        if isinstance(obj, sys.modules["numpy"].random.Generator):
            obj.bit_generator.state = state
        else:
            obj.set_state(state)
    else:
        obj.load_state_dict(saved)


def _arrays(state: Any, leaf: Any) -> Any:
    return {k: _arrays(v, leaf) for k, v in state.items()} if isinstance(state, dict) else leaf(state)
