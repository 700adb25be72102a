"""The server's hang decision (core/hangs.py, core/progress_rules.py): only with every running member's fresh
report; a rank waiting on a culprit fails the round with the culprit as its root cause; computing ranks are left
alone but for the hard cap; a report speaks only for its sender's own ranks of the running round."""
from __future__ import annotations

import pytest

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JobState, JoinRequest, RankSeen, RankState, StallReport
from rdzv_server.core.events import EventKind
from rdzv_server.core.hangs import StallBoard, decide
from rdzv_server.core.rendezvous import Rendezvous, RendezvousError

CFG = JobConfig(min_nodes=2, max_nodes=2, max_restarts=3, last_call_s=0.0, lease_timeout_s=5.0)


def seen(rank: int, state: RankState, stalled_s: float = 6.0, where: str = "") -> RankSeen:
    return RankSeen(rank=rank, local_rank=rank % 2, state=state, stalled_s=stalled_s, where=where)


def report(node: str, *ranks: RankSeen, round_id: int = 1, credential: str = "") -> StallReport:
    return StallReport(v=1, node_id=node, credential=credential or f"secret-{node}", round_id=round_id,
                       threshold_s=5.0, ranks=list(ranks))


def board(**reports: tuple[RankSeen, ...]) -> StallBoard:
    b = StallBoard(1)
    for node, ranks in reports.items():
        b.reports[node] = (100.0, report(node, *ranks))
    return b


W, Q, S, P, X, K = (RankState.WAITING, RankState.QUIET, RankState.STOPPED, RankState.SPINNING, RankState.EXITED,
                    RankState.WORKING)


def test_nothing_is_decided_until_every_running_member_reported() -> None:
    b = board(a=(seen(0, W), seen(1, W)))
    assert decide(b, ["a", "b"], {}, 600.0, 101.0) is None
    b.reports["b"] = (100.5, report("b", seen(2, W), seen(3, Q, where="train.py:16 in <module>")))
    hang = decide(b, ["a", "b"], {}, 600.0, 101.0)
    assert hang is not None and (hang.node_id, hang.culprit.rank, hang.capped) == ("b", 3, False)
    assert hang.message == "rank 3 sat idle for 6.0s at train.py:16 in <module> while ranks 0-2 waited for it"
    assert decide(b, ["a", "b"], {}, 600.0, 100.0 + 10.1) is None       # the reports went stale


def test_reports_of_different_moments_decide_nothing_until_they_meet() -> None:
    b = board(b=(seen(2, P), seen(3, K)))                       # node b at 100 s: its ranks in an eval loop
    b.reports["a"] = (105.0, report("a", seen(0, K), seen(1, W)))   # node a 5 s later: rank 1 waits
    assert decide(b, ["a", "b"], {}, 600.0, 105.0) is None
    b.reports["b"] = (105.5, report("b", seen(2, W), seen(3, W)))   # b again: its eval is over, it waits too
    assert decide(b, ["a", "b"], {}, 600.0, 105.5) is None
    b.reports["b"] = (105.5, report("b", seen(2, P), seen(3, W)))   # ... or rank 2 still spins: a hang
    assert decide(b, ["a", "b"], {}, 600.0, 105.5) is not None


@pytest.mark.parametrize(("states", "culprit"), [
    ((Q, S), 3),          # stopped before idle
    ((X, Q), 2),          # gone before idle
    ((P, Q), 2),          # spinning before idle
])
def test_the_likelier_culprit_is_named(states, culprit) -> None:
    b = board(a=(seen(0, W), seen(1, W)), b=(seen(2, states[0]), seen(3, states[1])))
    hang = decide(b, ["a", "b"], {}, 600.0, 101.0)
    assert hang is not None and hang.culprit.rank == culprit


def test_computing_ranks_are_left_alone_but_for_the_hard_cap() -> None:
    b = board(a=(seen(0, W, 599.0), seen(1, W, 599.0)), b=(seen(2, K, 599.0), seen(3, K, 599.0)))
    assert decide(b, ["a", "b"], {}, 600.0, 101.0) is None
    b = board(a=(seen(0, W, 600.0), seen(1, W, 600.0)), b=(seen(2, K, 600.0), seen(3, K, 600.0)))
    hang = decide(b, ["a", "b"], {}, 600.0, 101.0)
    assert hang is not None and hang.capped and hang.culprit.rank == 2
    assert hang.message.startswith("ranks 0-1 waited on the others for 600s (hang timeout); rank 2 was working")
    assert decide(b, ["a", "b"], {}, 0.0, 101.0) is None                # 0: no cap
    everyone_computing = board(a=(seen(0, K), seen(1, K)), b=(seen(2, Q), seen(3, K)))
    assert decide(everyone_computing, ["a", "b"], {}, 600.0, 101.0) is None   # nobody waits: no hang


