"""The server link: every request's outcome becomes a fact; retries, replacement and polling rules."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from node_agent import server_link
from node_agent.agent import Agent
from node_agent.client.transport import ServerRejected, ServerUnreachable, Transport
from node_agent.core.facts import Fact, ServerNotReached, ServerRefused, StatusReceived
from node_agent.server_link import ServerLink
from protocol.bounds import MAX_POLL_WAIT_S, MAX_STOP_S
from protocol.errors import ErrorCode
from protocol.messages import (
    Assignment,
    FailureReport,
    JobConfig,
    JobState,
    JoinRequest,
    NodeState,
    NodeStatus,
    PollRequest,
    SuccessReport,
    WorkerFailure,
)

LIMIT = 10.0
STATUS = NodeStatus(job_id="j", job_state=JobState.RUNNING, node_state=NodeState.WAITING, round_id=-1,
                    restart_count=0)


class Scripted(Transport):
    """Answers each action from a script: an exception to raise, "hold" to never answer, else STATUS."""

    def __init__(self) -> None:
        super().__init__("n1")
        self.script: dict[str, list[object]] = {}
        self.sent: list[tuple[str, object]] = []
        self._sending = asyncio.Event()   # set (and replaced) at every request

    async def until_sent(self, count: int) -> list[str]:
        """The actions sent, once there are `count` of them."""
        while len(self.sent) < count:
            await asyncio.wait_for(self._sending.wait(), LIMIT)
        return [action for action, _ in self.sent]

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        self.sent.append((action, message))
        sending, self._sending = self._sending, asyncio.Event()
        sending.set()
        outcome = self.script.get(action, [])
        step = outcome.pop(0) if outcome else None
        if isinstance(step, Exception):
            raise step
        if step == "hold":
            await asyncio.Event().wait()
        if isinstance(step, asyncio.Event):      # answered once the test sets it
            await step.wait()
            self.sent.append((f"{action} answered", None))
        return step if isinstance(step, NodeStatus) else STATUS


class Clock:
    t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
async def link() -> AsyncIterator[tuple[ServerLink, Scripted, asyncio.Queue[Fact]]]:
    client = Scripted()
    facts: asyncio.Queue[Fact] = asyncio.Queue()
    made = ServerLink(client, facts.put_nowait, Clock(),
                      join=lambda: client.join(addr="a", host="h", local_world_size=1, master_port=1,
                                               config=JobConfig(), instance="i", role="default"),
                      poll=lambda wait_s: client.poll(-1, wait_s))
    yield made, client, facts
    await made.close()


async def next_fact(facts: asyncio.Queue[Fact]) -> Fact:
    return await asyncio.wait_for(facts.get(), LIMIT)


async def test_a_request_is_retried_while_unreachable_and_each_try_is_a_fact(link) -> None:
    sl, client, facts = link
    client.script["join"] = [ServerUnreachable("refused"), ServerUnreachable("timeout"), None]
    sl.rejoin()
    assert await next_fact(facts) == ServerNotReached(JoinRequest, "refused")
    assert await next_fact(facts) == ServerNotReached(JoinRequest, "timeout")
    answered = await next_fact(facts)
    assert isinstance(answered, StatusReceived) and answered.request is JoinRequest
    assert answered.status == STATUS and answered.sent_at == 3.0    # the third try's send time
    assert sl.joined


async def test_a_refusal_is_a_fact_and_ends_the_request(link) -> None:
    sl, client, facts = link
    client.script["failure"] = [ServerRejected("bad_request", "stale round")]
    sl.report_failure(3, (WorkerFailure(local_rank=0, rank=0, exitcode=1),))
    assert await next_fact(facts) == ServerRefused(FailureReport, "bad_request", "stale round")
    assert [a for a, _ in client.sent] == ["failure"]


async def test_polls_wait_for_the_join_and_a_rejoin_stops_them(link) -> None:
    sl, client, facts = link
    client.script["join"] = ["hold"]
    sl.rejoin()
    assert await client.until_sent(1) == ["join"]
    sl.keep_polling()                  # not joined yet: no poll
    assert PollRequest not in sl._tasks
    sl.rejoin()                        # the held join is replaced by a new one, which is answered
    assert (await next_fact(facts)).request is JoinRequest  # type: ignore[union-attr]
    client.script["poll"] = ["hold"]
    sl.keep_polling()
    poll = sl._tasks[PollRequest]
    sl.keep_polling()                  # one long-poll at a time
    assert sl._tasks[PollRequest] is poll
    assert await client.until_sent(3) == ["join", "join", "poll"]
    sl.rejoin()
    assert not sl.joined and (await next_fact(facts)).request is JoinRequest  # type: ignore[union-attr]
    assert facts.empty()               # the cancelled poll said nothing


def member_of(round_id: int) -> NodeStatus:
    a = Assignment(round_id=round_id, group_rank=0, group_world_size=2, rank_offset=0, world_size=2,
                   local_world_size=1, master_addr="a", master_port=1, restart_count=0, max_restarts=0)
    return NodeStatus(job_id="j", job_state=JobState.RUNNING, node_state=NodeState.MEMBER, round_id=round_id,
                      restart_count=0, assignment=a)


async def test_a_round_assigned_before_a_rejoin_is_not_what_its_witness_says_after(link) -> None:
    """A review: the server restarted without its state and numbered the job's rounds from 1 again; the link kept
    the old run's round 7 as "assigned", so this node, a witness in round 1, told a cut-off peer of round 1 that it
    held round 7 (newer: that peer fenced its workers, nothing having replaced its round)."""
    sl, client, facts = link
    client.script["join"] = [member_of(7), member_of(1)]
    sl.rejoin()
    assert (await next_fact(facts)).status.round_id == 7       # type: ignore[union-attr]
    sl.rejoin()                     # the server forgot the job: a join afresh, round ids from 1
    assert (await next_fact(facts)).status.round_id == 1       # type: ignore[union-attr]
    policy = SimpleNamespace(known_round=1)             # the policy runs round 1 now
    assert Agent._holds(SimpleNamespace(_link=sl, policy=policy)) == 1    # type: ignore[arg-type]


async def test_a_newer_report_replaces_one_still_trying(link) -> None:
    sl, client, facts = link
    client.script["success"] = ["hold", None]
    sl.report_success(1)
    await client.until_sent(1)
    sl.report_success(2)
    answered = await next_fact(facts)
    assert isinstance(answered, StatusReceived) and answered.request is SuccessReport
    assert [m.round_id for a, m in client.sent] == [1, 2] and facts.empty()  # type: ignore[attr-defined]


async def test_a_leave_waits_for_a_join_in_flight_so_the_node_it_admits_is_left_not_lost(link) -> None:
    # SIGTERM while the join is on its way: leaving at once would go without the node's credential
    # and be refused, the join would then admit a node nobody runs, and its lease would lapse as a loss.
    sl, client, facts = link
    answer = asyncio.Event()
    client.script["join"] = [answer]
    sl.rejoin()
    assert await client.until_sent(1) == ["join"]
    leaving = asyncio.create_task(sl.leave("bye"))
    for _ in range(20):                 # let the leave run as far as it can without the join's answer
        await asyncio.sleep(0)
    assert [action for action, _ in client.sent] == ["join"]
    answer.set()
    await asyncio.wait_for(leaving, LIMIT)
    assert [action for action, _ in client.sent] == ["join", "join answered", "leave"]


async def test_leave_is_a_courtesy_and_the_lease_is_kept_while_busy(link) -> None:
    sl, client, _ = link
    client.script["leave"] = [ServerUnreachable("refused")]
    assert await sl.leave("bye") is None      # no exception, no fact: the lease lapses anyway; no answer: None
    async with sl.lease_kept(0.01):
        await asyncio.sleep(0.1)             # (a wait for nothing to happen: a node that left renews no lease)
    assert not [a for a, _ in client.sent if a == "poll"]
    sl.joined = True                          # a member again, busy stopping its workers
    polled = asyncio.Event()
    client.script["poll"] = [ServerUnreachable("refused")]
    original = client._send

    async def noting(action: str, message: object, timeout: float) -> NodeStatus:
        if action == "poll":
            polled.set()
        return await original(action, message, timeout)

    client._send = noting  # type: ignore[method-assign]
    async with sl.lease_kept(0.01):
        await asyncio.wait_for(polled.wait(), LIMIT)   # a poll went out while we were "busy" ...
    # ... a held one (the loop's own, kept in flight): an agent killed while busy closes its connection, which the
    # server hears as a restart; killed between instant polls it fell silent, as a host gone
    assert [a for a, m in client.sent if a == "poll" and m.wait_s == MAX_POLL_WAIT_S]  # type: ignore[attr-defined]
    assert PollRequest in sl._tasks
    # the first goes out at once: the answer that made the agent busy may have ended a hold the lease ran through
    # (half of it gone), and under load the first interval could outlast the rest
    sl._cancel(PollRequest)
    polled.clear()
    async with sl.lease_kept(3600.0):
        await asyncio.wait_for(polled.wait(), LIMIT)


class Racing(Scripted):
    """Refuses a request carrying the secret `old` as forbidden; `rejoined` says whether a join's
    answer replaced the secret meanwhile (the race) or not (a real takeover)."""

    def __init__(self, rejoined: bool) -> None:
        super().__init__()
        self.credential, self.rejoined = "old", rejoined

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        self.sent.append((action, message))
        if getattr(message, "credential", "") == "old":
            if self.rejoined:
                self.credential = "new"
            raise ServerRejected("forbidden", "the credential is not node n1's")
        return STATUS


async def test_a_request_refused_for_a_secret_a_join_replaced_meanwhile_goes_again_with_the_new_one() -> None:
    # A report built before a rejoin's answer carries the old secret; the server, which made the node
    # afresh, refuses it as forbidden. That is not a takeover: the request goes again, once.
    client = Racing(rejoined=True)
    assert await client.report_success(3) == STATUS
    assert [m.credential for _, m in client.sent] == ["old", "new"]


async def test_a_request_refused_for_the_secret_still_held_is_a_takeover() -> None:
    client = Racing(rejoined=False)
    with pytest.raises(ServerRejected):
        await client.report_success(3)
    assert len(client.sent) == 1


async def test_prompt_polls_go_one_at_a_time_each_try_with_the_news_then(link) -> None:
    """poll_now (a snapshot's digests, a check passed): while one is unanswered (the server unreachable), more
    calls start no other; each of its tries asks for the news as they are then. Once answered, a new one goes."""
    sl, client, facts = link
    sl.rejoin()
    assert isinstance(await next_fact(facts), StatusReceived)
    answer = asyncio.Event()
    client.script["poll"] = [ServerUnreachable("refused"), answer]
    sl.poll_now()
    assert await next_fact(facts) == ServerNotReached(PollRequest, "refused")
    for _ in range(5):
        sl.poll_now()                    # the one trying carries these
    assert await client.until_sent(3) == ["join", "poll", "poll"]
    answer.set()
    assert isinstance(await next_fact(facts), StatusReceived)
    assert [a for a, _ in client.sent].count("poll") == 2
    sl.poll_now()
    assert (await client.until_sent(5))[-1] == "poll"


class Rejoining(Transport):
    """A server that made this node's record afresh: a report with the old secret is refused (FORBIDDEN) at once, the
    join's reply (the new secret) comes when the test lets it."""

    def __init__(self) -> None:
        super().__init__("n1")
        self.credential = "old"
        self.gate = asyncio.Event()
        self.refused = asyncio.Event()
        self.sent: list[tuple[str, str]] = []

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        self.sent.append((action, getattr(message, "credential", "")))
        if action == "join":
            await self.gate.wait()
            return NodeStatus(job_id="j", job_state=JobState.RUNNING, node_state=NodeState.WAITING, round_id=-1,
                              restart_count=0, credential="new")
        if getattr(message, "credential", "") != "new":
            self.refused.set()
            raise ServerRejected(ErrorCode.FORBIDDEN, "the credential is not node n1's: another agent joined with "
                                                      "this node id and took the node over (or the request is forged)")
        return STATUS


async def test_a_report_refused_before_the_rejoins_reply_is_sent_again_with_the_new_secret() -> None:
    """Seen end to end: an agent stopped (SIGSTOP) past its lease rejoins while reporting its workers' failure; the
    report's refusal came before the join's reply, and the agent took it for a takeover and stopped."""
    t = Rejoining()
    join = asyncio.create_task(t.join(addr="a", host="h", local_world_size=1, master_port=1, config=JobConfig(),
                                      instance="i", role="default"))
    report = asyncio.create_task(t.report_failure(1, [WorkerFailure(local_rank=0, rank=0, exitcode=1)]))
    await asyncio.wait_for(t.refused.wait(), LIMIT)
    assert not report.done()                   # waiting for the join's reply, not refused
    t.gate.set()
    await asyncio.wait_for(asyncio.gather(join, report), LIMIT)
    assert t.sent == [("join", "old"), ("failure", "old"), ("failure", "new")] and t.credential == "new"


async def test_a_refused_report_with_no_join_in_flight_is_a_takeover() -> None:
    t = Rejoining()
    with pytest.raises(ServerRejected):
        await t.report_failure(1, [WorkerFailure(local_rank=0, rank=0, exitcode=1)])


async def test_a_report_refused_between_two_tries_of_a_join_waits_for_its_answer() -> None:
    """A review found the wait covered one try: a join whose reply was lost is tried again after a pause, and a report
    refused in that pause was taken for a takeover. ServerLink holds `joining()` over all the tries."""
    t = Rejoining()
    async with t.joining():                    # the first try's reply was lost; the next not yet sent
        report = asyncio.create_task(t.report_failure(1, [WorkerFailure(local_rank=0, rank=0, exitcode=1)]))
        await asyncio.wait_for(t.refused.wait(), LIMIT)
        assert not report.done()
        t.gate.set()
        await t.join(addr="a", host="h", local_world_size=1, master_port=1, config=JobConfig(), instance="i",
                     role="default")
    await asyncio.wait_for(report, LIMIT)
    assert t.sent == [("failure", "old"), ("join", "old"), ("failure", "new")]


async def test_a_stopped_agents_leave_tells_its_snapshot_first_and_a_silent_server_holds_it_up_briefly(link,
                                                                                                   monkeypatch):
    """The note before a stopped agent's leave (its newest snapshot: awaiting.py's evidence) has NOTE_BEFORE_LEAVE_S:
    the workers' stop waits for it and the leave, inside a service manager's grace."""
    sl, client, _ = link
    monkeypatch.setattr(server_link, "NOTE_BEFORE_LEAVE_S", 0.05)
    client.script["poll"] = ["hold"]                  # a server that never answers the note
    assert await asyncio.wait_for(sl.leave("agent received SIGTERM", stopped=True, stop_timeout_s=30.0), LIMIT) \
        == STATUS.place_kept_s
    assert [a for a, _ in client.sent] == ["poll", "leave"]
    assert client.sent[-1][1].stopped                 # type: ignore[attr-defined]
    # how long its workers may take to stop: the job's wait counts from then, bounded by the wire's limit
    assert client.sent[-1][1].stop_timeout_s == 30.0  # type: ignore[attr-defined]
    await sl.leave("agent received SIGTERM", stopped=True, stop_timeout_s=86400.0)
    assert client.sent[-1][1].stop_timeout_s == MAX_STOP_S  # type: ignore[attr-defined]
    await sl.leave("its checks failed", stop_timeout_s=30.0)
    assert client.sent[-1][1].stop_timeout_s == 0.0  # type: ignore[attr-defined]
