"""One rule table for what a reply or a refusal means (node_agent/client/replies.py), run against both
clients of it: node-agent's policy (core/policy.py) and the torchrun plugin's session
(plugin/session.py, through a scripted transport; no server, no torch)."""
from __future__ import annotations

import asyncio
import time

import pytest

from node_agent.client.replies import News, Refusal, code_of, newer_assignment, news, refusal
from node_agent.client.transport import ServerRejected, Transport
from node_agent.core.actions import Exit, Leave, Rejoin, Spawn, StopWorkers
from node_agent.core.facts import ServerRefused, StatusReceived
from node_agent.core.policy import SupervisionPolicy, Workers
from node_agent.plugin.session import (
    JoinRefused,
    RequestRefused,
    ServerLost,
    ServerSession,
    needs_rendezvous,
    still_in_round,
)
from node_agent.plugin.settings import TorchLaunch, plugin_settings
from protocol.messages import (
    Assignment,
    FailureReport,
    JobState,
    JoinRequest,
    NodeState,
    NodeStatus,
    PollRequest,
    SuccessReport,
    WorkerFailure,
)

RUNNING = 3   # the round the node runs in every row


def view(node: NodeState = NodeState.MEMBER, round_id: int = RUNNING, job: JobState = JobState.RUNNING) -> NodeStatus:
    assignment = None
    if node is NodeState.MEMBER:
        assignment = Assignment(round_id=round_id, group_rank=0, group_world_size=2, rank_offset=0, world_size=2,
                                local_world_size=1, master_addr="127.0.0.1", master_port=1, restart_count=0,
                                max_restarts=0)
    return NodeStatus(job_id="j", job_state=job, node_state=node, round_id=round_id, restart_count=0,
                      assignment=assignment, reason="why")


REPLIES = [   # (the server's view of a node running round 3, what it means)
    (view(round_id=3), News.NONE),
    (view(round_id=2), News.NONE),                           # a late reply about an older round
    (view(round_id=4), News.NEW_ROUND),
    (view(NodeState.WAITING, round_id=-1), News.NOT_MEMBER),
    (view(NodeState.SPARE), News.NOT_MEMBER),
    (view(NodeState.EXCLUDED), News.NOT_MEMBER),
    (view(NodeState.GONE), News.REJOIN),
    (view(NodeState.GONE, job=JobState.SUCCEEDED), News.FINISHED),
    (view(NodeState.GONE, job=JobState.FAILED), News.FINISHED),
    (view(NodeState.GONE, job=JobState.CLOSED), News.FINISHED),
]


@pytest.mark.parametrize(("status", "meaning"), REPLIES)
def test_the_rule(status, meaning):
    assert news(status, RUNNING) is meaning
    assert (newer_assignment(status, RUNNING) is not None) == (meaning is News.NEW_ROUND)


def running_policy() -> SupervisionPolicy:
    p = SupervisionPolicy(server_wait_s=60.0)
    p.handle(StatusReceived(PollRequest, view(round_id=RUNNING), 0.0), 0.0)
    assert p.workers is Workers.RUNNING and p.running_round == RUNNING
    return p


AGENT_DOES = {   # what node-agent does with each meaning while it runs round 3
    News.NONE: [],
    News.NEW_ROUND: [StopWorkers, Spawn],
    News.NOT_MEMBER: [StopWorkers],
    News.REJOIN: [StopWorkers, Rejoin],
    News.FINISHED: [StopWorkers, Exit],
}


@pytest.mark.parametrize(("status", "meaning"), REPLIES)
def test_node_agent_follows_the_rule(status, meaning):
    actions = running_policy().handle(StatusReceived(PollRequest, status, 1.0), 1.0)
    assert [type(a) for a in actions] == AGENT_DOES[meaning]


@pytest.mark.parametrize(("status", "meaning"), REPLIES)
def test_the_plugin_follows_the_rule(status, meaning):
    restart = meaning in (News.NEW_ROUND, News.NOT_MEMBER, News.REJOIN) or (
        meaning is News.FINISHED and status.job_state is not JobState.SUCCEEDED)
    assert needs_rendezvous(status, RUNNING) == restart
    assert still_in_round(status, RUNNING) == (meaning is News.NONE and status.round_id == RUNNING)


