"""An operator's drain of a member while a spare is ready (operator_rules.drain, swaps.py), through the real
Rendezvous: with snapshots of its own, the node is swapped for the spare at the job's next snapshot, as a slow node
is, and goes as drained only once the spare holds that step (fetched from the drained node itself). A review saw
the drain re-form the round at once: the spare fetched b's shard from its peer's copy, 33 steps behind, and b's
agent, which held the newest, exited. The drain is in force at once; a drain with no snapshot goes at once."""
from __future__ import annotations

import msgspec
import pytest

from protocol.errors import ErrorCode
from protocol.messages import JoinRequest, NodeState
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import EventKind
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.swaps import SWAP_WAIT_S
from tests.unit.progress_jobs import CFG, T, join
from tests.unit.test_swaps import poll

CONFIG = msgspec.structs.replace(CFG, min_nodes=3, max_nodes=3)
WHY = "ECC errors"


def running(copied: int | None = 10) -> Rendezvous:
    """Members a, b, c holding (and having copied to peers) step 10 (`copied`), spare s ready; copy ports on."""
    rz = Rendezvous()
    for node in ("a", "b", "c", "s"):
        join(rz, "swap", node, T, CONFIG, copy_port=7000)
    for node in ("a", "b", "c"):
        poll(rz, node, T + 1, copied=copied)
    job = rz.jobs["swap"]
    assert job.round is not None and job.round.members == ["a", "b", "c"] and job.spares == ["s"]
    return rz


def swapped_out(rz: Rendezvous) -> None:
    """b drained at T + 2; a and b hold after their snapshot of 15: the spare took b's place, b serves its fetch."""
    rz.drain_node("swap", "b", WHY, T + 2)
    poll(rz, "a", T + 4, held=15, copied=15, holding=True)
    poll(rz, "b", T + 5, held=15, copied=15, holding=True)


def hold_asked(rz: Rendezvous, node: str, at: float) -> bool:
    return rz.view("swap", node, at).hold_at_snapshot


def test_a_drained_member_is_swapped_at_the_next_snapshot_and_goes_once_the_spare_holds_it() -> None:
    rz = running()
    job = rz.jobs["swap"]
    first = job.round.round_id
    rz.drain_node("swap", "b", WHY, T + 2)
    # in force at once (listed, and no agent of b may join), but b runs on until the next snapshot
    assert job.drained == {"b": WHY} and job.round.round_id == first and job.round.members == ["a", "b", "c"]
    assert [hold_asked(rz, n, T + 3) for n in ("a", "b", "c", "s")] == [True, True, True, False]
    with pytest.raises(RendezvousError) as err:
        rz.handle("swap", JoinRequest(v=1, node_id="b", addr="10.0.0.1", host="host-b", local_world_size=2,
                                      master_port=29500, config=CONFIG, instance="b#2"), T + 3)
    assert err.value.code == ErrorCode.NODE_DRAINED
    rz.drain_node("swap", "b", "another reason", T + 3)          # drained already: nothing changes
    assert job.drained == {"b": WHY} and job.swap is not None
    poll(rz, "a", T + 4, held=15, copied=15, holding=True)       # a's ranks wait after step 15 ...
    assert job.round.round_id == first                          # ... b has not written its own snapshot of it
    poll(rz, "b", T + 5, held=15, copied=12, holding=True)      # (its copy of 15 still on its way to its peer)
    assert job.round.round_id == first + 1 and job.restart_count == 0
    assert job.round.members == ["a", "s", "c"]                 # the spare in b's place
    spare = rz.view("swap", "s", T + 6).assignment
    assert spare is not None and spare.copies_of == "b"
    assert spare.copies_at is not None and spare.copies_at.port == 7000     # fetched from b itself
    # b stays (out of the round, serving its snapshots) until the spare's note shows step 15
    assert job.nodes["b"].state == NodeState.EXCLUDED
    assert rz.view("swap", "b", T + 6).node_state == NodeState.EXCLUDED
    rz.tick(T + 7)
    poll(rz, "s", T + 8, copied=-1)                              # still fetching
    assert "b" in job.nodes
    poll(rz, "s", T + 9, copied=15)
    assert "b" not in job.nodes and job.drained == {"b": WHY} and job.draining is None
    status = rz.view("swap", "b", T + 10)
    assert status.node_state == NodeState.GONE and status.reason == f"node b drained by operator: {WHY}"
    assert job.round.round_id == first + 1                      # b's going forms no other round
    said = [e.message for e in job.events if e.kind == EventKind.NODE_DRAINED]
    assert said[-1] == f"node b drained by operator: {WHY}: it goes now (spare s holds step 15)", said


