"""In-memory snapshots in one call, for a training loop of your own:

    from node_agent.training import protect
    start = protect(model, optimizer, every=5)      # optimizer steps already done: 0, or the snapshot's
    for step in range(start, total_steps): ...

The rules:
- On the call, every rank restores the newest snapshot that all ranks hold and accept (this rank's memory
  directory, where the agent also puts a lost node's copy fetched from its peer): model, optimizer, `extra`
  objects (an LR scheduler, a grad scaler) and the RNG states. A file that fails its checksum or does not match
  the model's keys and shapes is refused with one line, and every rank goes to the next older one. With none, it
  returns `fallback()` (your own checkpoint's step count) or 0. Nothing is half loaded.
- Then, every `every` optimizer steps (counted by the optimizer's step hook, so gradient accumulation counts as the
  optimizer does; a step a GradScaler in `extra` skips counts too: the loop made it), a snapshot is taken as the
  next step begins (its training forward, not an evaluation's), so it holds what the loop did after
  `optimizer.step()` (an LR scheduler's step), with the RNG states (and the `extra` generators) as that
  optimizer step left them: a loop draws its next batch before its next forward, and a resumed run draws it again
  from there (`_Hooks`). The training waits only for the copy of the state into host memory
  (node_agent/training/capture.py).
- A second call (a script's next phase) ends the first's snapshots and resumes from its own only (_LIVE).
- Outside node-agent (no memory directory: torchrun, plain python) it takes none, says so once, and returns
  `fallback()` or 0; the script runs unchanged.
- DDP models are snapshotted as their inner module (a compiled DDP as the compiled wrapper, whose DDP is still
  known: replicas, lending, buckets), FSDP2 (`fully_shard`) ones as each rank's shards; accelerate's
  prepared optimizer as the one it wraps (a loop on `Accelerator` uses this call too). A model,
  optimizer or state that cannot be snapshotted is a TypeError at the call, before any training step."""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from node_agent.training import ddp_buckets, heartbeat, restored, resume, rng, snapshot, trees, upload
from node_agent.training.capture import Capture, check_cadence, say


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state_dict: Any) -> Any: ...


Extra = Stateful | torch.Generator | Any     # what `extra` may hold: a Stateful or a generator (rng.is_generator)


def protect(model: nn.Module, optimizer: torch.optim.Optimizer, every: int = 5, *,
            extra: Mapping[str, Extra] | None = None, fallback: Callable[[], int] | None = None,
            keep: int = 2) -> int:
    """Restore the newest snapshot every rank holds and snapshot every `every` optimizer steps from now on.
    Returns the number of optimizer steps already done (the loop's first step)."""
    replicated, group = _replicated(model)
    ddp = _ddp_of(model)        # every rank a replica: one may lend
    model, optimizer = _inner(model), _inner_optimizer(optimizer)
    objects = dict(extra or {})
    _check(model, optimizer, every, objects, keep)
    fit = _next_call()       # a script's second protect (a second phase) resumes from its own snapshots only
    where = resume.memory_directory()
    everywhere = resume.everywhere(where)       # every rank takes part in the agreement, one without memory too
    if where is None:
        return fallback() if fallback is not None else 0
    _end_earlier()
    base = _NUMBERED[0]
    step = restore(model, optimizer, objects, where, ddp, fit) if everywhere else None
    start = step - base if step is not None else (fallback() if fallback is not None else 0)
    if step is None:
        heartbeat.resumed(base + start)      # from disk or the start: the server counts (and says) the steps redone
    hooks = _Hooks(model, optimizer, objects, every, Capture(where, keep, replicated, group), base + start, ddp, fit)
    hooks.register()
    _LIVE.append(hooks)
    return start


