"""Lease rules (rdzv_server/core/leases.py) with plain numbers for time: a held poll is the lease, a
silent server blames nobody, a lagging server judges nobody, nodes lost together leave together."""
from __future__ import annotations

from protocol.messages import JobConfig, JoinRequest, NodeState, PollRequest
from rdzv_server.core.events import EventKind
from rdzv_server.core.leases import OUTAGE_LIMIT_S, QUIET_S, RESUME_GRACE_S
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival
from rdzv_server.core.rounds import assignment

LEASE = 5.0
CFG = JobConfig(min_nodes=1, max_nodes=3, last_call_s=0.0, lease_timeout_s=LEASE, join_timeout_s=1e4)


def job_with(*nodes: str, now: float = 0.0) -> Rendezvous:
    rz = Rendezvous()
    for n in nodes:
        rz.handle("j", JoinRequest(v=1, node_id=n, addr="10.0.0.1", local_world_size=1, master_port=1, config=CFG,
                                 instance=n), now)
    rz.tick(now)
    return rz


def poll(rz: Rendezvous, node: str, now: float) -> None:
    rz.handle("j", PollRequest(v=1, node_id=node), now)


def kinds(rz: Rendezvous) -> list[str]:
    return [e.kind for e in rz.jobs["j"].events]


def test_a_held_poll_is_the_lease_and_its_answer_starts_the_lease_again():
    rz = job_with("a", "b")
    rz.handle("j", PollRequest(v=1, node_id="a"), 1.0, Arrival(hold=True))
    for t in (10.0, 20.0, 30.0):                 # b keeps talking; a's poll is held the whole time
        poll(rz, "b", t)
        rz.tick(t)
    assert "a" in rz.jobs["j"].nodes
    assert rz.next_deadline() == 30.0 + LEASE    # a held poll sets no deadline
    rz.take_effects()
    rz.poll_ended("j", "a", 31.0)
    assert rz.take_effects().earliest == 31.0 + LEASE
    for t in (32.0, 33.0, 34.0, 35.0, 35.5):       # the others are still heard as a's lease runs out
        poll(rz, "b", t)
    rz.tick(31.0 + LEASE)
    assert "a" not in rz.jobs["j"].nodes and "b" in rz.jobs["j"].nodes


def test_a_held_polls_connection_closing_loses_the_node_after_the_grace():
    rz = job_with("a", "b")
    rz.handle("j", PollRequest(v=1, node_id="a"), 1.0, Arrival(hold=True))
    rz.connection_dropped("j", "a", 2.0)
    poll(rz, "b", 2.5)
    rz.tick(3.0)
    assert "a" not in rz.jobs["j"].nodes and "its connection closed" in rz.jobs["j"].events[-2].message


def test_a_single_silent_death_among_nodes_still_heard_is_a_loss_within_the_lease():
    rz = job_with("a", "b", "c")
    round_before = rz.jobs["j"].round.round_id
    for t in (2.0, 4.0):
        poll(rz, "b", t)
        poll(rz, "c", t)
    rz.tick(LEASE)                                # a was last heard at 0.0
    assert "a" not in rz.jobs["j"].nodes
    assert rz.jobs["j"].round.round_id == round_before + 1


def test_when_the_server_hears_from_nobody_leases_are_extended_until_the_outage_limit():
    rz = job_with("a", "b")
    rz.tick(LEASE)                                # quiet for a whole lease: the server's own outage
    assert set(rz.jobs["j"].nodes) == {"a", "b"}
    assert kinds(rz).count(EventKind.LEASES_EXTENDED) == 1 and QUIET_S < LEASE
    t = LEASE
    while t < OUTAGE_LIMIT_S - LEASE:             # still nobody: extended again, said once
        t += LEASE
        rz.tick(t)
    assert set(rz.jobs["j"].nodes) == {"a", "b"} and kinds(rz).count(EventKind.LEASES_EXTENDED) == 1
    rz.tick(OUTAGE_LIMIT_S + LEASE)               # silence that long means what it says
    assert rz.jobs["j"].nodes == {}