def test_a_member_whose_workers_all_exited_0_is_the_culprit_when_the_others_wait_for_it() -> None:
    b = board(a=(seen(0, W), seen(1, W)))
    hang = decide(b, ["a"], {"b": [2, 3]}, 600.0, 101.0)
    assert hang is not None and (hang.node_id, hang.culprit.rank, hang.culprit.state) == ("b", 2, X)
    assert hang.message == "rank 2 exited with code 0 while ranks 0-1 waited for it"


def join(rz: Rendezvous, node: str, config: JobConfig = CFG) -> None:
    rz.join("j", JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=2, master_port=1000,
                             config=config, instance=node), 1.0, f"secret-{node}")


@pytest.fixture
def running() -> Rendezvous:
    rz = Rendezvous()
    join(rz, "a")
    join(rz, "b")
    assert rz.jobs["j"].round is not None and rz.jobs["j"].round.round_id == 1
    return rz


def test_a_hang_fails_the_round_with_the_culprit_as_root_cause_and_every_ranks_stack_in_the_events(running) -> None:
    stack = "train.py:16 in <module>\ntrain.py:3 in main"
    running.report_stall("j", report("a", seen(0, W, where="torch/_tensor.py:623 in backward"), seen(1, W)), 10.0)
    assert running.jobs["j"].restart_count == 0
    quiet = RankSeen(rank=3, local_rank=1, state=Q, stalled_s=6.2, where="train.py:16 in <module>", stack=stack)
    status = running.report_stall("j", report("b", seen(2, W), quiet), 10.5)
    job = running.jobs["j"]
    assert status.accepted and job.restart_count == 1 and job.round is not None and job.round.round_id == 2
    assert job.root_cause is not None
    assert (job.root_cause.rank, job.root_cause.reason, job.root_cause.node_id) == (3, "hang", "b")
    assert job.root_cause.traceback == stack
    hang = next(e for e in job.events if e.kind == EventKind.HANG_DETECTED)
    assert hang.data["culprit"] == 3 and [r["state"] for r in hang.data["ranks"]] == ["waiting"] * 3 + ["quiet"]
    assert any(r.get("stack") == stack for r in hang.data["ranks"])
    assert job.reason.startswith("hang on b (rank 3 (local 1) on 10.0.0.1: hang: rank 3 sat idle for 6.2s")


def test_a_report_for_ranks_not_its_own_is_refused_and_changes_nothing(running) -> None:
    before = running.jobs["j"].event_seq
    with pytest.raises(RendezvousError) as refused:
        running.report_stall("j", report("a", seen(2, Q)), 10.0)     # b's rank
    assert refused.value.code == ErrorCode.BAD_REQUEST and "runs ranks 0..1 in round 1" in refused.value.message
    with pytest.raises(RendezvousError) as forged:
        running.report_stall("j", report("a", seen(0, W), credential="secret-b"), 10.0)
    assert forged.value.code == ErrorCode.FORBIDDEN
    assert running.jobs["j"].event_seq == before and running.jobs["j"].restart_count == 0


def test_a_stale_round_or_detection_off_changes_nothing() -> None:
    rz = Rendezvous()
    join(rz, "a", JobConfig(**{**{f: getattr(CFG, f) for f in CFG.__struct_fields__}, "hang_detection": False}))
    join(rz, "b", JobConfig(**{**{f: getattr(CFG, f) for f in CFG.__struct_fields__}, "hang_detection": False}))
    rz.report_stall("j", report("a", seen(0, W), seen(1, W)), 10.0)
    status = rz.report_stall("j", report("b", seen(2, W), seen(3, S)), 10.0)
    assert not status.accepted and status.reason == "hang detection is off for this job"
    stale = rz.report_stall("j", report("b", seen(2, W), seen(3, S), round_id=0), 10.0)
    assert not stale.accepted and "stale" in stale.reason
    assert rz.jobs["j"].restart_count == 0 and rz.jobs["j"].state == JobState.RUNNING