# The hooks of this process's last protect call. A next call (the script's next phase, a new optimizer) ends them
# first: their phase is over, its due snapshot is taken then, and written before the call's restore looks (which
# removes unfinished files); left on, they took it at the next phase's first forward, with that phase's restored
# weights in it, and two captures wrote the same step files.
_LIVE: list[_Hooks] = []
_CALLS = [0]        # protect calls this process made: each resumes from its own snapshots only (resume.other_fit)
# The steps the ended calls numbered: a next call's snapshots are numbered after them (it returns its own count), so
# a step's number is never taken twice by one process (the server compares the replicas' digests of each step: a
# second phase numbered from 0 again was judged diverged from the first's snapshot of that step, a restart counted).
_NUMBERED = [0]


def _end_earlier() -> None:
    while _LIVE:
        _LIVE.pop().end()


def _next_call() -> int:
    _CALLS[0] += 1
    return _CALLS[0] - 1


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, objects: Mapping[str, Extra],
            where: str, ddp: DistributedDataParallel | None = None, fit: int | None = None) -> int | None:
    """The step restored from the memory directory (all ranks agree on it), or None (nothing was loaded).
    `fit`: the script's protect call this is (_next_call); only its own snapshots are taken (None: any).
    `ddp`: the model's DDP, so every rank is a replica: a rank without the step is lent a replica's snapshot (it
    loads the model, optimizer and extras, but keeps its own RNG states and generators: the lender's would make
    it draw the lender's batches), and the DDP reduces in the snapshot's bucket layout (ddp_buckets)."""
    ring = upload.Ring(upload.on_gpus(model) >= upload.SMALL)    # allocated while the snapshot is read
    try:
        while True:     # an extra's load that fails refuses the step on every rank (restored.extras), as a mismatch
            found = resume.agree(where, lambda tree: (None if fit is None else resume.other_fit(tree, fit, "protect "
                                 "call")) or _fits(tree.get("state"), model, optimizer, objects,
                                                   tree.get("param_shapes")), ddp is not None)
            if found is None:
                return None
            step, tree, lender = found
            saved, own, mapped = tree["state"], lender == resume.rank(), restored.storages(tree)
            problem = restored.extras(objects, saved["extra"], mapped, own)
            if resume.reduce_min(0 if problem else 1) == 1:
                break
            say(f"step-{step} in {where} refused: {problem or 'an extra on another rank could not load it'}")
            snapshot.forget_after(step - 1, where)
        live = model.state_dict()
        model.load_state_dict(trees.into_live(upload.weights_onto(restored.weights(saved["model"]), live, ring),
                                              live))
        upload.freed()
        optimizer.load_state_dict(_optimizer_into_live(upload.optimizer_state_onto(saved["optim"], optimizer, ring),
                                                       optimizer))
    finally:
        ring.close()
    restored.settle_optimizers([optimizer], mapped)
    if own:
        rng.restore(tree.get("rng", {}))
    else:
        resume.lent(step, lender, "a replica's model, optimizer and extras; its RNG states and generators start as "
                                  "the script left them")
    if ddp is not None:
        ddp_buckets.adopt(ddp, tree.get("ddp_buckets"))
    resume.resumed(step)
    return step