def test_agents_coming_back_after_the_servers_outage_carry_on_in_the_same_round():
    rz = job_with("a", "b")
    round_id = rz.jobs["j"].round.round_id
    rz.tick(8.0)                                  # link down from 0 to 10 s
    poll(rz, "a", 10.0)
    poll(rz, "b", 10.2)
    rz.tick(13.0)
    assert rz.jobs["j"].round.round_id == round_id and set(rz.jobs["j"].nodes) == {"a", "b"}
    assert EventKind.NODE_LOST not in kinds(rz)


def test_no_lease_lapses_while_the_server_runs_behind_it_is_judged_once_caught_up():
    rz = job_with("a", "b")
    poll(rz, "b", 4.5)
    rz.tick(LEASE + 0.5, lag_s=3.0)               # a's poll may be waiting in the server's own backlog
    assert "a" in rz.jobs["j"].nodes
    due = rz.next_deadline()
    poll(rz, "b", due - 0.5)
    rz.tick(due, lag_s=0.0)                       # caught up, and a still silent: now it is a loss
    assert "a" not in rz.jobs["j"].nodes


def test_a_lease_that_runs_out_while_nobody_is_heard_waits_for_the_quiet_rule():
    # The server's own link went down just after b's last request; a's lease, backdated to its held
    # poll's last sign of life, runs out 2 s into that silence: no evidence about a yet.
    rz = job_with("a", "b")
    poll(rz, "b", 3.0)
    rz.tick(LEASE)                                # quiet 2 s: a waits
    assert "a" in rz.jobs["j"].nodes
    while not any(e.kind == "leases_extended" for e in rz.jobs["j"].events) and rz.next_deadline() < 3.0 + 2 * LEASE:
        rz.tick(rz.next_deadline())               # still nobody: the quiet rule extends every lease
    assert set(rz.jobs["j"].nodes) == {"a", "b"}
    assert any(e.kind == "leases_extended" for e in rz.jobs["j"].events)


def test_nodes_lost_together_leave_together_in_one_new_round():
    rz = job_with("a", "b", "c")
    round_id = rz.jobs["j"].round.round_id
    for t in (1.0, 2.0, 3.0, 4.0):                # c is heard throughout
        poll(rz, "c", t)
    rz.tick(LEASE)                                # a and b lapse in the same tick
    job = rz.jobs["j"]
    assert set(job.nodes) == {"c"} and job.round.round_id == round_id + 1
    assert job.round.members == ["c"] and "2 nodes lost" in job.round.reason


def test_a_loopback_rank_0_on_a_multi_host_round_gets_a_reachable_master_addr():
    rz = Rendezvous()
    c = JobConfig(min_nodes=2, max_nodes=2, lease_timeout_s=LEASE)
    # a runs on the server's host and reached it by loopback; b came from another host to 10.0.0.1
    rz.handle("j", JoinRequest(v=1, node_id="a", addr="127.0.0.1", local_world_size=1, master_port=7,
                             config=c, instance="a"), 1.0, Arrival(peer="127.0.0.1", local="127.0.0.1"))
    rz.handle("j", JoinRequest(v=1, node_id="b", addr="10.0.0.2", local_world_size=1, master_port=8,
                             config=c, instance="b"), 1.0, Arrival(peer="10.0.0.2", local="10.0.0.1"))
    job = rz.jobs["j"]
    assert {assignment(job.round, m).master_addr for m in job.round.members} == {"10.0.0.1"}
    said = [e.message for e in job.events if e.kind == EventKind.MASTER_ADDR_CORRECTED]
    assert len(said) == 1 and "--local-addr" in said[0] and "127.0.0.1" in said[0]
    one_host = Rendezvous()                                   # every node on loopback: nothing to correct
    for n in ("a", "b"):
        one_host.handle("j", JoinRequest(v=1, node_id=n, addr="127.0.0.1", local_world_size=1, master_port=7,
                                         config=c, instance=n), 1.0, Arrival(peer="127.0.0.1", local="127.0.0.1"))
    assert {assignment(r, m).master_addr for r in [one_host.jobs["j"].round] for m in r.members} == {"127.0.0.1"}


