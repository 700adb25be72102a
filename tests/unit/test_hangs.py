"""The server's hang rules (core/hangs.py, core/progress_rules.py): only with every running member's fresh report
of one moment; a rank stopped or gone while the others wait, and a deadlock (every rank waiting, nothing moving),
are decided at once with the culprit named; a rank apart while the others wait is shown and decided only after
the job's alone limit, never twice at one place; ranks waiting while data moves only after the hard cap; a report
speaks only for its sender's own ranks of the running round."""
from __future__ import annotations

import msgspec
import pytest

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JobState, JoinRequest, StallReport
from protocol.stalls import RankSeen, RankState
from rdzv_server.core.events import EventKind
from rdzv_server.core.hangs import StallBoard, StallKind, assess, place_of, same_place
from rdzv_server.core.progress_rules import shown_stall
from rdzv_server.core.rendezvous import Rendezvous, RendezvousError
from rdzv_server.core.requests import Arrival

CFG = JobConfig(min_nodes=2, max_nodes=2, max_restarts=3, last_call_s=0.0, lease_timeout_s=5.0)
W, Q, S, P, X, K, U = (RankState.WAITING, RankState.QUIET, RankState.STOPPED, RankState.SPINNING, RankState.EXITED,
                       RankState.WORKING, RankState.UNKNOWN)
MAIN = "train.py:90 in <module>\ntrain.py:60 in main"        # outermost last, as a report's stack is written
EVAL = "metrics.py:12 in ngrams\ntrain.py:41 in evaluate\ntrain.py:55 in main\ntrain.py:90 in <module>"
RECV = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:2799 in recv\ntrain.py:40 in main"
ALL_REDUCE = "torch/distributed/distributed_c10d.py:2900 in all_reduce\ntrain.py:57 in main\ntrain.py:90 in <module>"


def seen(rank: int, state: RankState, stalled_s: float = 6.0, where: str = "", *, call: str = "",
         stack: str = "", io_bytes: int = 0, gpu_busy: int = -1, process_cpu: float = 0.0) -> RankSeen:
    if state == W and not call:
        call = "all_reduce"
    return RankSeen(rank=rank, local_rank=rank % 2, state=state, stalled_s=stalled_s, where=where, call=call,
                    stack=stack, io_bytes=io_bytes, gpu_busy=gpu_busy, process_cpu=process_cpu)


def report(node: str, *ranks: RankSeen, round_id: int = 1, credential: str = "") -> StallReport:
    return StallReport(v=1, node_id=node, credential=credential or f"secret-{node}", round_id=round_id,
                       threshold_s=5.0, ranks=list(ranks))


def board(**reports: tuple[RankSeen, ...]) -> StallBoard:
    b = StallBoard(1)
    for node, ranks in reports.items():
        b.reports[node] = (100.0, report(node, *ranks))
    return b


def limits(alone: float = 1800.0, cap: float = 600.0) -> JobConfig:
    return msgspec.structs.replace(CFG, hang_alone_timeout_s=alone, hang_timeout_s=cap)


def test_nothing_is_assessed_until_every_running_member_reported() -> None:
    b = board(a=(seen(0, W), seen(1, W)))
    assert assess(b, ["a", "b"], {}, CFG, (), 101.0) is None
    b.reports["b"] = (100.5, report("b", seen(2, W), seen(3, S, where="train.py:16 in <module>")))
    stall = assess(b, ["a", "b"], {}, CFG, (), 101.0)
    assert stall is not None and stall.decided and (stall.node_id, stall.culprit.rank) == ("b", 3)
    assert stall.kind is StallKind.CULPRIT and not stall.capped
    assert stall.message == "rank 3 was stopped at train.py:16 in <module> while ranks 0-2 waited for it in all_reduce"
    assert assess(b, ["a", "b"], {}, CFG, (), 100.0 + 20.1) is None       # the reports went stale (4 x 5 s)


def test_reports_of_different_moments_assess_nothing_until_they_meet() -> None:
    b = board(b=(seen(2, K), seen(3, K)))                           # node b at 100 s: its ranks in an eval loop
    b.reports["a"] = (105.0, report("a", seen(0, K), seen(1, W)))   # node a 5 s later: rank 1 waits
    assert assess(b, ["a", "b"], {}, CFG, (), 105.0) is None
    b.reports["b"] = (105.5, report("b", seen(2, S), seen(3, W)))   # b again, rank 2 now stopped: together
    stall = assess(b, ["a", "b"], {}, CFG, (), 105.5)
    assert stall is not None and stall.decided and stall.culprit.rank == 2