class _Hooks:
    """A snapshot is due when the optimizer has stepped a multiple of `every` times, and is taken when the next step
    begins: at the model's next training forward (grad enabled; or, for a model never called so, the next optimizer
    step), not an evaluation's under no_grad, so that what the
    loop does after `optimizer.step()` (an LR scheduler's step) is in it, and the RNG states are those the next
    step starts from. The weights and optimizer state are the same as right after the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, objects: Mapping[str, Extra],
                 every: int, capture: Capture, start: int, ddp: DistributedDataParallel | None = None,
                 fit: int = 0) -> None:
        self.model, self.optimizer, self.objects, self.ddp, self.fit = model, optimizer, objects, ddp, fit
        self.every, self.capture, self.steps = every, capture, start
        self.due: int | None = None
        self.prepared = self.ended = False      # Capture.prepare called; a later protect call took over (end)
        self.unplain = self.checked = False     # said: the state holds an object a snapshot cannot; checked whole
        self.handles: list[Any] = []
        self.drawn: dict[str, Any] = {}     # what the next step draws from, as the optimizer step left it

    def register(self) -> None:
        # First of the forward's hooks: FSDP2's unshards the parameters for the forward, and a state_dict taken
        # after it puts the sharded ones back under the forward's feet.
        self.handles = [self.model.register_forward_pre_hook(lambda *_: self._at_forward(), prepend=True),
                        self.optimizer.register_step_pre_hook(lambda *_: self._before_step()),
                        self.optimizer.register_step_post_hook(lambda *_: self._stepped())]
        for obj in self.objects.values():
            if isinstance(obj, torch.amp.GradScaler):
                self._count_skips(obj)

    def _count_skips(self, scaler: torch.amp.GradScaler) -> None:
        """A step the scaler skips (an inf in the gradients: no optimizer.step) is counted as a step all the same: the
        loop made it and draws the next batch after it, so the count stays the loop's and a resumed loop starts on
        the batch it was at (a review: an fp16 loop whose scaler skipped its first 2 steps resumed 2 batches early,
        and trained other weights). A fused optimizer's step runs even then, and is counted once."""
        setattr(scaler, "step", _Counted(self, scaler, scaler.step))  # noqa: B010  (mypy: a method is not assigned to)

    def end(self) -> None:
        """A later protect call ends these hooks (_LIVE): the due snapshot is taken now and written."""
        self._take_due()
        for handle in self.handles:
            handle.remove()
        self.ended = True
        _NUMBERED[0] = max(_NUMBERED[0], self.steps)
        self.capture.wait()

    def _stepped(self, skipped: bool = False) -> None:
        if self.ended:      # (a GradScaler's wrapper outlives the hooks)
            return
        self.steps += 1
        if self.steps % self.every == 0:
            self.due = self.steps
            self.drawn = {"rng": rng.capture(), "generators": {
                name: rng.state_of(obj) for name, obj in self.objects.items() if rng.is_generator(obj)}}
        elif not self.prepared and not skipped:   # the optimizer's state exists now: the first snapshot's buffers
            self.prepared = True
            self.capture.prepare(training_state(self.model, self.optimizer, self.objects), [self.optimizer])

    def _at_forward(self) -> None:
        # An evaluation's forward (under no_grad or inference_mode) is not the next step beginning: the loop may
        # step its scheduler after it (`scheduler.step(val_loss)`), and a snapshot taken there would miss that step.
        # Eval mode alone is no sign: fine-tuning with frozen batch norm trains in it, and its next forward must
        # take the snapshot before the batch after it is drawn.
        if torch.is_grad_enabled():
            self._take_due()

    def _before_step(self) -> None:
        self._take_due()
        self.capture.before_update()

    def _take_due(self) -> None:
        if self.due is not None:
            step, self.due = self.due, None
            state = training_state(self.model, self.optimizer, self.objects)
            state["extra"].update(self.drawn["generators"])
            # an object gained since the call: written, it is refused as unreadable (trees.changeable: where)
            if (odd := trees.unplain(trees.changeable(state, whole=not self.checked), "the state's ")) is not None:
                if not self.unplain:
                    say(f"no snapshot of step {step} (nor later, while it holds it): {odd}")
                self.unplain = True
                return
            self.checked = True
            buckets = ddp_buckets.recorded(self.ddp) if self.ddp is not None else None
            self.capture.take(step, {"state": state, "rng": self.drawn["rng"], "ddp_buckets": buckets,
                                     "param_shapes": param_shapes(self.optimizer), resume.FIT: self.fit},
                              [self.optimizer])


class _Counted:
    """A GradScaler's step that counts one it skips (_count_skips). Pickled or copied, the scaler's own step: a
    closure failed the pickle ('Can't pickle local object'), and a deepcopy's stepped the original scaler."""

    def __init__(self, hooks: _Hooks, scaler: Any, step: Callable[..., Any]) -> None:
        self.hooks, self.scaler, self.step = hooks, scaler, step

    def __call__(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        before = self.hooks.steps
        out = self.step(optimizer, *args, **kwargs)
        if self.hooks.steps == before and _inner_optimizer(optimizer) is self.hooks.optimizer:
            self.hooks._stepped(skipped=True)
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return getattr, (self.scaler, "step")


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, objects: Mapping[str, Extra]) -> Any:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(),
            "extra": {name: state_of(obj) for name, obj in objects.items()}}