def only_heard(rz: Rendezvous, nodes: tuple[str, ...], t: float, seconds: float) -> float:
    """`seconds` in steps of 1 s in which only `nodes` (those still known) poll, each step a tick; the time after."""
    end = t + seconds
    while t < end:
        t += 1.0
        for n in nodes:
            if n in rz.jobs["j"].nodes:
                poll(rz, n, t)
        rz.tick(t)
    return t


def flapping_job(c: JobConfig, nodes: tuple[str, ...]):
    """(a job of `nodes` joined at 0.0, a `join(node, t, instance)` that brings one back under a new agent)."""
    rz = Rendezvous()

    def join(n: str, t: float, instance: str) -> None:
        rz.handle("j", JoinRequest(v=1, node_id=n, addr="10.0.0.1", local_world_size=1, master_port=1, config=c,
                                 instance=instance), t)

    for n in nodes:
        join(n, 0.0, n)
    return rz, join


def test_a_flapping_host_is_kept_out_so_it_costs_the_others_at_most_three_rounds_in_five_minutes():
    c = JobConfig(min_nodes=2, max_nodes=3, last_call_s=0.0, lease_timeout_s=LEASE, join_timeout_s=1e4)
    rz, join = flapping_job(c, ("a", "b", "c"))
    job = rz.jobs["j"]
    first_round = job.round.round_id
    t, flaps = 0.0, 0
    while t < 300.0:                  # c: 7 s cut off (its lease lapses), 8 s back, again and again
        down_at = t
        t = only_heard(rz, ("a", "b"), t, 7.0)
        flaps += 1
        join("c", t, f"c{flaps}")     # its agent reconnects (the old record was lost)
        while t < down_at + 15.0:
            t += 1.0
            for n in ("a", "b", "c"):
                if n in job.nodes:
                    poll(rz, n, t)
            rz.tick(t)
    rounds = job.round.round_id - first_round
    assert rounds <= 3, [e.message for e in job.events if e.kind == "round_completed"]
    kept_out = [e.message for e in job.events if e.kind == EventKind.NODE_EXCLUDED]
    assert kept_out and "flapping" in kept_out[0] and "c" not in job.round.members


def test_a_single_loss_is_forgiven_at_once():
    rz = job_with("a", "b", "c")
    for t in (2.0, 4.0):
        poll(rz, "b", t)
        poll(rz, "c", t)
    rz.tick(LEASE)                                # a lost once
    rz.handle("j", JoinRequest(v=1, node_id="a", addr="10.0.0.1", local_world_size=1, master_port=1, config=CFG,
                             instance="a2"), 6.0)
    assert rz.jobs["j"].nodes["a"].state != "excluded"


def test_a_closed_connection_waits_while_the_server_runs_behind_and_is_a_loss_once_caught_up():
    # An agent closes a poll whose answer is overdue and sends it again: behind, the server may not
    # have read the new one yet (at 10,000 polling nodes: 30 nodes lost in one run).
    rz = job_with("a", "b", "c")
    for node in ("a", "c"):
        rz.handle("j", PollRequest(v=1, node_id=node), 1.0, Arrival(hold=True))
        rz.connection_dropped("j", node, 1.0)
    poll(rz, "b", 2.0)
    rz.tick(2.5, lag_s=3.0)
    assert {"a", "c"} <= set(rz.jobs["j"].nodes)
    poll(rz, "c", 3.0)                            # c's new poll, read once the server caught up
    due = rz.next_deadline()
    poll(rz, "b", due - 0.5)
    rz.tick(due, lag_s=0.0)
    assert "a" not in rz.jobs["j"].nodes and "c" in rz.jobs["j"].nodes
    assert "its connection closed" in next(e.message for e in rz.jobs["j"].events if e.node_id == "a"
                                           and e.kind == EventKind.NODE_LOST)


