"""DDP's gradient buckets, carried across a restart, so that a resumed run sums its gradients as an uninterrupted
one does, bit for bit.

DDP reduces the gradients of the first backward after it is built in its first bucket layout (all parameters in
their order), then rebuilds its buckets in the order the gradients became ready. With more than two ranks an
all-reduce adds each element's parts in an order set by where the element lies in its bucket, so the first step of
a resumed run (a new DDP, its first layout) came out unlike the uninterrupted run's step (the rebuilt layout) in
the last bits, and so did every weight after it. The rules:
- A snapshot records the rebuilt layout (`recorded`: DDP's own logging data, from its third step on).
- The restore builds the new DDP's reducer with that layout (`adopt`), the way DDP rebuilds its reducer when it is
  unpickled, once every rank holds the same one (a collective on every rank: a rank alone in another layout would
  hang the job's first all-reduce). After the first backward DDP rebuilds into the same layout.
- Where it cannot (a comm hook, static_graph, DDP's own mixed precision, sparse gradients, a torch whose DDP has not
  these internals), it says why once and the run goes on in DDP's first layout: the same training, equal to about
  1e-9 rather than bit for bit."""
from __future__ import annotations

import hashlib
import inspect
import weakref
from typing import Any

import torch.distributed as dist

from node_agent.training import resume
from node_agent.training.capture import say

Buckets = list[list[int]]
_INTERNALS = ("_ddp_init_helper", "_build_params_for_reducer", "_build_debug_param_to_name_mapping",
              "_get_ddp_logging_data")
_ASSIGNMENT = "_compute_bucket_assignment_by_size"     # what _ddp_init_helper asks for its buckets
_HELPER_ARGS = ["parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"]


def recorded(ddp: Any) -> Buckets | None:     # ddp: a DistributedDataParallel (its internals are untyped)
    """The bucket layout DDP rebuilt after its first backward (parameter indices, the first-reduced bucket
    first), or the one it was built in by `adopt` (DDP logs its rebuilt layout from its third step on: a resumed
    run's next snapshots hold the layout too), or None: not logged yet, never rebuilt (find_unused_parameters), or
    a torch that does not tell."""
    try:
        text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
        if isinstance(text, str):
            return [[int(i) for i in bucket.split()] for bucket in text.split(",")]
    except (AttributeError, RuntimeError, ValueError):
        pass
    return _adopted.get(ddp)


_adopted: weakref.WeakKeyDictionary[Any, Buckets] = weakref.WeakKeyDictionary()   # a DDP -> the layout adopted


def adopt(ddp: Any, buckets: Any) -> bool:
    """Every rank calls it after a restore: rebuild the reducer in `buckets` (the snapshot's layout) where every
    rank can and holds the same one. True where it did. Rank 0 says why not where any rank held one."""
    problem = None if buckets is None else _why_not(ddp, buckets)
    mine = _digest(buckets) if buckets is not None and problem is None else 0
    low, high = resume.reduce_min(mine), -resume.reduce_min(-mine)
    if low == high != 0:
        _rebuild(ddp, buckets)
        _adopted[ddp] = buckets
        return True
    if resume.rank() == 0 and (buckets is not None or high != 0):
        why = problem or ("rank 0's snapshot holds none" if buckets is None
                          else "the ranks' snapshots hold different layouts" if low != 0
                          else "another rank's snapshot holds none, or its DDP cannot take it")
        say(f"the resumed DDP reduces its first step in its own bucket layout ({why}): the gradients equal an "
            "uninterrupted run's to about 1e-9, not bit for bit")
    return False


def _why_not(ddp: Any, buckets: Any) -> str | None:
    if not all(hasattr(ddp, name) for name in _INTERNALS) or not hasattr(dist, _ASSIGNMENT) \
            or list(inspect.signature(ddp._ddp_init_helper).parameters) != _HELPER_ARGS:
        return f"this torch's DistributedDataParallel has no _ddp_init_helper({', '.join(_HELPER_ARGS)})"
    hook = ddp._get_ddp_logging_data().get("comm_hook")
    if hook:
        return f"a comm hook is registered: {hook}"
    if getattr(ddp, "static_graph", False):
        return "static_graph=True"
    if getattr(ddp, "mixed_precision", None) is not None or getattr(ddp, "_use_python_reducer", False):
        return "DDP's own mixed_precision"
    params, sparse = ddp._build_params_for_reducer()
    if any(sparse):
        return "a parameter with sparse gradients"
    flat = [i for bucket in buckets for i in bucket] if _is_layout(buckets) else None
    if flat is None or sorted(flat) != list(range(len(params))) or not all(buckets):
        return f"the snapshot's layout is not one of this model's {len(params)} parameters"
    return None


def _is_layout(buckets: Any) -> bool:
    return isinstance(buckets, list) and all(
        isinstance(b, list) and all(type(i) is int for i in b) for b in buckets)


def _digest(buckets: Buckets) -> int:
    """A positive number that names the layout (a collective compares it, as an int64)."""
    return 1 + int.from_bytes(hashlib.blake2b(repr(buckets).encode(), digest_size=7).digest(), "little")


def _rebuild(ddp: Any, buckets: Buckets) -> None:
    """As DDP's __setstate__ builds its reducer, with the bucket assignment replaced by `buckets`. The old reducer
    goes first: its buckets hold a copy of every gradient (on a GPU, the model's size again)."""
    params, sparse = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(params)
    computed = getattr(dist, _ASSIGNMENT)

    def assignment(*_: Any, **__: Any) -> tuple[Buckets, list[int]]:
        # DDP reverses the list it is given (its buckets reduce last-defined first)
        return list(reversed(buckets)), [ddp.bucket_bytes_cap] * len(buckets)

    ddp.reducer = ddp.logger = None
    setattr(dist, _ASSIGNMENT, assignment)
    try:
        ddp._ddp_init_helper(params, sparse, names, ddp.static_graph)
    finally:
        setattr(dist, _ASSIGNMENT, computed)
