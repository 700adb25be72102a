"""The state a fork of the zygote copies, or drops, that a warm worker must get as a cold one would:
- torch's CPU threads: 1 while the preloads run, the environment's number again in each worker. A preload that
  computes as it is imported (a matmul at import) would start OpenMP's thread pool, whose threads a fork does not
  copy: the worker's first parallel operation would wait on them forever.
- the global generators (torch's CPU one, numpy's, `random`'s): reseeded from the OS in each worker, as a cold
  interpreter's are, unless a preload seeded one as it was imported (a cold worker's import seeds it alike): that
  one keeps its seed, `random`'s too, which a fork reseeds.
- a fork only while clean: no other Python thread, CUDA not initialised, torch's threads still held.
Loaded by the zygote by path: the standard library alone (torch and numpy looked up in sys.modules)."""
from __future__ import annotations

import contextlib
import sys
from typing import Any

_threads = 0                               # torch's CPU threads as the environment sets them (0: not held)
_at_import: dict[str, object] = {}         # a global generator's state as its package's import left it
_seeded_random: object = None              # `random`'s state where a preload seeded it (a fork reseeds it)


def _torch() -> Any:
    return sys.modules.get("torch")


def hold_threads() -> None:
    """Once torch is loaded: its CPU threads to 1 until the workers fork (their number kept for them)."""
    global _threads
    torch = _torch()
    if _threads or torch is None or not hasattr(torch, "set_num_threads"):
        return
    with contextlib.suppress(Exception):       # a torch without them: nothing to hold
        threads = int(torch.get_num_threads())
        torch.set_num_threads(1)
        _threads = threads


def note_generators() -> None:
    """Right after each preload: the state of each generator its import brought."""
    for name, state in _generators_now().items():
        _at_import.setdefault(name, state)


def preloads_done() -> None:
    """After the last preload: `random`'s state kept for the workers where a preload changed it."""
    global _seeded_random
    random = sys.modules.get("random")
    if random is not None and "random" in _at_import and random.getstate() != _at_import["random"]:
        _seeded_random = random.getstate()


def unclean() -> str:
    """Why a fork now would not give a clean worker ("" when it would)."""
    threading, torch = sys.modules.get("threading"), _torch()
    threads = 1 if threading is None else int(threading.active_count())
    if threads != 1:
        return f"{threads} Python threads in the zygote"
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA is initialised in the zygote"
    if _threads and torch.get_num_threads() != 1:
        return (f"a preload set torch's CPU threads to {torch.get_num_threads()} in the zygote: their OpenMP "
                f"threads would not survive a fork")
    return ""


def in_worker() -> None:
    """In a forked worker, before its script: torch's threads back, the generators as a cold worker's."""
    torch = _torch()
    if _threads and torch is not None:
        torch.set_num_threads(_threads)
    random = sys.modules.get("random")
    if _seeded_random is not None and random is not None:
        random.setstate(_seeded_random)
    for name, state in _generators_now().items():
        if name != "random" and _at_import.get(name) == state:
            _reseed(name)


def _generators_now() -> dict[str, object]:
    """The global generators' states that tell whether anyone seeded them: torch's CPU seed, numpy's state,
    `random`'s."""
    now: dict[str, object] = {}
    torch = _torch()
    if torch is not None and hasattr(torch, "initial_seed"):
        now["torch"] = torch.initial_seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and hasattr(numpy_random, "get_state"):
        state = numpy_random.get_state()
        now["numpy"] = (state[1].tobytes(), state[2])
    random = sys.modules.get("random")
    if random is not None and hasattr(random, "getstate"):
        now["random"] = random.getstate()
    return now


def _reseed(name: str) -> None:
    (sys.modules["torch"].default_generator if name == "torch" else sys.modules["numpy.random"]).seed()