def test_a_drained_node_whose_spare_never_holds_the_step_goes_after_the_wait() -> None:
    rz = running()
    job = rz.jobs["swap"]
    swapped_out(rz)
    assert "s" in job.round.members and job.draining is not None
    until = job.draining.until
    assert until == T + 5 + SWAP_WAIT_S
    rz.tick(until - 1)
    assert job.nodes["b"].state == NodeState.EXCLUDED           # neither gone nor readmitted yet
    rz.tick(until)
    assert "b" not in job.nodes and "b" in job.drained
    assert f"fetch did not end within {SWAP_WAIT_S:g}s" in job.events[-1].message


def test_a_drain_of_a_node_holding_no_snapshot_or_with_no_spare_goes_at_once() -> None:
    rz = running(copied=-1)                                      # no snapshot yet: nothing to wait for
    job = rz.jobs["swap"]
    first = job.round.round_id
    rz.drain_node("swap", "b", WHY, T + 2)
    assert "b" not in job.nodes and job.round.round_id == first + 1 and job.swap is None
    rz = running()
    job = rz.jobs["swap"]
    rz.drain_node("swap", "s", WHY, T + 2)                       # the spare itself: at once, as before
    rz.drain_node("swap", "b", WHY, T + 3)                       # no spare ready now: at once
    assert "b" not in job.nodes and job.swap is None and job.round is None     # (below min_nodes 3: waits)


def test_a_drain_lifted_before_its_swap_calls_it_off() -> None:
    rz = running()
    job = rz.jobs["swap"]
    rz.drain_node("swap", "b", WHY, T + 2)
    rz.clear_exclusion("swap", "b", T + 3)
    assert job.swap is None and not hold_asked(rz, "a", T + 4) and job.drained == {}
    poll(rz, "a", T + 4, held=15, copied=15, holding=True)
    poll(rz, "b", T + 5, held=15, copied=15, holding=True)
    assert job.round.members == ["a", "b", "c"] and job.spares == ["s"]


def test_rdzv_ctl_says_a_drained_member_goes_at_the_next_snapshot() -> None:
    """The drained node is still listed among the job's nodes after the answer: said why, or the operator would
    take it for a drain that did nothing."""
    import json

    from protocol.views import to_json
    from rdzv_ctl import cli
    from rdzv_server.web import views

    rz = running()

    class Answers:
        def post(self, path: str, body: dict) -> object:
            return json.loads(to_json(views.job_detail(rz.drain_node("swap", path.split("/")[-2], WHY, T + 2),
                                                       T + 2)))

        def get(self, path: str) -> object:
            return json.loads(to_json(views.job_detail(rz.jobs["swap"], T + 2)))

    args = cli.build_parser().parse_args(["drain", "swap", "b", "--reason", WHY])
    args.json = False
    said = cli.run(args, Answers()).splitlines()[0]  # type: ignore[arg-type]
    assert said == ("drained node b from job swap; a spare takes its place at the job's next snapshot, fetching it "
                    "from the node, which then goes (nothing is trained again)"), said


def test_a_drain_lifted_while_the_node_serves_its_spare_readmits_it() -> None:
    rz = running()
    job = rz.jobs["swap"]
    swapped_out(rz)
    assert job.nodes["b"].state == NodeState.EXCLUDED and job.draining is not None
    rz.clear_exclusion("swap", "b", T + 6)
    assert job.draining is None and job.drained == {} and job.nodes["b"].state == NodeState.SPARE
    poll(rz, "s", T + 7, copied=15)
    rz.tick(T + 6 + SWAP_WAIT_S)
    assert job.nodes["b"].state == NodeState.SPARE                # not removed as drained after all