def test_a_blip_just_after_an_answer_replaces_nobody_when_the_others_come_back_first():
    # #26: a's last contact 1.8 s before a 3 s blip of the server's link (0.05 s after b and c were
    # heard); b and c come back first, 0.1 s before a's lease runs out; a itself 3.4 s into the blip.
    rz = job_with("a", "b", "c")
    first = rz.jobs["j"].round.round_id
    poll(rz, "a", 10.0)
    for t in (10.5, 11.0, 11.75):
        poll(rz, "b", t)
        poll(rz, "c", t)
    poll(rz, "b", 14.9)                           # the blip: 11.8 -> 14.8
    rz.tick(15.0)                                 # a's lease ran out (10 + 5): the silence explains it
    assert "a" in rz.jobs["j"].nodes
    assert rz.jobs["j"].nodes["a"].lease_expires == 14.9 + RESUME_GRACE_S
    poll(rz, "c", 15.0)
    poll(rz, "a", 15.2)
    rz.tick(14.9 + RESUME_GRACE_S)
    assert set(rz.jobs["j"].nodes) == {"a", "b", "c"} and rz.jobs["j"].round.round_id == first
    assert EventKind.NODE_LOST not in kinds(rz)


def test_after_a_silence_a_node_that_does_not_come_back_is_lost_once_the_grace_ends():
    rz = job_with("a", "b")
    poll(rz, "a", 10.0)
    poll(rz, "b", 11.5)
    poll(rz, "b", 14.0)                           # nobody heard 11.5 -> 14.0
    rz.tick(15.0)
    assert "a" in rz.jobs["j"].nodes              # once, until the silence's end + the grace
    for t in (15.0, 16.0):
        poll(rz, "b", t)
    rz.tick(14.0 + RESUME_GRACE_S)
    assert "a" not in rz.jobs["j"].nodes


def test_while_nodes_keep_coming_back_after_a_silence_the_grace_runs_from_the_last_one_back():
    # #26 at 10,000 nodes: the server takes seconds to take every node back after its link healed.
    # Nodes returning a second apart, longer after the heal than RESUME_GRACE_S, all keep their place;
    # one that never comes back is lost RESUME_GRACE_S after the last return, not before.
    late = [f"n{i}" for i in range(1, 8)]
    cfg = JobConfig(min_nodes=1, max_nodes=10, last_call_s=0.0, lease_timeout_s=LEASE, join_timeout_s=1e4)
    rz = Rendezvous()
    for n in ["n0", *late, "dead"]:
        rz.handle("j", JoinRequest(v=1, node_id=n, addr="10.0.0.1", local_world_size=1, master_port=1, config=cfg,
                                 instance=n), 0.0)
    rz.tick(0.0)
    first = rz.jobs["j"].round.round_id
    for n in ["n0", *late, "dead"]:
        poll(rz, n, 10.0)
    poll(rz, "n0", 14.0)                              # the silence: 10.0 -> 14.0
    returns = {15.0 + i: n for i, n in enumerate(late)}    # n1 at 15.0 ... n7 at 21.0
    lost_at, back = None, ["n0"]
    t = 14.0
    while t < 30.0:
        if t in returns:
            back.append(returns[t])
        for n in back:                                # a node back polls on, as agents do
            poll(rz, n, t)
        rz.tick(t)
        if lost_at is None and "dead" not in rz.jobs["j"].nodes:
            lost_at = t
        t += 0.5
    assert set(rz.jobs["j"].nodes) == {"n0", *late}
    assert lost_at is not None and max(returns) + RESUME_GRACE_S <= lost_at <= max(returns) + RESUME_GRACE_S + 0.5
    lost = [e for e in rz.jobs["j"].events if e.kind == EventKind.NODE_LOST]
    assert len(lost) == 1 and "dead" in str(lost[0])
    assert rz.jobs["j"].round.round_id == first + 1  # one round without the dead node, no other


def test_a_node_silent_since_well_before_the_silence_gets_no_grace():
    rz = job_with("a", "b")
    poll(rz, "a", 10.0)
    for t in (11.0, 12.0, 13.0):                  # a silent while b is heard: not the server's fault
        poll(rz, "b", t)
    poll(rz, "b", 14.8)                           # a silence 13.0 -> 14.8, begun 3 s after a's last contact
    rz.tick(15.0)
    assert "a" not in rz.jobs["j"].nodes


