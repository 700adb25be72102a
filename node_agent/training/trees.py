"""A training state as a snapshot holds it: a tree of dicts, lists and tuples whose leaves are tensors and plain
values (what `torch.load(weights_only=True)` reads back, so loading a peer's file runs no code). The rules:
- A tensor is kept as its local part: a DTensor (FSDP2) as its shard, restored into the live layout.
- A snapshot fits a live state only if the same keys hold tensors of the same local shapes and dtypes; the first
  difference is named (an extra object's plain state may differ: mismatch's `plain_free_at`). Nothing is loaded
  until everything fits: never a partial load."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def leaves(tree: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf, in the tree's own order (dict insertion order survives a save and a load)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{where}/{key}")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{where}/{i}")
    else:
        yield where or "/", tree


def tensors(tree: Any) -> list[tuple[str, torch.Tensor]]:
    return [(p, leaf) for p, leaf in leaves(tree) if isinstance(leaf, torch.Tensor)]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage(t: torch.Tensor) -> int | None:
    """Where a tensor's storage begins (a DTensor's: its local shard's), or None for one without a plain storage
    (sparse, a wrapper subclass): what tells tensors that share memory."""
    try:
        return local(t).untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError, TypeError):
        return None


def refuse_unplain(tree: Any, what: str) -> None:
    """A leaf a snapshot cannot hold safely (an arbitrary object) is an error naming where it is."""
    problem = unplain(tree, what)
    if problem is not None:
        raise TypeError(problem)


def changeable(state: Any, whole: bool) -> Any:
    """What of a training state (protection.training_state) may gain an object a snapshot cannot hold after the
    protect call checked it: all of it up to its first snapshot (`whole`: the optimizer's state is made at its first
    step), then the extras and the optimizer's groups (a loop's numpy learning rate: a review saw it written, and
    refused on the resume), not the optimizer's thousands of tensors at every snapshot (~1 ms on the held path)."""
    optim = state["optim"]
    if whole or not isinstance(optim, dict):
        return state
    return {"optim": {"param_groups": optim.get("param_groups")}, "extra": state["extra"]}


def unplain(tree: Any, what: str) -> str | None:
    """The line naming the tree's first leaf a snapshot cannot hold safely (an arbitrary object), or None."""
    for where, leaf in leaves(tree):
        if not isinstance(leaf, (torch.Tensor, *PLAIN)):
            return (f"{what}{where} is a {type(leaf).__module__}.{type(leaf).__qualname__}: a snapshot holds "
                    f"tensors and plain values (numbers, strings, lists, dicts), not arbitrary objects")
    return None


def plain(leaf: Any) -> Any:
    """A number or string of a subclass as its plain type (numpy's float64 is a float, an IntEnum an int): pickled
    as its class, it made the snapshot unreadable (weights_only), yet passed `unplain` (a review: a loss history of
    np.mean's float64s, every snapshot refused on the resume, back to step 0)."""
    if isinstance(leaf, bool) or type(leaf) in PLAIN:
        return leaf
    if isinstance(leaf, float):
        return float(leaf)
    if isinstance(leaf, int):
        return int(leaf)
    return str.__str__(leaf) if isinstance(leaf, str) else bytes(leaf) if isinstance(leaf, bytes) else leaf


def rebuild(tree: Any, leaf: Callable[[Any], Any]) -> Any:
    """The same tree with every leaf passed through `leaf` (containers keep their type)."""
    if isinstance(tree, dict):
        out = {k: rebuild(v, leaf) for k, v in tree.items()}
        return OrderedDict(out) if isinstance(tree, OrderedDict) else out
    if isinstance(tree, list):
        return [rebuild(v, leaf) for v in tree]
    if isinstance(tree, tuple):
        return tuple(rebuild(v, leaf) for v in tree)
    return leaf(tree)


def mismatch(saved: Any, live: Any, where: str = "", plain_free_at: int | None = None) -> str | None:
    """The first difference between a snapshot's tree and the live one in keys, tensor shapes or dtypes, or None.
    Plain values may differ (a learning rate, a step count): the snapshot's are loaded. `plain_free_at`: from that
    depth down (0: the root), a part that holds no tensor in either tree may differ in its keys and lengths too (an
    object's own plain state, as `protect`'s extras hold: a loss history that grows, a dict per epoch), and an empty
    one in the live tree (a fresh object's) may hold anything in the snapshot: its object's load takes it.
    Refused, a fresh object's empty history sent every resume back to step 0 (a review)."""
    if plain_free_at is not None and plain_free_at <= 0 and (not tensors(saved) and not tensors(live)
                                                            or _grown(saved, live)):
        return None
    deeper = None if plain_free_at is None else plain_free_at - 1
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            return f"{where or '/'} is a {type(saved).__name__} in the snapshot, a dict in the model"
        missing = [k for k in live if k not in saved]
        extra = [k for k in saved if k not in live]
        if missing or extra:
            return f"{where or '/'}: keys {_few(missing)} missing from the snapshot" if missing \
                else f"{where or '/'}: keys {_few(extra)} in the snapshot are not in the model"
        found = (mismatch(saved[key], value, f"{where}/{key}", deeper) for key, value in live.items())
        return next(filter(None, found), None)
    if isinstance(live, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(live):
            return f"{where}: {_len(saved)} in the snapshot, {len(live)} entries in the model"
        found = (mismatch(s, v, f"{where}/{i}", deeper) for i, (s, v) in enumerate(zip(saved, live, strict=True)))
        return next(filter(None, found), None)
    if isinstance(live, torch.Tensor):
        mine = local(live)
        if not isinstance(saved, torch.Tensor):
            return f"{where} is not a tensor in the snapshot"
        if tuple(saved.shape) != tuple(mine.shape) or saved.dtype != mine.dtype:
            return (f"{where} is {saved.dtype} {list(saved.shape)} in the snapshot, "
                    f"{mine.dtype} {list(mine.shape)} in the model")
    return None


def _grown(saved: Any, live: Any) -> bool:
    """An empty list or dict of a fresh object (a loss history of tensors, a second optimizer's state before its
    first step) that the snapshot's holds entries in: its object's own, to load; refused, every resume of a loop
    keeping `losses.append(loss.detach())` in `extra` went back to step 0 (a review)."""
    return (isinstance(live, dict) and isinstance(saved, dict) or isinstance(live, list | tuple)
            and isinstance(saved, list | tuple)) and not live


def into_live(saved: Any, live: Any) -> Any:
    """The snapshot's tree made loadable into the live state: a shard goes back into its DTensor's layout."""
    if isinstance(live, dict):
        return {k: into_live(saved[k], v) for k, v in live.items()}
    if isinstance(live, list | tuple):
        return type(live)(into_live(s, v) for s, v in zip(saved, live, strict=True))
    if isinstance(live, DTensor):
        shard = saved.to(live.to_local().device)
        return DTensor.from_local(shard, live.device_mesh, live.placements, run_check=False,
                                  shape=live.shape, stride=live.stride())
    return saved


def _few(keys: list[Any]) -> str:
    shown = ", ".join(repr(k) for k in keys[:3])
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _len(x: Any) -> str:
    return f"{len(x)} entries" if isinstance(x, list | tuple) else f"a {type(x).__name__}"
