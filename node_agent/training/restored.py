"""What a restore leaves behind: nothing of the training in the snapshot's file. A read snapshot's tensors are views
of the file's private mapping (layout.read), and a load that keeps a tensor by reference keeps the mapping, and the
mapping the file: its /dev/shm pages would stay allocated for the worker's life after the keep rule dropped it
(past the memory directory's limit), and it would never be written over. So, after a restore:
- the optimizers' state is settled (settle_optimizers): copied out of the mapping, and laid out like its
  parameters;
- the other parts go to their loads as copies where a load would keep them (owned, weights, keeps).
The model's weights are copied into the module's own by its load: they go as they are."""
from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from node_agent.training import rng, trees


def storages(tree: Any) -> set[int]:
    """Where the tree's tensors lie: in a read snapshot, each tensor is its own storage in the file's mapping."""
    return {at for _, t in trees.tensors(tree) if (at := trees.storage(t)) is not None}


def owned(tree: Any) -> Any:
    """The tree with every tensor a copy of its own, for the parts a load may keep by reference (an extra that
    keeps them, an LR scheduler, a framework's loops and callbacks, a module's extra state). What a kept tensor of
    a read snapshot costs: settle_optimizers."""
    return trees.rebuild(tree, lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf)


def keeps(state: Any, mapped: set[int]) -> bool:
    """Whether a loaded object's state still lies in the snapshot's mapping (`mapped`: storages())."""
    return any(trees.storage(t) in mapped for _, t in trees.tensors(state))


def weights(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A model's state dict as its load takes it: the weights as they are (the load copies them into the module's
    own), a module's extra state a copy (`set_extra_state` may keep what it is given)."""
    return {k: owned(v) if k.endswith("_extra_state") else v for k, v in state_dict.items()}


def settle_optimizers(optimizers: Iterable[Any], mapped: set[int]) -> None:
    """After an optimizer's load, its state tensors (in lists and dicts too):
    - in the snapshot's mapping (`mapped`: storages()) get memory of their own (a load keeps a CPU tensor by
      reference). The copy costs what the first step's copy-on-write faults would have;
    - shaped like their parameter but laid out otherwise take its layout: a snapshot holds tensors contiguous,
      and a fused optimizer updates a channels-last parameter's state as if laid out like it."""
    for optimizer in optimizers:
        states = getattr(optimizer, "state", {})
        for param, state in list(states.items()):
            if isinstance(state, dict):
                for key, value in list(state.items()):
                    state[key] = _settled(value, param, mapped)
            else:                   # a value under a key of its own, not a parameter's (a global step count)
                states[param] = _settled(state, None, mapped)


def _settled(value: Any, param: Any, mapped: set[int]) -> Any:
    if isinstance(value, list | tuple | dict):     # the container itself where nothing in it changes
        keys = list(value) if isinstance(value, dict) else list(range(len(value)))
        new = {k: _settled(value[k], param, mapped) for k in keys}
        if all(new[k] is value[k] for k in keys):
            return value
        if isinstance(value, dict):
            return type(value)(new) if type(value) in (dict, OrderedDict) else new
        items = [new[k] for k in keys]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return value
    if type(value) is torch.Tensor and isinstance(param, torch.Tensor) and not isinstance(param, DTensor) \
            and param.layout == torch.strided and value.shape == param.shape and value.stride() != param.stride():
        like = torch.empty_like(param, dtype=value.dtype, device=value.device)
        if like.stride() == param.stride():
            return like.copy_(value)
    return value.clone() if trees.storage(value) in mapped else value


def extras(objects: Mapping[str, Any], saved: Mapping[str, Any], mapped: set[int], own: bool) -> str | None:
    """Load protect's extras from a snapshot (a generator's state only where the snapshot is this rank's own), before
    the model and optimizer: None, or the line naming the extra whose load failed, every extra put back as it was
    (nothing half loaded). An extra's plain state need not fit the fresh object's, so its load may be the first to
    meet it (a review: a load that took at most 7 entries raised inside protect on every restart, and the job
    failed). A module's state is kept as it is (its tensors fit: its load does not fail, and a copy costs memory)."""
    before = {name: copy.deepcopy(rng.state_of(obj)) for name, obj in objects.items()
              if not isinstance(obj, torch.nn.Module)}
    for name, obj in objects.items():
        if own or not rng.is_generator(obj):
            try:
                rng.load_into(obj, saved[name])
                if keeps(rng.state_of(obj), mapped):     # its load kept them: again, from copies (most copy)
                    rng.load_into(obj, owned(saved[name]))
            except Exception as exc:  # noqa: BLE001  (the object's own code: any failure refuses the snapshot)
                for back, state in before.items():
                    try:
                        rng.load_into(objects[back], state)
                    except Exception:  # noqa: BLE001,S110  (put back as far as it goes; the refusal is said)
                        pass
                return f"extra {name!r} could not load it ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    return None