def test_a_drain_waiting_for_its_swap_carries_over_to_a_round_formed_meanwhile() -> None:
    """A review drained b (its swap due), then c, which went at once (the spare took its place): the new round made
    b's swap moot, and b ran on in every round after, listed as drained. The drain stands: b goes at that round's
    snapshot (at once there, no spare being ready any more)."""
    rz = running()
    job = rz.jobs["swap"]
    rz.drain_node("swap", "b", WHY, T + 2)
    rz.drain_node("swap", "c", WHY, T + 3)                       # another swap under way: c goes at once
    assert job.round.members == ["a", "b", "s"] and job.drained == {"b": WHY, "c": WHY}
    assert [hold_asked(rz, n, T + 4) for n in ("a", "b", "s")] == [True, True, True]   # the new round's ranks hold
    second = job.round.round_id
    for node in ("a", "b", "s"):
        poll(rz, node, T + 5, held=20, copied=20, holding=True)
    assert "b" not in job.nodes and job.swap is None, job.round
    assert job.events[-2].message == f"node b drained by operator: {WHY} (no spare is ready any more: it goes at once)"
    assert job.round is None or job.round.round_id != second


@pytest.mark.parametrize("how", ["fetched", "lost"])
def test_a_drained_node_gone_after_its_swap_is_listed_drained_not_excluded(how: str) -> None:
    """A review: after b went (its spare holding the step, or its agent killed while it served), rdzv-ctl job listed
    b as excluded with most of a minute left, as if it came back then; its drain, not an exclusion, keeps it out."""
    from rdzv_server.web import views

    rz = running()
    job = rz.jobs["swap"]
    swapped_out(rz)
    assert job.draining is not None
    if how == "fetched":
        poll(rz, "s", T + 6, copied=15)
    else:
        rz.connection_dropped("swap", "b", T + 6, heard=True)
        rz.tick(T + 20)
    assert "b" not in job.nodes and job.drained == {"b": WHY} and "b" not in job.kept_out
    detail = views.job_detail(job, T + 21)
    assert [n.node_id for n in detail.excluded] == [] and [d.node_id for d in detail.drained] == ["b"]


def test_a_drained_member_made_a_spare_before_its_swap_goes_and_is_never_taken_in_again() -> None:
    """A review drained c (its swap due), then resized the job 3 -> 2: c, made a spare, made the swap moot and stayed
    in the job, listed as drained; resized back to 3, c was a member again and trained."""
    rz = running()
    job = rz.jobs["swap"]
    rz.drain_node("swap", "c", WHY, T + 2)
    rz.resize("swap", 2, 2, T + 3)
    assert "c" not in job.nodes and job.swap is None and job.drained == {"c": WHY}
    assert job.events[-1].message == f"node c drained by operator: {WHY} (no member of a running round now: it goes " \
                                     f"at once)"
    rz.resize("swap", 3, 3, T + 4)
    assert job.round.members == ["a", "b", "s"]


def test_a_drained_member_excluded_for_a_failure_before_its_swap_goes() -> None:
    """Excluded for its workers' failure before the snapshot came, the drained node was neither readmitted (drained)
    nor removed: held excluded for good, its agent waiting."""
    from protocol.messages import FailureReport, WorkerFailure
    rz = running()
    job = rz.jobs["swap"]
    job.config = msgspec.structs.replace(job.config, exclude_after=1)
    rz.drain_node("swap", "b", WHY, T + 2)
    failure = WorkerFailure(local_rank=0, rank=2, exitcode=1, timestamp=T + 3)
    rz.handle("swap", FailureReport(v=1, node_id="b", credential="secret-b", round_id=job.round.round_id,
                                    failures=[failure]), T + 3)
    assert "b" not in job.round.members
    rz.tick(T + 4)
    assert "b" not in job.nodes and job.drained == {"b": WHY} and job.swap is None