def test_a_report_examined_before_the_ranks_stepped_again_tells_of_nothing() -> None:
    """Node a's report was examined as rank 0's evaluation ended; it arrives after the notes of the steps that
    followed: the stall it tells of is over, so nothing is shown (or decided) from it."""
    b = board(a=(seen(0, Q, 60.0), seen(1, W, 60.0)), b=(seen(2, W, 60.0), seen(3, W, 60.0)))
    for _, report in b.reports.values():
        report.ranks[:] = [msgspec.structs.replace(r, steps=20) for r in report.ranks]
    assert assess(b, ["a", "b"], {}, CFG, (), 101.0, steps=21) is not None     # a step behind: still the stall
    assert assess(b, ["a", "b"], {}, CFG, (), 101.0, steps=40) is None         # 20 steps since: over


def test_stopped_comes_before_gone() -> None:
    b = board(a=(seen(0, W), seen(1, W)), b=(seen(2, X), seen(3, S)))
    stall = assess(b, ["a", "b"], {}, CFG, (), 101.0)
    assert stall is not None and stall.culprit.rank == 3


def test_a_member_whose_workers_all_exited_0_is_the_culprit_when_the_others_wait_for_it() -> None:
    b = board(a=(seen(0, W), seen(1, W)))
    stall = assess(b, ["a"], {"b": [2, 3]}, CFG, (), 101.0)
    assert stall is not None and stall.decided
    assert (stall.node_id, stall.culprit.rank, stall.culprit.state) == ("b", 2, X)
    assert stall.message == "rank 2 exited with code 0 while ranks 0-1 waited for it in all_reduce"


def test_a_member_that_finished_while_a_rank_still_works_is_no_culprit_of_a_node_local_wait() -> None:
    """Node b finished (exit 0); on node a, rank 0 writes the node's files while rank 1 waits in a node-local
    barrier: healthy. Before, it failed at once as "rank 2 exited with code 0 while rank 1 waited for it"."""
    b = board(a=(seen(0, K, 8.0, "train.py:70 in save", stack=EVAL), seen(1, W, 8.0, call="barrier")))
    stall = assess(b, ["a"], {"b": [2, 3]}, CFG, (), 101.0)
    assert stall is not None and not stall.decided
    assert (stall.kind, stall.culprit.rank) == (StallKind.ALONE, 0)
    gone = board(a=(seen(0, K, 8.0, stack=EVAL), seen(1, W, 8.0)), b=(seen(2, X), seen(3, W)))
    stall = assess(gone, ["a", "b"], {}, CFG, (), 101.0)          # exited with no code known: still certain
    assert stall is not None and stall.decided and stall.culprit.rank == 2


@pytest.mark.parametrize("state", [Q, P, K, U])
def test_a_rank_apart_while_the_others_wait_is_alone_and_decided_only_at_the_alone_limit(state) -> None:
    alone = seen(0, state, 42.0, "metrics.py:12 in ngrams", stack=EVAL)
    b = board(a=(alone, seen(1, W, 42.0, stack=ALL_REDUCE)), b=(seen(2, W, 42.0), seen(3, W, 42.0)))
    stall = assess(b, ["a", "b"], {}, CFG, (), 101.0)
    assert stall is not None and stall.kind is StallKind.ALONE and not stall.decided and stall.culprit.rank == 0
    assert stall.message == "rank 0 alone for 42s at metrics.py:12 in ngrams; ranks 1-3 waiting in all_reduce"
    at_limit = board(a=(seen(0, state, 1800.0, stack=EVAL), seen(1, W, 1800.0)), b=(seen(2, W), seen(3, W)))
    decided = assess(at_limit, ["a", "b"], {}, CFG, (), 101.0)
    assert decided is not None and decided.decided and decided.capped and decided.culprit.rank == 0
    assert decided.message.endswith("(--hang-alone-timeout 1800s)")
    assert not assess(at_limit, ["a", "b"], {}, limits(alone=0.0), (), 101.0).decided     # 0: never
    # the hard cap is for ranks that all wait: a rank alone past it is still working
    assert not assess(at_limit, ["a", "b"], {}, limits(alone=3600.0, cap=600.0), (), 101.0).decided