REFUSALS = [   # (request, code, what it means)
    (JoinRequest, "node_conflict", Refusal.CONFLICT),
    (JoinRequest, "node_drained", Refusal.DRAINED),
    (JoinRequest, "run_succeeded", Refusal.RAN),
    (JoinRequest, "job_finished", Refusal.JOIN_REFUSED),
    (JoinRequest, "config_conflict", Refusal.JOIN_REFUSED),
    (JoinRequest, "unauthorized", Refusal.UNAUTHORIZED),
    (JoinRequest, "tls_untrusted", Refusal.UNAUTHORIZED),
    (JoinRequest, "not_rdzv_server", Refusal.NOT_A_SERVER),
    (PollRequest, "not_rdzv_server", Refusal.NOT_A_SERVER),
    (PollRequest, "unknown_job", Refusal.FORGOTTEN),
    (PollRequest, "unknown_node", Refusal.FORGOTTEN),
    (PollRequest, "forbidden", Refusal.TAKEN_OVER),
    (PollRequest, "job_finished", Refusal.POLL_REFUSED),
    (PollRequest, "bad_request", Refusal.INVALID),
    (PollRequest, "unauthorized", Refusal.UNAUTHORIZED),
    (FailureReport, "forbidden", Refusal.TAKEN_OVER),
    (FailureReport, "job_finished", Refusal.DROPPED),
    (FailureReport, "bad_request", Refusal.INVALID),
    (FailureReport, "unsupported_version", Refusal.INVALID),
    (SuccessReport, "too_large", Refusal.INVALID),
    (SuccessReport, "unknown_node", Refusal.DROPPED),
    (JoinRequest, "bad_request", Refusal.JOIN_REFUSED),
]


@pytest.mark.parametrize(("request_type", "code", "meaning"), REFUSALS)
def test_the_refusal_rule(request_type, code, meaning):
    assert refusal(code_of(code), request_type) is meaning


AGENT_ENDS = {   # the agent's exit status per meaning (None: it goes on)
    Refusal.FORGOTTEN: None, Refusal.CONFLICT: None, Refusal.DROPPED: None, Refusal.DRAINED: 0, Refusal.RAN: 0,
    Refusal.TAKEN_OVER: 1, Refusal.UNAUTHORIZED: 1, Refusal.NOT_A_SERVER: 1, Refusal.JOIN_REFUSED: 1,
    Refusal.POLL_REFUSED: 1, Refusal.INVALID: 1,
}


@pytest.mark.parametrize(("request_type", "code", "meaning"), REFUSALS)
def test_node_agent_follows_the_refusal_rule(request_type, code, meaning):
    actions = running_policy().handle(ServerRefused(request_type, code, "no"), 1.0)
    exits = [a.code for a in actions if isinstance(a, Exit)]
    assert exits == ([] if AGENT_ENDS[meaning] is None else [AGENT_ENDS[meaning]])
    assert any(isinstance(a, Rejoin) for a in actions) == (meaning is Refusal.FORGOTTEN)
    assert any(isinstance(a, Leave) for a in actions) == (meaning is Refusal.INVALID)   # the others go on


class Refusing(Transport):
    """Refuses the first request of kind `refuse` with `code`; answers the rest as a server would. A
    join answers round 3 the first time and round 4 after; a poll is held while it has nothing new to
    say: round 4 once the refusal has happened, round 3 before."""

    def __init__(self, refuse: str, code: str) -> None:
        super().__init__("a")
        self.refuse, self.code = refuse, code
        self.refused = False
        self.joins = 0
        self.news: asyncio.Event | None = None

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        if self.news is None:
            self.news = asyncio.Event()
        if action == self.refuse and not self.refused:
            self.refused = True
            self.news.set()
            raise ServerRejected(self.code, "no")
        if action == "join":
            self.joins += 1
            return view(round_id=RUNNING if self.joins == 1 else RUNNING + 1)
        if action == "poll":
            while True:      # held until there is news for the round the poll says it runs
                now = view(round_id=RUNNING + 1 if self.refused and self.refuse != "join" else RUNNING)
                if isinstance(message, PollRequest) and message.known_round != now.round_id:
                    return now
                self.news.clear()
                await self.news.wait()
        return view(round_id=RUNNING + 1) if self.refused else view(round_id=RUNNING)