def test_a_drained_member_lost_before_its_swap_is_not_awaited() -> None:
    """A review: b drained (its swap due at the next snapshot), then its agent killed: the job waited a window
    (lease and last call) for b's next agent to come back, every rank idle, though that agent's join is refused as
    drained. A drained node is not awaited: the spare takes its place at once, fetching b's copy from its peer."""
    rz = running()
    job = rz.jobs["swap"]
    first = job.round.round_id
    rz.drain_node("swap", "b", WHY, T + 2)
    rz.connection_dropped("swap", "b", T + 3, heard=True)
    rz.tick(T + 4)                                               # past the connection's grace
    assert job.awaited == [] and job.round is not None and job.round.round_id == first + 1, job.reason
    assert job.round.members == ["a", "s", "c"]
    spare = rz.view("swap", "s", T + 5).assignment
    assert spare is not None and spare.copies_of == "b"


def preparing_spare() -> Rendezvous:
    """Members a, b, c running; spare s joined still preparing (its interpreter importing)."""
    from rdzv_server.core.requests import Arrival
    rz = Rendezvous()
    for node in ("a", "b", "c"):
        join(rz, "swap", node, T, CONFIG, copy_port=7000)
    rz.handle("swap", JoinRequest(v=1, node_id="s", addr="10.0.0.1", host="host-s", local_world_size=2,
                                  master_port=29500, config=CONFIG, instance="s#1", copy_port=7000,
                                  copy_verifiers=True, ready=False), T, Arrival(secret="secret-s"))
    for node in ("a", "b", "c"):
        poll(rz, node, T + 1)
    return rz


def test_a_drain_as_the_spare_prepares_waits_for_it_rather_than_shrink_the_job() -> None:
    """A review (chaos runs): `rdzv-ctl drain` of a member while the spare still prepared (its interpreter importing)
    re-formed the round without it at once, and a job of shards grew again with the spare a second later, every rank
    from step 0. The swap now waits for that spare too: at the next snapshot once it is ready."""
    from protocol.messages import PollRequest
    rz = preparing_spare()
    job = rz.jobs["swap"]
    first = job.round.round_id
    assert job.spares == ["s"] and not job.nodes["s"].ready
    rz.drain_node("swap", "b", WHY, T + 2)
    assert job.round.round_id == first and job.round.members == ["a", "b", "c"] and job.drained == {"b": WHY}
    poll(rz, "a", T + 4, held=15, copied=15, holding=True)
    poll(rz, "b", T + 5, held=15, copied=15, holding=True)
    assert job.round.round_id == first and "b" in job.round.members          # the ranks wait for the spare
    rz.handle("swap", PollRequest(v=1, node_id="s", credential="secret-s", wait_s=0.0, ready=True), T + 6)
    poll(rz, "a", T + 7, held=15, copied=15, holding=True)
    assert job.round.round_id == first + 1 and job.round.members == ["a", "s", "c"]   # in b's place, from 15
    assert job.restart_count == 0


def test_a_drain_swaps_as_soon_as_the_spare_it_waits_for_says_it_is_ready() -> None:
    """A review: the spare's poll that said it was ready (no copies noted before its first round) did not swap; the
    ranks held on until a member's next poll."""
    from protocol.messages import PollRequest
    rz = preparing_spare()
    job = rz.jobs["swap"]
    first = job.round.round_id
    rz.drain_node("swap", "b", WHY, T + 2)
    poll(rz, "a", T + 4, held=15, copied=15, holding=True)
    poll(rz, "b", T + 5, held=15, copied=15, holding=True)
    assert job.round.round_id == first and job.round.members == ["a", "b", "c"]      # the ranks wait for the spare
    rz.handle("swap", PollRequest(v=1, node_id="s", credential="secret-s", wait_s=0.0, ready=True), T + 6)
    assert job.round.round_id == first + 1 and job.round.members == ["a", "s", "c"]


def test_a_drain_holds_no_rank_for_a_spare_whose_checks_are_due() -> None:
    """A review: a spare held out until its checks pass again (a suspect's quarantine) is not coming soon: the drain
    held every rank the full SWAP_WAIT_S for it. It goes at once, as with no spare."""
    from rdzv_server.core import suspects
    rz = preparing_spare()
    job = rz.jobs["swap"]
    spare = job.nodes["s"]
    spare.checks = "gpu"
    suspects.quarantine(spare, T + 1)
    rz.drain_node("swap", "b", WHY, T + 2)
    assert job.swap is None and "b" not in job.nodes and not hold_asked(rz, "a", T + 3)