def test_every_rank_waiting_with_nothing_moving_is_a_deadlock_naming_the_rank_whose_call_differs() -> None:
    b = board(a=(seen(0, W, call="barrier"), seen(1, W, call="barrier")),
              b=(seen(2, W, call="barrier"), seen(3, W, where="torch/distributed/distributed_c10d.py:2799 in recv",
                                                   call="recv", stack=RECV)))
    stall = assess(b, ["a", "b"], {}, CFG, (), 101.0)
    assert stall is not None and stall.kind is StallKind.DEADLOCK and stall.decided and not stall.capped
    assert (stall.node_id, stall.culprit.rank, [r.rank for r in stall.odd]) == ("b", 3, [3])
    assert stall.message == ("deadlock: every rank waits on the others, none computing and no data moving; rank 3 "
                             "waits in recv at train.py:40 in main while ranks 0-2 wait in barrier")
    # the agent's `where` is the innermost frame, torch's: the script's line is the one that names the bug
    two = board(a=(seen(0, W, call="recv", stack=RECV),), b=(seen(1, W, call="barrier", where="x.py:1 in f"),))
    named = assess(two, ["a", "b"], {}, CFG, (), 101.0)
    assert named is not None and named.message.endswith("rank 0 waits in recv at train.py:40 in main while rank 1 "
                                                        "waits in barrier")
    same = board(a=(seen(0, W), seen(1, W)), b=(seen(2, W), seen(3, W)))
    everyone = assess(same, ["a", "b"], {}, CFG, (), 101.0)
    assert everyone is not None and everyone.decided and everyone.culprit.rank == 0 and not everyone.odd
    assert "no rank's call differs" in everyone.message


# io: a collective moving data; process_cpu: one copying its output in torch's threads, its last byte in (an
# all-gather of 128 MB chunks on 8 ranks copied for 12 s, taken for a deadlock before); gpu: a NCCL kernel
@pytest.mark.parametrize("activity", [{"io_bytes": 8 << 20}, {"process_cpu": 0.4}, {"gpu_busy": 97}])
def test_ranks_waiting_while_data_moves_are_a_long_collective_decided_only_at_the_hard_cap(activity) -> None:
    def ranks(stalled: float) -> dict[str, tuple[RankSeen, ...]]:
        return {"a": (seen(0, W, stalled, **activity), seen(1, W, stalled)),
                "b": (seen(2, W, stalled, **activity), seen(3, W, stalled))}
    stall = assess(board(**ranks(42.0)), ["a", "b"], {}, CFG, (), 101.0)
    assert stall is not None and stall.kind is StallKind.MOVING and not stall.decided
    assert stall.message == "ranks 0-3 in collectives for 42s in all_reduce, still moving data or computing"
    capped = assess(board(**ranks(600.0)), ["a", "b"], {}, CFG, (), 101.0)
    assert capped is not None and capped.decided and capped.capped
    assert capped.message.endswith("(hang timeout 600s)")
    assert not assess(board(**ranks(600.0)), ["a", "b"], {}, limits(cap=0.0), (), 101.0).decided


def test_nobody_waiting_is_no_stall() -> None:
    everyone_computing = board(a=(seen(0, K), seen(1, K)), b=(seen(2, Q), seen(3, P, 5000.0)))
    assert assess(everyone_computing, ["a", "b"], {}, CFG, (), 101.0) is None


def test_a_place_is_where_the_rank_went_its_own_way_and_not_the_work_below_it() -> None:
    evaluating = seen(0, K, stack=EVAL)
    other_line = seen(0, K, stack="metrics.py:30 in counts\ntrain.py:44 in evaluate\ntrain.py:55 in main\n"
                                  "train.py:90 in <module>")
    waiting = [seen(1, W, stack=ALL_REDUCE)]
    assert place_of(evaluating, waiting) == "train.py:90 in <module>\ntrain.py:55 in main"
    assert place_of(other_line, waiting) == place_of(evaluating, waiting)
    spin_a = seen(0, P, stack="train.py:70 in main\ntrain.py:90 in <module>")
    spin_b = seen(0, P, stack="train.py:71 in main\ntrain.py:90 in <module>")
    assert place_of(spin_a, waiting) == "train.py:90 in <module>\ntrain.py:~70 in main"     # where its work is now
    assert same_place(place_of(spin_a, waiting), place_of(spin_b, waiting))               # a loop's other line
    far = seen(0, P, stack="train.py:95 in main\ntrain.py:90 in <module>")
    assert not same_place(place_of(spin_a, waiting), place_of(far, waiting))              # other work in main
    called_next = seen(0, K, stack="up.py:3 in put\ntrain.py:56 in main\ntrain.py:90 in <module>")
    assert not same_place(place_of(evaluating, waiting), place_of(called_next, waiting))  # a call: lines exact
    assert place_of(seen(0, U, where="x.py:1 in f"), waiting) == "x.py:1 in f"     # no stack: where it is