PLUGIN_ENDS = {   # the plugin's next round after the refusal: a round (4, or 3 after a join retried), or how it ends
    Refusal.FORGOTTEN: 4, Refusal.CONFLICT: 3, Refusal.DROPPED: 4, Refusal.DRAINED: JoinRefused,
    Refusal.JOIN_REFUSED: JoinRefused, Refusal.TAKEN_OVER: ServerLost, Refusal.POLL_REFUSED: ServerLost,
    Refusal.INVALID: RequestRefused,
}


@pytest.mark.parametrize(("request_type", "code", "meaning"),
                         [r for r in REFUSALS if r[0] is not SuccessReport])
def test_the_plugin_follows_the_refusal_rule(request_type, code, meaning):
    refuse = {JoinRequest: "join", PollRequest: "poll", FailureReport: "failure"}[request_type]
    said: list[str] = []
    settings = plugin_settings(endpoint="127.0.0.1:1", run_id="j", min_nodes=1, max_nodes=2, local_addr="127.0.0.1",
                               launch=TorchLaunch(local_world_size=1, max_restarts=0),
                               conf={"node_id": "a", "lease_timeout": "1"})
    session = ServerSession(settings, Refusing(refuse, code), master_port=1, say=said.append)
    session.start()
    expected = PLUGIN_ENDS.get(meaning, JoinRefused if refuse == "join" else ServerLost)
    failures = [WorkerFailure(local_rank=0, rank=0, exitcode=1)]
    try:
        def next_round() -> int:
            if refuse == "join":
                return session.next_assignment(-1, None).round_id
            assert session.next_assignment(-1, None).round_id == RUNNING
            return session.next_assignment(RUNNING, failures if refuse == "failure" else None).round_id

        if isinstance(expected, int):
            assert next_round() == expected
        else:
            with pytest.raises(expected):
                next_round()
        assert any("refused the failure report" in line for line in said) == (meaning is Refusal.DROPPED)
    finally:
        session.close()


class Forgetting(Transport):
    """A server without a store that restarts under a running job: the first join is answered with round 7, the
    first poll is refused as `unknown_job`, and the join after it with round 1 (the job's rounds numbered afresh);
    later polls are held until the test ends."""

    def __init__(self) -> None:
        super().__init__("a")
        self.joins = 0
        self.forgot = False

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        if action == "join":
            self.joins += 1
            return view(round_id=7 if self.joins == 1 else 1)
        if action == "poll" and not self.forgot:
            self.forgot = True
            raise ServerRejected("unknown_job", "no such job: the server restarted without its state")
        await asyncio.Event().wait()         # held: nothing new
        raise AssertionError("unreachable")


def test_the_plugin_takes_a_forgetful_servers_new_round_1_after_its_round_7():
    """A review: after a server without a store restarted, the plugin rejoined and the new run of the job formed
    round 1 with it. Torch's round 7 was not seen as over (round 1 is no "newer" news), torch's ask for a round
    after 7 ignored round 1 and waited for ever, and its witness still said round 7 (newer than a cut-off peer's
    round 1: that peer would fence)."""
    settings = plugin_settings(endpoint="127.0.0.1:1", run_id="j", min_nodes=1, max_nodes=2, local_addr="127.0.0.1",
                               launch=TorchLaunch(local_world_size=1, max_restarts=0),
                               conf={"node_id": "a", "lease_timeout": "1"})
    transport = Forgetting()
    session = ServerSession(settings, transport, master_port=1, say=lambda line: None)
    session.start()
    try:
        assert session.next_assignment(-1, None).round_id == 7
        deadline = time.monotonic() + 10.0
        while not (transport.joins == 2 and session.view is not None and session.view.round_id == 1):
            assert time.monotonic() < deadline, "no rejoin after the refusal"
            time.sleep(0.01)
        assert session._running == -1 and session.rejoined     # the witness says no round; torch must restart
        assigned = session._call(asyncio.wait_for(session._next_assignment(7, None), 10.0))
        assert assigned.round_id == 1 and transport.joins == 2
        assert session._running == 1 and not session.rejoined
    finally:
        session.close()
