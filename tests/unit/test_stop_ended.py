"""A stopped agent's place is held no longer than its agent takes to stop (rdzv_server/core/stops.py): its leave
tells its --stop-timeout, and the wait for its next agent counts from that timeout's end; once its workers stopped
it says its stop is over (LeaveRequest.stop_ended), and the wait counts from then. Before, the job idled the whole
stop timeout (30 s by default) even where the agent ended 2 s after its signal. Only the node's own credential moves
it, once. Pure core, time as plain floats."""
from __future__ import annotations

import pytest

from protocol.messages import JobConfig, JobState, JoinRequest, LeaveRequest, NodeStatus, PollRequest
from protocol.notes import CopiesNote
from rdzv_server.core.awaiting import bound, window_s
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival
from tests.unit.test_awaiting import ELASTIC, WINDOW, last_event
from tests.unit.test_rendezvous import JOB, job, members

STOP_S = 30.0


class Job:
    """A running job of `nodes`, each joined with a secret (as the server gives every agent's join)."""

    def __init__(self, nodes: str, cfg: JobConfig = ELASTIC) -> None:
        self.rz, self.cfg, self.secrets = Rendezvous(), cfg, {}
        for i, n in enumerate(nodes):
            self.join(n, i * 0.01)
        if job(self.rz).state == JobState.WAITING:
            deadline = self.rz.next_deadline()
            assert deadline is not None
            self.rz.tick(deadline)
        assert members(self.rz) == list(nodes)

    def join(self, node: str, now: float, instance: str = "") -> None:
        reply = self.rz.handle(JOB, JoinRequest(v=1, node_id=node, addr=f"addr-{node}", local_world_size=1,
                                                master_port=20000, config=self.cfg, instance=instance or f"{node}#1"),
                               now, Arrival(secret=f"secret-{node}-{instance}"))
        self.secrets[node] = reply.credential

    def heard(self, nodes: str, *times: float, step: int = -1) -> None:
        for t in times:
            for n in nodes:
                self.rz.handle(JOB, PollRequest(v=1, node_id=n, credential=self.secrets[n],
                                                copies=CopiesNote(local_step=step) if step >= 0 else None), t)

    def stop(self, node: str, now: float, stop_s: float = STOP_S) -> NodeStatus:
        """`node`'s agent got SIGTERM, its ranks holding a snapshot of their own: it leaves, telling its stop."""
        self.heard(node, now - 0.5, step=10)
        return self.rz.handle(JOB, LeaveRequest(v=1, node_id=node, credential=self.secrets[node], stopped=True,
                                                stop_timeout_s=stop_s), now)

    def ended(self, node: str, now: float, credential: str | None = None) -> NodeStatus:
        """`node`'s agent stopped its workers and sent its last copies: its stop is over."""
        return self.rz.handle(JOB, LeaveRequest(v=1, node_id=node, stopped=True, stop_ended=True,
                                                credential=self.secrets[node] if credential is None else credential),
                              now)


def test_the_wait_for_a_stopped_member_counts_from_when_its_agent_says_its_stop_is_over():
    j = Job("abc")
    j.stop("b", 10.0)
    assert job(j.rz).last_call_deadline == pytest.approx(10.0 + STOP_S + WINDOW)     # as told: its stop's end
    assert j.ended("b", 12.0).accepted
    assert job(j.rz).last_call_deadline == pytest.approx(12.0 + WINDOW)
    assert bound(job(j.rz)) == pytest.approx(12.0 + 2 * WINDOW)         # a later loss moves it no further
    said = f"node b's agent ended: waiting up to {WINDOW:g}s for node b to come back"
    assert job(j.rz).reason.startswith(said) and last_event(j.rz, "round_waiting").startswith(said)
    j.heard("ac", 14.0, 12.0 + WINDOW)
    j.rz.tick(12.0 + WINDOW - 0.01)
    assert job(j.rz).round is None
    j.rz.tick(12.0 + WINDOW)
    assert members(j.rz) == ["a", "c"]
    assert f"node b not back within {WINDOW:g}s of its agent's end" in last_event(j.rz, "round_completed")


def test_its_next_agent_back_in_time_takes_its_place():
    j = Job("abc")
    j.stop("b", 10.0)
    j.ended("b", 11.0)
    j.join("b", 13.0, instance="b#2")
    assert members(j.rz) == ["a", "b", "c"] and job(j.rz).stops == {}