def join(rz: Rendezvous, node: str, config: JobConfig = CFG) -> None:
    rz.handle("j", JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=2, master_port=1000,
                             config=config, instance=node), 1.0, Arrival(secret=f"secret-{node}"))


@pytest.fixture
def running() -> Rendezvous:
    rz = Rendezvous()
    join(rz, "a")
    join(rz, "b")
    assert rz.jobs["j"].round is not None and rz.jobs["j"].round.round_id == 1
    return rz


def test_a_hang_fails_the_round_with_the_culprit_as_root_cause_and_every_ranks_stack_in_the_events(running) -> None:
    stack = "train.py:16 in <module>\ntrain.py:3 in main"
    running.handle("j", report("a", seen(0, W, where="torch/_tensor.py:623 in backward"), seen(1, W)), 10.0)
    assert running.jobs["j"].restart_count == 0
    stopped = RankSeen(rank=3, local_rank=1, state=S, stalled_s=6.2, where="train.py:16 in <module>", stack=stack)
    status = running.handle("j", report("b", seen(2, W), stopped), 10.5)
    job = running.jobs["j"]
    assert status.accepted and job.restart_count == 1 and job.round is not None and job.round.round_id == 2
    assert job.root_cause is not None
    assert (job.root_cause.rank, job.root_cause.reason, job.root_cause.node_id) == (3, "hang", "b")
    assert job.root_cause.traceback == stack
    hang = next(e for e in job.events if e.kind == EventKind.HANG_DETECTED)
    assert hang.data["culprit"] == 3 and hang.data["kind"] == "culprit"
    assert [r["state"] for r in hang.data["ranks"]] == ["waiting"] * 3 + ["stopped"]
    assert any(r.get("stack") == stack for r in hang.data["ranks"])
    assert job.reason.startswith("hang on b (rank 3 (local 1) on 10.0.0.1: hang: rank 3 was stopped")
    assert not job.hang_places                      # certain: no place excused


def alone_reports(rz: Rendezvous, round_id: int, stalled: float, now: float, steps: int = 0) -> None:
    def at(r: RankSeen) -> RankSeen:
        return msgspec.structs.replace(r, steps=steps)
    rz.handle("j", report("a", at(seen(0, Q, stalled, "socket.py:706 in readinto", stack=EVAL)),
                                at(seen(1, W, stalled, stack=ALL_REDUCE)), round_id=round_id), now)
    rz.handle("j", report("b", at(seen(2, W, stalled)), at(seen(3, W, stalled)), round_id=round_id), now)


def test_a_rank_alone_is_shown_at_once_with_one_event_and_in_the_reply(running) -> None:
    alone_reports(running, 1, 7.0, 10.0)
    job = running.jobs["j"]
    assert job.restart_count == 0 and job.state == JobState.RUNNING
    shown = shown_stall(job, 10.0)
    assert shown is not None and shown.line(25.0) == \
        "rank 0 alone for 22s at socket.py:706 in readinto; ranks 1-3 waiting in all_reduce"
    status = running.handle("j", report("b", seen(2, W, 8.0), seen(3, W, 8.0)), 11.0)
    assert status.stall == "rank 0 alone for 8s at socket.py:706 in readinto; ranks 1-3 waiting in all_reduce"
    alone_reports(running, 1, 12.0, 15.0)                  # the spell goes on: said once
    said = [e for e in job.events if e.kind == EventKind.RANKS_ALONE]
    assert len(said) == 1 and said[0].data["culprit"] == 0 and said[0].data["limit_s"] == 1800.0
    # what rank 0 was seen doing, quiet in readinto: not "working", which a rank asleep for ever is not either
    assert said[0].message.endswith("rank 0 quiet (shown, not judged); a hang only after 1800s (--hang-alone-timeout)")
    assert shown_stall(job, 15.0 + 20.1) is None           # no fresh report: no longer shown
    job.progress.round_id, job.progress.round_steps = 1, 20     # the job stepped again; rank 0 goes alone again
    alone_reports(running, 1, 7.0, 40.0, steps=20)
    assert len([e for e in job.events if e.kind == EventKind.RANKS_ALONE]) == 2      # a new spell, said again


