"""A node leaving unhealthy (the pure core): the round re-forms as for a lost node with no restart counted, and
the server keeps its host out of every job for --unhealthy-hold, until an operator clears it."""
from __future__ import annotations

import msgspec
import pytest

from protocol.codec import decode_request, encode
from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JobState, JoinRequest, LeaveRequest, NodeStatus, UnhealthyKind
from rdzv_ctl import cli as ctl
from rdzv_server import cli as server_cli
from rdzv_server.core.events import EventKind
from rdzv_server.core.payloads import NodeUnhealthy, payload_of
from rdzv_server.core.rendezvous import Limits, Rendezvous, RendezvousError
from rdzv_server.web import views

CONFIG = JobConfig(min_nodes=2, max_nodes=2, max_restarts=3, lease_timeout_s=10_000.0, last_call_s=0.0,
                   join_timeout_s=60.0)


def join(rz: Rendezvous, node: str, now: float, job: str = "a", host: str | None = None,
         config: JobConfig = CONFIG) -> NodeStatus:
    return rz.handle(job, JoinRequest(v=1, node_id=node, addr=f"10.0.0.{len(node)}", host=host or f"host-{node}",
                                    local_world_size=1, master_port=29500, config=config,
                                    instance=f"{node}#1"), now)


def leave_unhealthy(rz: Rendezvous, node: str, now: float, job: str = "a",
                    kind: UnhealthyKind = UnhealthyKind.GPU) -> NodeStatus:
    return rz.handle(job, LeaveRequest(v=1, node_id=node, reason="unhealthy: GPU check: GPU 1: 2 volatile "
                                      "uncorrectable ECC errors", unhealthy=kind), now)


def running(rz: Rendezvous, *nodes: str) -> None:
    for node in nodes:
        join(rz, node, 0.0)
    assert rz.jobs["a"].round is not None


def test_a_member_leaving_unhealthy_is_replaced_by_a_spare_without_a_restart() -> None:
    rz = Rendezvous()
    running(rz, "n1", "n2")
    join(rz, "n3", 1.0)                                   # a hot spare
    first = rz.jobs["a"].round
    assert first is not None and first.members == ["n1", "n2"]
    leave_unhealthy(rz, "n2", 2.0)
    job = rz.jobs["a"]
    assert job.round is not None and job.round.members == ["n1", "n3"] and job.restart_count == 0
    event = next(e for e in job.events if e.kind == EventKind.NODE_UNHEALTHY)
    assert event.message == "node n2 left: unhealthy: GPU check: GPU 1: 2 volatile uncorrectable ECC errors"
    assert payload_of(event.kind, event.data) == NodeUnhealthy(kind="gpu", host="host-n2")
    assert job.events[-1].kind == EventKind.ROUND_COMPLETED and job.events[-1].data["cause"] == "node_unhealthy"


def test_its_host_is_refused_by_every_job_until_the_hold_ends() -> None:
    rz = Rendezvous(limits=Limits(unhealthy_hold_s=100.0))
    running(rz, "n1", "n2")
    leave_unhealthy(rz, "n2", 10.0)
    with pytest.raises(RendezvousError) as refused:
        join(rz, "other", 20.0, job="b", host="host-n2")       # another job, the same host
    assert refused.value.code is ErrorCode.HOST_UNHEALTHY
    assert refused.value.message == (
        "host 'host-n2' (node 'other') is held out as unhealthy for 90s more: node 'n2' of job 'a' left with "
        "unhealthy: GPU check: GPU 1: 2 volatile uncorrectable ECC errors; an operator clears it with "
        "`rdzv-ctl clear-unhealthy host-n2`")
    join(rz, "fresh", 20.0, job="b", host="host-fresh")          # other hosts are not held
    assert [h.host for h in rz.unhealthy.current(50.0)] == ["host-n2"]
    join(rz, "n2", 110.0)                                        # the hold is over
    assert rz.unhealthy.current(110.0) == []


def test_an_operator_clears_a_hold_and_an_unknown_host_is_not_found() -> None:
    rz = Rendezvous()
    running(rz, "n1", "n2")
    leave_unhealthy(rz, "n2", 10.0, kind=UnhealthyKind.STUCK_WORKER)
    assert rz.unhealthy.clear("host-n2", 11.0).kind == "stuck_worker"
    join(rz, "n2", 12.0)
    with pytest.raises(RendezvousError) as missing:
        rz.unhealthy.clear("host-n2", 13.0)
    assert missing.value.code is ErrorCode.NOT_FOUND


def test_a_plain_leave_or_a_hold_of_zero_keeps_nobody_out() -> None:
    rz = Rendezvous(limits=Limits(unhealthy_hold_s=0.0))
    running(rz, "n1", "n2")
    leave_unhealthy(rz, "n2", 10.0)
    assert rz.unhealthy.current(10.0) == []
    rz = Rendezvous()
    running(rz, "n1", "n2")
    rz.handle("a", LeaveRequest(v=1, node_id="n2", reason="scaled down"), 10.0)
    assert rz.unhealthy.current(10.0) == []
    assert EventKind.NODE_LEFT in [e.kind for e in rz.jobs["a"].events]