def test_after_a_takeover_a_loss_gives_the_silence_since_the_previous_server_went_away():
    rz = job_with("a", "b")
    rz.restored(200.0, away_s=4.0, clean=False)   # the saved last_seen (0.0) is 200 s old: not the silence
    for t in (201.0, 202.0, 203.0, 204.0, 205.0, 206.0, 207.0, 208.0, 209.0, 210.0):
        poll(rz, "b", t)
    rz.tick(210.0)                                # the takeover's grace (two leases) ran out for a
    lost = [e.message for e in rz.jobs["j"].events if e.kind == EventKind.NODE_LOST]
    assert lost and "no contact for 14.0s" in lost[0]


def test_a_held_poll_closed_late_in_a_silence_gets_the_grace_one_closed_after_it_does_not():
    # The server's keepalive ends a's held poll 4 s into a 5 s blip: that says nothing about a.
    rz = job_with("a", "b")
    rz.handle("j", PollRequest(v=1, node_id="a"), 9.0, Arrival(hold=True))
    poll(rz, "b", 10.0)
    rz.connection_dropped("j", "a", 14.0)          # nobody heard 10.0 -> 15.0
    poll(rz, "b", 15.0)
    rz.tick(15.0)
    assert "a" in rz.jobs["j"].nodes and rz.jobs["j"].nodes["a"].lease_expires == 15.0 + RESUME_GRACE_S
    rz2 = job_with("a", "b")
    rz2.handle("j", PollRequest(v=1, node_id="a"), 9.0, Arrival(hold=True))
    poll(rz2, "b", 10.0)
    poll(rz2, "b", 15.0)
    rz2.connection_dropped("j", "a", 15.2)         # closed after the server heard again: evidence
    poll(rz2, "b", 16.0)
    rz2.tick(16.2)
    assert "a" not in rz2.jobs["j"].nodes


def test_a_poll_held_longer_than_the_lease_and_closed_gets_the_whole_grace_from_its_close():
    # At 10,000 nodes polls are held 16-20 s; an agent closes one whose answer is overdue and sends it
    # again. The open poll was its lease until then: it has DROP_GRACE_S from the close, not none.
    rz = job_with("a", "b")
    rz.handle("j", PollRequest(v=1, node_id="a"), 1.0, Arrival(hold=True))
    for t in range(2, 22, 2):
        poll(rz, "b", float(t))
    rz.connection_dropped("j", "a", 21.0)
    rz.tick(21.5)
    assert "a" in rz.jobs["j"].nodes
    poll(rz, "a", 21.6)
    rz.tick(23.0)
    assert "a" in rz.jobs["j"].nodes and EventKind.NODE_LOST not in kinds(rz)


def test_a_connection_closed_before_a_silence_is_not_held_back_by_it():
    # Seen in CI: b's poll closed, then a's poll was held (nobody heard after it). A stall kept the
    # server "behind" for 5 s; b's grace, held back for the lag meanwhile, was then held for the
    # silence too, reached the quiet rule and was extended a whole lease, again and again.
    rz = job_with("a", "b")
    rz.handle("j", PollRequest(v=1, node_id="b"), 0.5, Arrival(hold=True))
    rz.connection_dropped("j", "b", 1.0)
    rz.handle("j", PollRequest(v=1, node_id="a"), 1.0, Arrival(hold=True))        # held from here on
    t = 2.0
    while t < 30.0:
        rz.tick(t, lag_s=0.2 if t < 6.0 else 0.0)
        if "b" not in rz.jobs["j"].nodes:
            break
        t = max(rz.next_deadline() or 30.0, t + 0.05)
    assert "b" not in rz.jobs["j"].nodes and t <= 6.5
    assert EventKind.LEASES_EXTENDED not in kinds(rz)


