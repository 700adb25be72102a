"""Jobs with training progress, built through the real core: nodes join, then poll and report with the progress
notes their agents send (protocol.notes.ProgressNote), so JobProgress is filled by core/goodput.py itself.
Shared by the tests of the views, the page, the picture and rdzv-ctl. Times are plain floats from T."""
from __future__ import annotations

from protocol.messages import (
    FailureReport,
    JobConfig,
    JoinRequest,
    PollRequest,
    StallReport,
    SuccessReport,
    WorkerFailure,
)
from protocol.notes import ProgressNote
from protocol.restarts import RestartAnatomy
from protocol.stalls import RankSeen, RankState
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival

T = 1_700_000_000.0
CFG = JobConfig(min_nodes=2, max_nodes=2, max_restarts=5, last_call_s=0.0, lease_timeout_s=10_000.0)
RATE = 2.0                 # steps per second every node reports (window_steps / window_s)


def join(rz: Rendezvous, job: str, node: str, now: float, config: JobConfig = CFG, *, copy_port: int = 0,
         domain: str = "") -> None:
    rz.handle(job, JoinRequest(v=1, node_id=node, addr="10.0.0.1", host=f"host-{node}", local_world_size=2,
                             master_port=29500, config=config, instance=f"{node}#1", copy_port=copy_port,
                             copy_verifiers=True,
                             domain=domain), now,
                                 Arrival(secret=f"secret-{node}"))


def note(round_id: int, steps: int, first: float, last: float, *, demand: float = 0.5,
         resumed: int = -1, anatomy: RestartAnatomy | None = None) -> ProgressNote:
    return ProgressNote(round_id=round_id, probes=2, steps=steps, first_step_at=first, last_step_at=last, step_s=0.5,
                        window_s=10.0, window_steps=int(10 * RATE), demand=demand, resumed_step=resumed,
                        anatomy=anatomy)


# Where node b's restart took its 31 s (the job's: b stepped again last).
ANATOMY = RestartAnatomy(rank=3, stop=0.5, rendezvous=20.0, start=0.5, setup=5.0, group=2.0, restore=1.5,
                         first_step=1.5)


def poll(rz: Rendezvous, job: str, node: str, now: float, progress: ProgressNote | None) -> None:
    round_id = rz.jobs[job].round.round_id if rz.jobs[job].round else -1
    rz.handle(job, PollRequest(v=1, node_id=node, credential=f"secret-{node}", known_round=round_id, wait_s=0.0,
                             progress=progress), now)


def step(rz: Rendezvous, job: str, nodes: list[str], first: float, last: float, steps: int, now: float,
         **kw: float) -> None:
    """Every node says the running round stepped `steps` times, from `first` to `last`."""
    round_id = rz.jobs[job].round.round_id
    for n in nodes:
        poll(rz, job, n, now, note(round_id, steps, first, last, **kw))    # type: ignore[arg-type]


def crash(rz: Rendezvous, job: str, node: str, now: float) -> None:
    round_id = rz.jobs[job].round.round_id
    failure = WorkerFailure(local_rank=0, rank=0, exitcode=1, message="boom", timestamp=now)
    rz.handle(job, FailureReport(v=1, node_id=node, credential=f"secret-{node}", round_id=round_id,
                                         failures=[failure]), now)


def stepping(rz: Rendezvous, job: str = "train") -> None:
    """A two-node job that stepped 180 times (T+10 to T+100), crashed at T+101 and stepped again from T+131 to
    T+140 after resuming from step 150: one restart that cost 31 s and redid 30 steps."""
    join(rz, job, "a", T)
    join(rz, job, "b", T)
    step(rz, job, ["a", "b"], T + 10, T + 100, 180, T + 100)
    crash(rz, job, "b", T + 101)
    step(rz, job, ["a", "b"], T + 131, T + 140, 20, T + 140, resumed=150)
    poll(rz, job, "b", T + 140, note(rz.jobs[job].round.round_id, 20, T + 131, T + 140, resumed=150, anatomy=ANATOMY))


def restarting(rz: Rendezvous, job: str = "again") -> None:
    """A two-node job that stepped from T+10 to T+50, then crashed at T+60: the restart is under way."""
    join(rz, job, "a", T)
    join(rz, job, "b", T)
    step(rz, job, ["a", "b"], T + 10, T + 50, 80, T + 50)
    crash(rz, job, "a", T + 60)


def succeeded(rz: Rendezvous, job: str = "done") -> None:
    """A two-node job that stepped 40 times (T+1 to T+20) and succeeded at T+21."""
    join(rz, job, "a", T)
    join(rz, job, "b", T)
    for node in ("a", "b"):
        rz.handle(job, SuccessReport(v=1, node_id=node, credential=f"secret-{node}", round_id=1,
                                     progress=note(1, 40, T + 1, T + 20)), T + 21)


def silent(rz: Rendezvous, job: str = "quiet") -> None:
    """A running two-node job whose workers never reported a step."""
    join(rz, job, "a", T)
    join(rz, job, "b", T)
    poll(rz, job, "a", T + 30, None)


def slow(rz: Rendezvous, job: str = "lagging") -> None:
    """A running two-node job whose node b the other waits on: named slow after enough steps."""
    join(rz, job, "a", T)
    join(rz, job, "b", T)
    round_id = rz.jobs[job].round.round_id
    for i in range(1, 9):
        at = T + 10 * i
        poll(rz, job, "a", at, note(round_id, 20 * i, T + 5, at, demand=0.33))
        poll(rz, job, "b", at, note(round_id, 20 * i, T + 5, at, demand=0.98))
    assert rz.jobs[job].progress.slow == ["b"]



def alone(rz: Rendezvous, job: str = "evaluating") -> None:
    """A running two-node job that stepped until T+50; at T+62 rank 0 has been at work alone for 12 s (an
    evaluation) while ranks 1-3 wait in all_reduce: shown, not a hang."""
    join(rz, job, "a", T)
    join(rz, job, "b", T)
    step(rz, job, ["a", "b"], T + 10, T + 50, 80, T + 50)
    round_id = rz.jobs[job].round.round_id

    def rank(r: int, state: RankState, where: str = "") -> RankSeen:
        return RankSeen(rank=r, local_rank=r % 2, state=state, stalled_s=12.0, where=where, steps=80,
                        call="all_reduce" if state == RankState.WAITING else "")
    for node, ranks in (("a", (rank(0, RankState.WORKING, "train.py:41 in evaluate"), rank(1, RankState.WAITING))),
                        ("b", (rank(2, RankState.WAITING), rank(3, RankState.WAITING)))):
        rz.handle(job, StallReport(v=1, node_id=node, credential=f"secret-{node}", round_id=round_id,
                                         threshold_s=5.0, ranks=list(ranks)), T + 62)
