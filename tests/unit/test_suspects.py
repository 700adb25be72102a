"""A worker's exit code that asks for other hardware (rdzv_server/core/suspects.py), through the real core: with a
ready spare its node is held out at the first such exit and the spare takes its place and ranks; without one the
job restarts on it, and a second time excludes it; other exit codes, or none named, are plain failures."""
from __future__ import annotations

import msgspec
import pytest

from protocol.messages import FailureReport, JobConfig, JoinRequest, NodeState, PollRequest, WorkerFailure
from rdzv_ctl import tables as ctl
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival
from rdzv_server.core.suspects import Action
from rdzv_server.web import views
from rdzv_server.web.page import render as page

T = 1_700_000_000.0
CFG = JobConfig(min_nodes=2, max_nodes=2, max_restarts=5, last_call_s=0.0, lease_timeout_s=10_000.0)


def join(rz: Rendezvous, node: str, now: float, config: JobConfig = CFG) -> None:
    rz.handle("j", JoinRequest(v=1, node_id=node, addr="10.0.0.1", host=f"host-{node}", local_world_size=2,
                               master_port=29500, config=config, instance=f"{node}#1"), now,
              Arrival(secret=f"secret-{node}"))


def exits(rz: Rendezvous, node: str, code: int, now: float) -> None:
    round_id = rz.jobs["j"].round.round_id
    failure = WorkerFailure(local_rank=1, rank=3, exitcode=code, message="asked", timestamp=now)
    rz.handle("j", FailureReport(v=1, node_id=node, credential=f"secret-{node}", round_id=round_id,
                                 failures=[failure]), now)


def places(rz: Rendezvous) -> dict[str, int]:
    """Member -> its group rank in the running round, as its poll's assignment says."""
    job = rz.jobs["j"]
    got = {}
    for node in job.round.members:
        status = rz.handle("j", PollRequest(v=1, node_id=node, credential=f"secret-{node}", known_round=-1,
                                            wait_s=0.0), T + 100)
        got[node] = status.assignment.group_rank
    return got


def suspect_events(rz: Rendezvous) -> list[str]:
    return [e.message for e in rz.jobs["j"].events if e.kind == "node_suspect"]


def test_with_a_ready_spare_the_suspect_is_held_out_and_the_spare_takes_its_place() -> None:
    rz = Rendezvous()
    for node in ("a", "b"):
        join(rz, node, T)
    join(rz, "s", T + 1)                                   # at max_nodes: a spare
    before = places(rz)
    exits(rz, "b", 16, T + 10)
    job = rz.jobs["j"]
    assert job.restart_count == 1 and job.nodes["b"].state == NodeState.EXCLUDED
    assert places(rz) == {"a": before["a"], "s": before["b"]}    # the spare in b's place: b's ranks
    assert suspect_events(rz) == ["node b is a suspect: a worker asked for other hardware (rank 3 (local 1) on "
                                  "host-b: exit code 16: asked); spare s takes its place; it is excluded"]
    assert rz.take_effects().suspects == [Action.REPLACED.value]


def test_without_a_spare_the_job_restarts_on_it_once_and_a_second_time_excludes_it() -> None:
    rz = Rendezvous()
    config = msgspec.structs.replace(CFG, min_nodes=1)
    for node in ("a", "b"):
        join(rz, node, T, config)
    exits(rz, "b", 17, T + 10)
    job = rz.jobs["j"]
    assert job.restart_count == 1 and set(job.round.members) == {"a", "b"}
    assert "no spare is ready, so the job restarts on it" in suspect_events(rz)[0]
    exits(rz, "b", 17, T + 20)
    assert job.restart_count == 2 and job.nodes["b"].state == NodeState.EXCLUDED and job.round.members == ["a"]
    assert "the second time within 600s: it is excluded" in suspect_events(rz)[1]
    assert rz.take_effects().suspects == [Action.KEPT.value, Action.EXCLUDED.value]


@pytest.mark.parametrize(("code", "codes"), [(1, (16, 17)), (16, ())])
def test_another_code_or_none_named_is_a_plain_failure(code, codes) -> None:
    rz = Rendezvous()
    config = msgspec.structs.replace(CFG, suspect_exit_codes=codes)
    for node in ("a", "b"):
        join(rz, node, T, config)
    join(rz, "s", T + 1, config)
    exits(rz, "b", code, T + 10)
    assert rz.jobs["j"].nodes["b"].state == NodeState.MEMBER and not suspect_events(rz)
    assert set(rz.jobs["j"].round.members) == {"a", "b"}


def test_a_replaced_suspect_takes_no_place_until_its_checks_pass_again() -> None:
    """Its agent checks something (JoinRequest.checks): readmitted after the cooldown, the node is not ready, its
    status asks for the checks, and a poll saying they passed makes it ready: it may take a place again."""
    rz = Rendezvous()
    config = msgspec.structs.replace(CFG, exclude_cooldown_s=10.0)
    for node in ("a", "b"):
        rz.handle("j", JoinRequest(v=1, node_id=node, addr="10.0.0.1", host=f"host-{node}", local_world_size=2,
                                   master_port=29500, config=config, instance=f"{node}#1", checks="gpu"), T,
                  Arrival(secret=f"secret-{node}"))
    join(rz, "s", T + 1, config)
    exits(rz, "b", 16, T + 10)
    job = rz.jobs["j"]
    assert job.nodes["b"].checks_due and "takes no place until its checks (gpu) pass again" in suspect_events(rz)[0]
    excluded_line = [ln for ln in ctl.format_job(views.job_detail(job, T + 15)).splitlines() if ln.startswith("b ")]
    assert excluded_line and excluded_line[0].split()[2] == "1(suspect)", excluded_line
    rz.tick(T + 21)                                                     # the cooldown is over: readmitted

    def poll(passed: bool, now: float):
        return rz.handle("j", PollRequest(v=1, node_id="b", credential="secret-b", known_round=-1, wait_s=0.0,
                                          ready=True, checks_passed=passed), now)
    said = poll(False, T + 22)
    assert said.checks_due and job.nodes["b"].state == NodeState.SPARE and not job.nodes["b"].ready
    spare = next(n for n in views.job_detail(job, T + 22).spares if n.node_id == "b")
    assert (spare.suspicions, spare.checks_due) == (1, True)
    assert 'data-checks-due="1">a suspect: its checks, once more' in (page.job_page(rz, "j", T + 22) or "")
    assert [ln.split()[-1] for ln in ctl.format_job(views.job_detail(job, T + 22)).splitlines()
            if ln.startswith("b ")] == ["checks-due"]
    said = poll(True, T + 23)
    assert not said.checks_due and job.nodes["b"].ready
    assert [e.message for e in job.events if e.kind == "node_ready"] == \
        ["node b passed its checks again: it may take a place"]