state_of, load_into = rng.state_of, rng.load_into     # an extra's state: its state_dict, or a generator's


def _fits(saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
          objects: Mapping[str, Extra], param_shapes: Any = None) -> str | None:
    if not isinstance(saved, dict) or set(saved) != {"model", "optim", "extra"}:
        return "its state is not a model, an optimizer and extras"
    return (trees.mismatch(saved["model"], model.state_dict(), "model")
               or _optimizer_mismatch(saved["optim"], optimizer, param_shapes)
               or trees.mismatch(saved["extra"], {k: state_of(v) for k, v in objects.items()}, "extra", 1))


def param_shapes(optimizer: torch.optim.Optimizer) -> list[tuple[int, ...]]:
    """The (local) shape of each of the optimizer's parameters, in order: a snapshot holds them (`param_shapes`)."""
    return [tuple(trees.local(p).shape) for g in optimizer.param_groups for p in g["params"]]


def _optimizer_mismatch(saved: Any, optimizer: torch.optim.Optimizer, shapes: Any = None) -> str | None:
    """The optimizer's groups and parameters must be those of the snapshot: their shapes the snapshot's
    `param_shapes`, and then a state tensor with its parameter's rank may be factored (each size its parameter's
    or 1: Adafactor's second moment). A snapshot without them (an older release's) holds every such state tensor
    to its parameter's shape. (The optimizer's own state is empty before its first step, so the snapshot is
    checked against the parameters.)"""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), dict):
        return "optim is not an optimizer's state_dict in the snapshot"
    groups = saved["param_groups"]
    sizes = [len(g.get("params", ())) for g in groups]
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != live_sizes:
        return f"optim has {sizes} parameters per group in the snapshot, {live_sizes} in the optimizer"
    live_shapes = param_shapes(optimizer)
    factored = isinstance(shapes, list | tuple) and [tuple(s) if isinstance(s, list | tuple) else s
                                                     for s in shapes] == live_shapes
    if shapes is not None and not factored:
        return f"optim's parameters are {_few_shapes(shapes)} in the snapshot, {_few_shapes(live_shapes)} here"
    params = dict(zip((i for g in groups for i in g["params"]),
                      (p for g in optimizer.param_groups for p in g["params"]), strict=True))
    for index, entry in saved["state"].items():
        param = params.get(index)
        if param is None:
            return f"optim/state/{index} is for no parameter of the optimizer"
        mine = trees.local(param)
        for key, value in (entry.items() if isinstance(entry, dict) else ()):
            if isinstance(value, torch.Tensor) and value.dim() == mine.dim() and value.shape != mine.shape \
                    and not (factored and all(n in (m, 1) for n, m in zip(value.shape, mine.shape, strict=True))):
                return f"optim/state/{index}/{key} is {list(value.shape)} in the snapshot, the parameter " \
                       f"{list(mine.shape)}"
    return None


def _optimizer_into_live(saved: Any, optimizer: torch.optim.Optimizer) -> Any:
    """An FSDP2 parameter's state tensors (its shape) go back into the parameter's DTensor layout."""
    params = dict(zip((i for g in saved["param_groups"] for i in g["params"]),
                      (p for g in optimizer.param_groups for p in g["params"]), strict=True))
    return {"param_groups": saved["param_groups"],
            "state": {i: {k: _like(v, params[i]) for k, v in entry.items()} if isinstance(entry, dict) else entry
                      for i, entry in saved["state"].items()}}