def test_a_connection_whose_closing_was_heard_late_in_a_silence_is_a_loss_after_the_grace():
    # a's poll is held from 15 s: nobody heard. At 18.5 s b's kernel closes b's poll (a FIN just in:
    # connections.request_ack_age_s), so the close is evidence about b.
    rz = job_with("a", "b")
    rz.handle("j", PollRequest(v=1, node_id="b"), 14.0, Arrival(hold=True))
    rz.handle("j", PollRequest(v=1, node_id="a"), 15.0, Arrival(hold=True))
    rz.connection_dropped("j", "b", 18.5, heard=True)
    rz.tick(19.5)
    assert "b" not in rz.jobs["j"].nodes
    # the same close with nothing heard (a keepalive giving up: maybe the server's own link) is
    # taken for the silence's doing: b waits
    rz2 = job_with("a", "b")
    rz2.handle("j", PollRequest(v=1, node_id="b"), 14.0, Arrival(hold=True))
    rz2.handle("j", PollRequest(v=1, node_id="a"), 15.0, Arrival(hold=True))
    rz2.connection_dropped("j", "b", 18.5)
    rz2.tick(19.5)
    assert "b" in rz2.jobs["j"].nodes and EventKind.LEASES_EXTENDED in kinds(rz2)


def test_a_flapping_host_a_job_cannot_run_without_is_not_kept_out():
    """Keeping it out would stop the job (no spare, no node above the minimum) for the hold-off: admitted, said."""
    c = JobConfig(min_nodes=3, max_nodes=3, last_call_s=0.0, lease_timeout_s=LEASE, join_timeout_s=1e4)
    rz, join = flapping_job(c, ("a", "b", "c"))
    job = rz.jobs["j"]
    t = 0.0
    for flap in (1, 2):               # c's agent dies twice (an OOM-kill loop): its lease lapses, it comes back
        t = only_heard(rz, ("a", "b"), t, 7.0)
        join("c", t, f"c{flap}")
    assert job.nodes["c"].state != "excluded" and job.round is not None and "c" in job.round.members
    said = [e.message for e in job.events if "not excluded" in e.message]
    assert len(said) == 1 and "needs 3 nodes and has 2" in said[0]
    assert not [e for e in job.events if e.kind == EventKind.NODE_EXCLUDED]


def test_a_flapping_hosts_hold_off_ends_when_the_job_is_short_of_nodes():
    """A review found a held-off host, alive, kept out while the job stood still: a's hold-off began while the spare s
    could take its place; once s is lost too, the job waits for nodes, and a's hold-off ends."""
    c = JobConfig(min_nodes=2, max_nodes=2, last_call_s=0.0, lease_timeout_s=LEASE, join_timeout_s=1e4)
    rz, join = flapping_job(c, ("a", "b", "s"))
    job = rz.jobs["j"]
    t = 0.0
    for flap in (1, 2):               # a's agent dies twice: s takes its place, then a comes back
        t = only_heard(rz, ("b", "s"), t, 7.0)
        join("a", t, f"a{flap}")
    assert job.nodes["a"].state == "excluded" and sorted(job.round.members) == ["b", "s"]
    t = only_heard(rz, ("a", "b"), t, 7.0)    # s lost: the job is short of nodes; a, held off, polls on
    assert "s" not in job.nodes and job.round is not None and sorted(job.round.members) == ["a", "b"]
    assert any("exclusion as a flapping host ends" in e.message for e in job.events)


def test_an_agent_restarted_twice_at_once_is_no_flapping_host():
    """A review (2 gloo nodes, DDP): an operator's restart typed twice. b's next agent, still preparing, was replaced
    by the one after it within a second; that counted as b's second loss, and b was kept out 300s as a flapping host
    (the job ran on without it) though its second agent never entered a round. A loss counts for a node with a place."""
    c = JobConfig(min_nodes=1, max_nodes=3, last_call_s=0.0, lease_timeout_s=LEASE, join_timeout_s=1e4)
    rz = Rendezvous()

    def join(instance: str, t: float, ready: bool = True, predecessor: str = "", again: bool = False) -> None:
        rz.handle("j", JoinRequest(v=1, node_id=instance[0], addr="10.0.0.1", local_world_size=1, master_port=1,
                                   config=c, instance=instance, ready=ready, predecessor=predecessor,
                                   credential=f"secret-{instance}" if again else ""),
                  t, Arrival(secret=f"secret-{instance}"))

    join("a", 0.0)
    join("b", 0.0)
    rz.tick(0.0)
    job = rz.jobs["j"]
    assert job.round is not None and job.round.members == ["a", "b"]
    join("b2", 1.0, ready=False, predecessor="secret-b")      # its agent restarted: a loss (b was a member)
    join("b3", 1.5, ready=False, predecessor="secret-b2")     # and restarted again before b2 was ever in a round
    assert job.nodes["b"].state != NodeState.EXCLUDED, [e.message for e in job.events[-3:]]
    join("b3", 3.0, again=True)                               # ready: back in the job
    rz.tick(3.0)
    assert job.round is not None and job.round.members == ["a", "b"], [e.message for e in job.events[-3:]]