def test_the_job_ends_when_no_healthy_set_of_min_nodes_remains_saying_so() -> None:
    rz = Rendezvous()
    running(rz, "n1", "n2")
    leave_unhealthy(rz, "n2", 10.0)
    job = rz.jobs["a"]
    assert job.state == JobState.WAITING
    deadline = rz.next_deadline()
    assert deadline is not None
    rz.tick(deadline)
    assert job.state == JobState.FAILED
    assert job.reason.endswith("(no healthy set of 2 nodes: 1 left unhealthy)"), job.reason


def test_the_unhealthy_flag_keeps_old_agents_and_old_servers_working() -> None:
    old = {"v": 1, "node_id": "n1", "credential": "", "reason": "left"}          # an agent before the flag
    assert decode_request(LeaveRequest, msgspec.msgpack.encode(old)).unhealthy is None
    new = encode(LeaveRequest(v=1, node_id="n1", reason="unhealthy: x", unhealthy=UnhealthyKind.GPU_FAULT))

    class OldLeave(msgspec.Struct, kw_only=True):                              # a server before the flag
        v: int
        node_id: str
        reason: str = "left"
    assert msgspec.msgpack.decode(new, type=OldLeave).reason == "unhealthy: x"
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({**old, "unhealthy": "cosmic rays"}), type=LeaveRequest)


def test_rdzv_ctl_status_lists_the_held_hosts() -> None:
    rz = Rendezvous()
    running(rz, "n1", "n2")
    leave_unhealthy(rz, "n2", 10.0)
    last = ctl.format_status(views.server_status(rz, 20.0)).splitlines()[-1]
    assert last.startswith("unhealthy host host-n2: held out 3590.0s more (node n2 of job a, gpu: unhealthy: GPU ")


def test_rdzv_server_s_unhealthy_hold_flag() -> None:
    def config(*argv: str) -> Limits:
        return server_cli.config_from(server_cli.build_parser().parse_args(["--state-dir", "none", *argv])).limits
    assert config().unhealthy_hold_s == 3600.0
    assert config("--unhealthy-hold", "0").unhealthy_hold_s == 0.0
    with pytest.raises(server_cli.UsageError) as bad:
        config("--unhealthy-hold", "-5")
    assert bad.value.code == 2 and str(bad.value) == "--unhealthy-hold must be 0..604800 seconds, got -5.0"


def test_a_node_unhealthy_before_joining_is_in_the_job_s_history_but_holds_nothing() -> None:
    rz = Rendezvous()
    join(rz, "n1", 0.0)
    leave_unhealthy(rz, "sick", 1.0, kind=UnhealthyKind.HEALTH_CHECK)      # never joined: no credential, no record
    event = rz.jobs["a"].events[-1]
    assert (event.kind, event.node_id) == (EventKind.NODE_UNHEALTHY, "sick")
    assert event.message.startswith("node sick did not join: unhealthy: ")
    assert payload_of(event.kind, event.data) == NodeUnhealthy(kind="health_check", host="")
    assert "sick" not in rz.jobs["a"].nodes and rz.unhealthy.current(1.0) == []


def test_a_hold_keeps_out_only_joins_from_the_unhealthy_nodes_address() -> None:
    """A review: a node of another job (any holder of the agent token) joined naming b's host, left unhealthy, and b
    was kept out of every job for an hour. The host name is the node's own word: the hold applies to joins from the
    address the unhealthy node connected from."""
    from rdzv_server.core.requests import Arrival
    rz = Rendezvous(limits=Limits(unhealthy_hold_s=100.0))

    def join_from(node: str, job: str, peer: str, now: float) -> NodeStatus:
        return rz.handle(job, JoinRequest(v=1, node_id=node, addr=peer, host="host-b", local_world_size=1,
                                          master_port=29500, config=CONFIG, instance=f"{node}#1"), now,
                         Arrival(peer=peer))
    join_from("evil", "other", "10.9.9.9", 1.0)
    rz.handle("other", LeaveRequest(v=1, node_id="evil", reason="GPU 0: Xid 79", unhealthy=UnhealthyKind.GPU), 2.0)
    assert join_from("b", "a", "10.0.0.2", 3.0).accepted          # b's own address: not the one that left
    with pytest.raises(RendezvousError) as refused:
        join_from("b2", "a", "::ffff:10.9.9.9", 4.0)              # from where the unhealthy node was: held
    assert refused.value.code == ErrorCode.HOST_UNHEALTHY


def test_a_second_hold_from_another_address_does_not_lift_the_first() -> None:
    """A review (by reading): holds were keyed by the host name alone, so a stranger leaving unhealthy under b's host
    name from its own address replaced b's real hold, and let b back in."""
    from rdzv_server.core.unhealthy import UnhealthyHosts
    holds = UnhealthyHosts(100.0)
    holds.hold("host-b", "gpu", "GPU 0: Xid 79", "a", "b", 1.0, source="10.0.0.2")
    holds.hold("host-b", "gpu", "made up", "other", "evil", 2.0, source="10.9.9.9")
    for source in ("10.0.0.2", "10.9.9.9"):
        with pytest.raises(RendezvousError):
            holds.check("host-b", "b", 3.0, source=source)
    holds.check("host-b", "b", 3.0, source="10.0.0.3")           # from neither: not held
    assert [h.source for h in holds.current(3.0)] == ["10.0.0.2", "10.9.9.9"]
    assert holds.clear("host-b", 3.0).source == "10.9.9.9" and holds.current(3.0) == []
    holds.check("host-b", "b", 3.0, source="10.0.0.2")