def test_an_alone_decision_is_never_taken_twice_at_one_place(running) -> None:
    job = running.jobs["j"]
    alone_reports(running, 1, 1800.0, 10.0)
    assert job.restart_count == 1 and [p.round_id for p in job.hang_places] == [1]
    assert job.round is not None and job.round.round_id == 2
    alone_reports(running, 2, 1800.0, 2000.0)              # after the restart, the same place again, past the limit
    assert job.restart_count == 1 and job.state == JobState.RUNNING
    excused = [e for e in job.events if e.kind == EventKind.HANG_EXCUSED]
    assert len(excused) == 1 and excused[0].data["excused_round"] == 1
    assert "never decided a hang there again" in excused[0].message
    alone_reports(running, 2, 5000.0, 2005.0)
    assert job.restart_count == 1 and len([e for e in job.events if e.kind == EventKind.HANG_EXCUSED]) == 1


def test_a_report_for_ranks_not_its_own_is_refused_and_changes_nothing(running) -> None:
    before = running.jobs["j"].event_seq
    with pytest.raises(RendezvousError) as refused:
        running.handle("j", report("a", seen(2, Q)), 10.0)     # b's rank
    assert refused.value.code == ErrorCode.BAD_REQUEST and "runs ranks 0..1 in round 1" in refused.value.message
    with pytest.raises(RendezvousError) as forged:
        running.handle("j", report("a", seen(0, W), credential="secret-b"), 10.0)
    assert forged.value.code == ErrorCode.FORBIDDEN
    assert running.jobs["j"].event_seq == before and running.jobs["j"].restart_count == 0


def test_a_stale_round_or_detection_off_changes_nothing() -> None:
    rz = Rendezvous()
    off = msgspec.structs.replace(CFG, hang_detection=False)
    join(rz, "a", off)
    join(rz, "b", off)
    rz.handle("j", report("a", seen(0, W), seen(1, W)), 10.0)
    status = rz.handle("j", report("b", seen(2, W), seen(3, S)), 10.0)
    assert not status.accepted and status.reason == "hang detection is off for this job"
    stale = rz.handle("j", report("b", seen(2, W), seen(3, S), round_id=0), 10.0)
    assert not stale.accepted and "stale" in stale.reason
    assert rz.jobs["j"].restart_count == 0 and rz.jobs["j"].state == JobState.RUNNING


def test_a_stall_is_over_once_the_job_steps_past_its_ranks_not_past_the_lagging_notes(running) -> None:
    job = running.jobs["j"]
    job.progress.round_id, job.progress.round_steps = 1, 30          # the notes lag the ranks' own 40 steps
    alone_reports(running, 1, 7.0, 10.0, steps=40)
    job.progress.round_steps = 40                                    # the notes catch up: still the same stall
    assert shown_stall(job, 11.0) is not None
    job.progress.round_steps = 42                                    # the job stepped on: it is over
    assert shown_stall(job, 11.0) is None


def test_ranks_that_finished_after_stepping_past_a_wait_are_no_culprit() -> None:
    """Ranks 0-1 reported waiting in a barrier at step 20; ranks 2-3 then stepped to 22 and exited 0 (the wait was
    over: a report that came late, on a loaded host). Before, the job was restarted for a hang at its end."""
    b = board(a=(msgspec.structs.replace(seen(0, W), steps=20), msgspec.structs.replace(seen(1, W), steps=20)))
    assert assess(b, ["a"], {"b": [2, 3]}, CFG, (), 101.0, steps=22) is None
    stall = assess(b, ["a"], {"b": [2, 3]}, CFG, (), 101.0, steps=20)          # they exited at the wait: a hang
    assert stall is not None and stall.decided and stall.culprit.rank == 2