def one_worker(rz: Rendezvous, node: str, addr: str, config: JobConfig, t: float) -> None:
    """`node` (its own instance) joins job "j" from `addr` with one worker at `t`."""
    rz.handle("j", JoinRequest(v=1, node_id=node, addr=addr, local_world_size=1, master_port=1, config=config,
                               instance=node), t)


def a_alone(max_nodes: int) -> tuple[Rendezvous, JobConfig, int]:
    """Node a alone in round 1 of job "j" (last call 1 s), heard at 10.0: the rendezvous, its config, the round."""
    rz = Rendezvous()
    config = JobConfig(min_nodes=1, max_nodes=max_nodes, last_call_s=1.0, lease_timeout_s=LEASE, join_timeout_s=1e4)
    one_worker(rz, "a", "10.0.0.1", config, 0.0)
    rz.tick(1.0)
    job = rz.jobs["j"]
    assert job.round is not None and job.round.members == ["a"]
    poll(rz, "a", 10.0)
    return rz, config, job.round.round_id


def test_a_newcomer_whose_connection_closed_in_the_last_call_does_not_restart_the_round_at_its_end():
    # a review: an agent killed as it became ready was taken into the round its last call formed, and the
    # round formed again without it a few ms later: the running node's workers stopped twice, for nothing
    rz, config, first = a_alone(max_nodes=3)
    job = rz.jobs["j"]
    one_worker(rz, "b", "10.0.0.2", config, 10.0)
    rz.handle("j", PollRequest(v=1, node_id="b"), 10.5, Arrival(hold=True))
    rz.connection_dropped("j", "b", 10.8, heard=True)     # b's agent killed 0.2 s before the last call ends
    poll(rz, "a", 10.9)
    rz.tick(11.0)                                          # the last call's end: b's grace still runs
    assert job.round is not None and job.round.round_id == first
    poll(rz, "a", 11.5)
    rz.tick(11.8)                                          # b's grace over: lost, and nobody is left to add
    assert "b" not in job.nodes
    assert job.round is not None and job.round.round_id == first and job.round.members == ["a"]


def test_a_newcomer_that_keeps_closing_its_connection_holds_the_last_call_once_not_for_ever():
    # a review: a flaky (or hostile) agent that polls and closes again within each grace was dropped with its grace
    # running at every hold's end, and the last call was held again and again: no round formed for the others
    rz, config, first = a_alone(max_nodes=4)
    job = rz.jobs["j"]
    for c in ("b", "c"):
        one_worker(rz, c, "10.0.0.2", config, 10.0)
    rz.handle("j", PollRequest(v=1, node_id="b"), 10.5, Arrival(hold=True))
    rz.handle("j", PollRequest(v=1, node_id="c"), 10.5, Arrival(hold=True))
    t = 10.9
    rz.connection_dropped("j", "b", t, heard=True)         # closed 0.1 s before the last call ends
    for _ in range(10):
        end = job.last_call_deadline
        if end is None:
            break
        rz.tick(end)
        if job.round is not None and job.round.round_id != first:
            break
        rz.handle("j", PollRequest(v=1, node_id="b"), end + 0.1, Arrival(hold=True))     # back, and away again
        poll(rz, "a", end + 0.2)
        rz.connection_dropped("j", "b", end + 0.5, heard=True)
    assert job.round is not None and job.round.round_id != first and "c" in job.round.members, \
        [e.message for e in job.events[-3:]]
