"""A training step, said by the script: for loops that step no `torch.optim` optimizer (whose steps the agent's
progress probe counts by itself). No torch import; safe to call from any script, under any launcher.

    from node_agent.training.heartbeat import beat
    for batch in loader:
        train_step(batch)
        beat()

Under node-agent each call costs about a microsecond (a clock read and a write to shared memory, no system
call); elsewhere (plain python, torchrun, `--no-python` programs) it does nothing.
"""
from __future__ import annotations

import sys

from node_agent.training.probe import NAME as PROBE_MODULE  # the probe's name in a worker (no probe starts)


def beat() -> None:
    probe = sys.modules.get(PROBE_MODULE)
    if probe is not None:
        probe.beat()


def resumed(step: int) -> None:
    """The script resumes from its checkpoint of `step`: the steps after it are redone (goodput counts them)."""
    probe = sys.modules.get(PROBE_MODULE)
    if probe is not None:
        probe.resumed(step)


def restore_began() -> None:
    """A snapshot's restore begins (node_agent.training.resume): the restart's anatomy shows its time."""
    probe = sys.modules.get(PROBE_MODULE)
    if probe is not None:
        probe.mark("restore_begun")


def restored() -> None:
    """The restored state is loaded: the worker's first step comes next."""
    probe = sys.modules.get(PROBE_MODULE)
    if probe is not None:
        probe.mark("restore_done")


def digest(step: int, value: int, group: int = 0) -> None:
    """A snapshot of `step` was taken: `value` digests the tensors the replicas of `group` hold alike (protect's;
    group 0: every rank, as under DDP)."""
    probe = sys.modules.get(PROBE_MODULE)
    if probe is not None:
        probe.digest(step, value, group)


def held(step: int) -> None:
    """The worker waits after its snapshot of `step`, as the agent asked (snapshot.hold_after)."""
    probe = sys.modules.get(PROBE_MODULE)
    if probe is not None:
        probe.held(step)