def _like(value: Any, param: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and isinstance(param, DTensor) \
            and value.shape == param.to_local().shape:
        return trees.into_live(value, param)
    return value


def _replicated(model: Any) -> tuple[Callable[[str], bool] | None, int]:
    """Which tensors of the snapshot the replicas hold alike, and which ranks are this rank's replicas (a group
    number: the ranks that tell the same one). A DDP model's parameters, on every rank (its buffers may differ
    between broadcasts); an HSDP model's (`fully_shard` on a mesh with replicated dims), on the ranks with the
    same coordinates on its sharded dims. Other models: none is compared, said once (FSDP2 shards are no
    replicas; a mixture of meshes or placements is not told apart)."""
    if _ddp_of(model) is not None:
        names = {f"/state/model/{name}" for name, _ in _inner(model).named_parameters()}
        return names.__contains__, 0
    hsdp = _hsdp_replicas(model) if isinstance(model, nn.Module) else None
    if hsdp is not None:
        return hsdp
    if os.environ.get("RANK", "0") == "0" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        say("replicas are not compared: the model is neither DistributedDataParallel nor HSDP (fully_shard on a "
            "mesh with a replicated dim): only their parameters are known to be alike on their replicas")
    return None, 0


def _hsdp_replicas(model: nn.Module) -> tuple[Callable[[str], bool], int] | None:
    """HSDP: every parameter a DTensor of one mesh and placements, some of them Replicate; the group is this
    rank's coordinates on the other dims (its shard), numbered."""
    params = list(model.named_parameters())
    layouts = {(p.device_mesh, p.placements) for _, p in params if isinstance(p, DTensor)}
    if len(layouts) != 1 or not all(isinstance(p, DTensor) for _, p in params):
        return None
    mesh, placements = layouts.pop()
    sharded = [dim for dim, placement in enumerate(placements) if not placement.is_replicate()]
    coordinate = mesh.get_coordinate()
    if len(sharded) == len(placements) or coordinate is None:
        return None
    group = 0
    for dim in sharded:
        group = group * mesh.size(dim) + coordinate[dim]
    names = {f"/state/model/{name}" for name, _ in params}
    return names.__contains__, group


def _ddp_of(model: Any) -> DistributedDataParallel | None:
    """The model's DDP: itself, or the one torch.compile wrapped (`torch.compile(DDP(model))`, torch's own order)."""
    for candidate in (model, getattr(model, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def _inner(model: Any) -> Any:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _inner_optimizer(optimizer: Any) -> Any:
    """A wrapper that is an Optimizer in name only (accelerate's AcceleratedOptimizer: no step hooks of its own)
    stands for the optimizer it wraps, whose steps and state are the real ones."""
    while (isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "_optimizer_step_pre_hooks")
           and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)):
        optimizer = getattr(optimizer, "optimizer")  # noqa: B009  (mypy: not an Optimizer attribute)
    return optimizer


def _check(model: Any, optimizer: Any, every: Any, objects: dict[str, Any], keep: Any) -> None:
    """Bad input is a TypeError or ValueError here, at the call, naming the object."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"protect(model=...): a {_name(model)} is not a torch.nn.Module")
    if type(model).__name__ == "FullyShardedDataParallel":
        raise TypeError("protect(model=...): FullyShardedDataParallel (FSDP1) state dicts are not snapshotted; "
                        "shard the model with torch.distributed.fsdp.fully_shard (FSDP2)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"protect(optimizer=...): a {_name(optimizer)} is not a torch.optim.Optimizer")
    check_cadence("protect", every, keep)
    for name, obj in objects.items():
        if not rng.is_generator(obj) and not (callable(getattr(obj, "state_dict", None))
                                                         and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"protect(extra={{{name!r}: ...}}): a {_name(obj)} has no state_dict/load_state_dict "
                            f"(and is no torch.Generator, numpy Generator or RandomState, or random.Random)")
    trees.refuse_unplain(training_state(model, optimizer, objects), "protect: the state's ")


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _few_shapes(shapes: Any) -> str:
    shown = [list(s) if isinstance(s, list | tuple) else s for s in list(shapes)[:4]]
    return f"{shown}{' ...' if len(shapes) > 4 else ''} ({len(shapes)})"
