"""A restart's anatomy on this node (pure): from the node's last step before the restart to each rank's first
step after it, split into phases (protocol/restarts.py) by the times the agent and the workers' probes noted.

Every instant belongs to one phase: until the old workers were gone, `stop`; until the new ones were spawned,
`rendezvous`; until a worker's probe started, `start`; then the phase the worker had begun last and not yet
ended (CUDA's initialisation, the process group, the restore: they may nest), else `setup` (the script's own
work) before the last of them ended and `first_step` after it. The node reports its last rank to step again:
the one the job waited for."""
from __future__ import annotations

from dataclasses import dataclass

from protocol.restarts import RestartAnatomy

TIMED = ("cuda", "group", "restore")      # phases a worker notes the beginning and end of


@dataclass(frozen=True)
class RestartStart:
    """The node's side of a restart: unix times of its last step before it, of its old workers all gone, and of
    the new round's workers spawned."""
    last_step_at: float
    stopped_at: float
    spawned_at: float


@dataclass(frozen=True)
class RankStart:
    """A worker's side: its rank, when its probe started and stepped first, and (begun, ended) per TIMED phase
    (0: not noted)."""
    rank: int
    started_at: float
    first_step_at: float
    spans: dict[str, tuple[float, float]]


def of_rank(node: RestartStart, worker: RankStart) -> RestartAnatomy | None:
    """The rank's restart phase by phase, or None (it has not stepped, or the times do not follow each other)."""
    marks = (node.last_step_at, node.stopped_at, node.spawned_at, worker.started_at, worker.first_step_at)
    if not all(marks) or any(b < a for a, b in zip(marks, marks[1:], strict=False)):
        return None
    phases = {"stop": node.stopped_at - node.last_step_at, "rendezvous": node.spawned_at - node.stopped_at,
              "start": worker.started_at - node.spawned_at}
    phases.update(_split(worker))
    return RestartAnatomy(rank=worker.rank, **{k: round(v, 4) for k, v in phases.items()})


def of_node(node: RestartStart, workers: list[RankStart]) -> RestartAnatomy | None:
    """The anatomy of the node's last rank to step again, once every rank has (None before)."""
    if not workers or not all(w.first_step_at for w in workers):
        return None
    return of_rank(node, max(workers, key=lambda w: w.first_step_at))


def _split(w: RankStart) -> dict[str, float]:
    """[started, first step] into set-up, the TIMED phases, and the first step."""
    spans = {p: (max(b, w.started_at), min(e, w.first_step_at)) for p, (b, e) in w.spans.items()
             if p in TIMED and 0 < b <= e and e > w.started_at and b < w.first_step_at}
    last_end = max((e for _, e in spans.values()), default=w.started_at)
    points = sorted({w.started_at, w.first_step_at, *(t for span in spans.values() for t in span)})
    out = dict.fromkeys(("setup", *TIMED, "first_step"), 0.0)
    for a, b in zip(points, points[1:], strict=False):
        active = [(begun, p) for p, (begun, ended) in spans.items() if begun <= a and b <= ended]
        phase = max(active)[1] if active else ("setup" if b <= last_end else "first_step")
        out[phase] += b - a
    return out
