"""Round building (rdzv_server/core/rounds.py): which address the other members reach each node at, and
that forming a round again does not parse every member's address again (at 5,000 members the parsing
was most of the time a failure report took to answer)."""
from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.messages import FailureReport, JobConfig, JobState, JoinRequest, NodeState, WorkerFailure
from rdzv_server.core import addresses, rounds
from rdzv_server.core.records import JobRecord, NodeRecord
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival

MEMBERS = 40


@pytest.mark.parametrize(("addr", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True),
    ("10.0.0.1", False), ("fe80::1%eth0", False), ("node-7.example", False), ("127.0.0.999", False)])
def test_loopback_addresses_are_told_apart_the_same_way_every_time(addr: str, loopback: bool):
    addresses._loopback.cache_clear()
    assert addresses._loopback(addr) is loopback
    assert addresses._loopback(addr) is loopback            # the cached answer is the same


def test_a_round_formed_again_parses_no_member_address_again(monkeypatch: pytest.MonkeyPatch):
    parsed: list[str] = []
    real = ipaddress.ip_address

    def counting(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        parsed.append(addr)
        return real(addr)

    monkeypatch.setattr(ipaddress, "ip_address", counting)
    addresses._loopback.cache_clear()
    rz = Rendezvous()
    cfg = JobConfig(min_nodes=MEMBERS, max_nodes=MEMBERS, max_restarts=5, lease_timeout_s=1e4)
    for i in range(MEMBERS):
        addr = f"10.1.{i // 200}.{i % 200 + 1}"
        rz.handle("j", JoinRequest(v=1, node_id=f"n{i}", addr=addr, local_world_size=8, master_port=29500,
                                 config=cfg, instance=f"n{i}", witness_port=29600), 1.0,
                                     Arrival(peer=addr, local="10.1.9.9"))
    first = rz.jobs["j"].round
    assert first is not None and len(first.members) == MEMBERS
    assert len(set(parsed)) > MEMBERS            # every member's address and the server's were looked at
    parsed.clear()

    failure = WorkerFailure(local_rank=0, rank=0, exitcode=1)
    status = rz.handle("j", FailureReport(v=1, node_id="n3", round_id=first.round_id, failures=[failure]), 2.0)
    second = rz.jobs["j"].round
    assert status.accepted and second is not None and second.round_id == first.round_id + 1
    assert parsed == []
    # ... and the round carries the same addresses as before
    assert {rounds.assignment(second, m).master_addr for m in second.members} == {"10.1.0.1"}
    assert [w.addr for w in rounds.assignment(second, "n0").witnesses] == ["10.1.0.2", "10.1.0.3"]


def _ring_walk(ports: list[int], rank: int) -> list[int]:
    """The rule written the slow, obvious way: the next two others after `rank`, around the ring,
    that have a probe port."""
    n = len(ports)
    return [o for o in ((rank + step) % n for step in range(1, n)) if ports[o]][:rounds.WITNESSES]


@given(st.lists(st.sampled_from([0, 0, 29600]), min_size=1, max_size=30))
def test_each_member_gets_the_next_two_members_that_answer_probes(ports: list[int]):
    job = JobRecord(job_id="j", config=JobConfig(min_nodes=1, max_nodes=len(ports)), state=JobState.RUNNING,
                    created_at=0.0)
    members = []
    for i, port in enumerate(ports):
        node = NodeRecord(node_id=f"n{i}", instance=f"n{i}", addr=f"10.2.0.{i + 1}", host=f"h{i}", role="default",
                          local_world_size=1, master_port=29500, state=NodeState.MEMBER, joined_at=0.0,
                          last_seen=0.0, lease_expires=10.0, witness_port=port)
        job.nodes[node.node_id] = node
        members.append(node.node_id)
    built = rounds.build_round(job, members, 1, 0.0, 0.0, "test")
    for i in range(len(ports)):
        got = [w.addr for w in rounds.assignment(built, f"n{i}").witnesses]
        assert got == [f"10.2.0.{o + 1}" for o in _ring_walk(ports, i)]


@given(st.lists(st.tuples(st.sampled_from(["trainer", "eval"]), st.integers(1, 4)), min_size=1, max_size=20))
def test_each_member_gets_its_ranks_by_the_sizes_before_it_overall_and_in_its_role(spec: list[tuple[str, int]]):
    job = JobRecord(job_id="j", config=JobConfig(min_nodes=1, max_nodes=len(spec)), state=JobState.RUNNING,
                    created_at=0.0)
    for i, (role, size) in enumerate(spec):
        job.nodes[f"n{i}"] = NodeRecord(node_id=f"n{i}", instance=f"n{i}", addr="10.2.0.1", host="h", role=role,
                                        local_world_size=size, master_port=29500, state=NodeState.MEMBER,
                                        joined_at=0.0, last_seen=0.0, lease_expires=10.0)
    built = rounds.build_round(job, list(job.nodes), 1, 0.0, 0.0, "test")
    for i, (role, size) in enumerate(spec):
        a = rounds.assignment(built, f"n{i}")
        assert (a.group_rank, a.local_world_size, a.world_size) == (i, size, sum(s for _, s in spec))
        assert a.rank_offset == sum(s for _, s in spec[:i])
        assert a.role_rank_offset == sum(s for r, s in spec[:i] if r == role)
        assert a.role_world_size == sum(s for r, s in spec if r == role)