def test_an_agent_killed_in_its_stop_keeps_the_wait_it_told():
    j = Job("abc")
    j.stop("b", 10.0)
    j.heard("ac", 14.0, 30.0, 10.0 + STOP_S + WINDOW - 0.01)
    j.rz.tick(10.0 + STOP_S + WINDOW - 0.01)
    assert job(j.rz).round is None and job(j.rz).awaited == ["b"]


@pytest.mark.parametrize("credential", ["", "secret-of-someone-else"])
def test_only_the_nodes_own_credential_ends_its_stop(credential):
    j = Job("abc")
    j.stop("b", 10.0)
    assert not j.ended("b", 12.0, credential).accepted
    assert job(j.rz).last_call_deadline == pytest.approx(10.0 + STOP_S + WINDOW)
    j.ended("b", 13.0)        # its own agent's, later, still counts: the refusal changed nothing
    assert job(j.rz).last_call_deadline == pytest.approx(13.0 + WINDOW)


def test_another_members_credential_cannot_end_its_stop():
    j = Job("abc")
    j.stop("b", 10.0)
    assert not j.ended("b", 12.0, j.secrets["a"]).accepted
    assert job(j.rz).last_call_deadline == pytest.approx(10.0 + STOP_S + WINDOW)


def test_a_stop_is_ended_once_and_never_moves_the_wait_later():
    j = Job("abc")
    j.stop("b", 10.0, stop_s=2.0)
    assert not j.ended("b", 13.0).accepted       # past its told end: nothing to gain
    assert job(j.rz).last_call_deadline == pytest.approx(12.0 + WINDOW)
    j2 = Job("abc")
    j2.stop("b", 10.0)
    j2.ended("b", 12.0)
    assert not j2.ended("b", 11.0).accepted and job(j2.rz).last_call_deadline == pytest.approx(12.0 + WINDOW)


def test_a_member_still_in_its_own_stop_keeps_its_wait():
    cfg = JobConfig(min_nodes=2, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    j = Job("abcd", cfg)
    j.stop("b", 10.0)
    j.heard("acd", 10.5)
    j.stop("c", 11.0)
    j.ended("b", 12.0)          # c may still take its whole stop timeout
    assert job(j.rz).last_call_deadline == pytest.approx(11.0 + STOP_S + window_s(cfg))
    j.ended("c", 13.0)
    assert job(j.rz).last_call_deadline == pytest.approx(13.0 + window_s(cfg))


def test_a_stop_told_before_the_server_went_away_moves_with_the_wait_when_it_comes_back():
    j = Job("abc")
    j.stop("b", 10.0)
    j.rz.restored(100.0, 80.0, clean=True)       # back 80 s after it went: the wait's times move by that
    assert job(j.rz).last_call_deadline == pytest.approx(90.0 + STOP_S + WINDOW)
    j.ended("b", 95.0)
    assert job(j.rz).last_call_deadline == pytest.approx(95.0 + WINDOW)
    assert bound(job(j.rz)) == pytest.approx(95.0 + 2 * WINDOW)


def test_a_stop_over_while_the_job_waits_for_nodes_changes_nothing():
    j = Job("ab")                 # min 2: without b the job waits for nodes, no wait's end to move
    j.stop("b", 10.0)
    assert job(j.rz).awaited == ["b"] and job(j.rz).last_call_deadline is None
    assert not j.ended("b", 12.0).accepted
    assert job(j.rz).last_call_deadline is None and not job(j.rz).stops["b"].ended


def test_once_every_stop_ended_the_bound_counts_from_their_ends_not_the_first_ones_told_end():
    """Two members stopped one after the other, both over in a second: the wait's bound (what a member crashing as
    it starts, or one preparing, may hold the others to) counted from the first one's told --stop-timeout even
    once both said their stops were over, the second one's kept start being the wait's start as the first stop
    had moved it."""
    cfg = JobConfig(min_nodes=1, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    window = window_s(cfg)
    j = Job("abcd", cfg)
    j.stop("c", 10.0)
    j.heard("abd", 10.2)
    j.stop("b", 10.5)
    assert j.ended("c", 10.6).accepted
    assert job(j.rz).last_call_deadline == pytest.approx(10.5 + STOP_S + window)     # b's stop may still run
    assert j.ended("b", 11.0).accepted
    assert job(j.rz).last_call_deadline == pytest.approx(11.0 + window)
    assert bound(job(j.rz)) == pytest.approx(10.6 + 2 * window)      # before: c's told end, 40 + 2 windows
