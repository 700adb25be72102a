"""Hypothesis fuzzes every route of the real app (in-process, with its durable store), mixed with
valid traffic from the nodes of a job it controls.

Each step is either a valid request of one of those nodes (answered 200), or a hostile one: a
mutated agent request, an admin action, a status view, or any route under the wrong method (see
requests.py, operator_requests.py). For every reply: never a 5xx, an error body naming what was
wrong (oracle.py), and when the request was refused, the server's jobs exactly as they were
before it (the watched jobs compared whole, every other job by id). When the server hands out node
credentials, a request naming a live node without that node's credential must be refused.

Bounded for `make test`: a few thousand requests. `make fuzz` (tests/fuzz/soak.py) runs 100,000+.
"""
from __future__ import annotations

import itertools
import logging
import secrets
from collections import Counter
from dataclasses import replace

import msgpack
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from rdzv_server.core.records import JobRecord
from tests.fuzz import oracle, payloads
from tests.fuzz.inprocess import ServerThread, differences
from tests.fuzz.known_issues import known, known_log
from tests.fuzz.operator_requests import admin_request, method_request, view_request
from tests.fuzz.rawhttp import Connection, NoReply, Reply
from tests.fuzz.requests import MSGPACK, Context, Node, Request, agent_request, own_instance_join, valid_body

JOB_NUMBERS = itertools.count(1)



def lost_reply_rejoin(request: Request, job: JobRecord) -> bool:
    """A join without the secret from the node's own agent instance, before any request used the
    secret: the rule for a join whose reply was lost (docs/protocol.md, join), not a forgery."""
    record = job.nodes.get(request.node_id or "")
    return (record is not None and not record.credential_used
            and own_instance_join(request, Node(record.node_id, record.instance, None)))


class RouteFuzzer(RuleBasedStateMachine):
    server: ServerThread          # set by the test
    sent: Counter[str] = Counter()   # requests by route, over every run of the machine

    def __init__(self) -> None:
        super().__init__()
        self.conn = Connection("127.0.0.1", self.server.port, timeout=20.0)
        self.authority = f"127.0.0.1:{self.server.port}"
        self.watched: list[str] = []
        self.ctx = self.new_job()

    def teardown(self) -> None:
        self.conn.close()

    # -- the controlled job and its valid traffic --
    def send(self, request: Request) -> Reply:
        self.sent[request.route] += 1
        try:
            return self.conn.send(request.to_bytes(), head=request.method == "HEAD")
        except NoReply as exc:
            raise AssertionError(f"no reply ({exc}) to {request.describe()}") from None

    def valid(self, action: str, node: Node) -> dict:
        body = valid_body(self.ctx, action, node)
        request = Request("POST", f"/v1/jobs/{self.ctx.job_id}/{action}", (("Content-Type", MSGPACK),),
                          payloads.packb(body), f"valid.{action}", "agent", self.ctx.job_id, node.node_id,
                          action, host=self.authority)
        reply = self.send(request)
        status = oracle.agent_status(reply)
        assert reply.status == 200 and status is not None, (request.describe(), reply.status, reply.body[:300])
        return status

    def new_job(self) -> Context:
        """A job of 3 nodes (2 members, a spare) whose timers never fire while the test runs."""
        job_id = f"fuzz-{next(JOB_NUMBERS)}"
        self.watched.append(job_id)
        self.ctx = Context(self.authority, job_id, ())
        nodes = []
        for name in ("node-a", "node-b", "node-c"):
            node = Node(name, secrets.token_hex(6), None)
            status = self.valid("join", node)
            nodes.append(replace(node, credential=status.get("credential")))
            self.ctx = replace(self.ctx, nodes=tuple(nodes), round_id=status["round_id"])
        return self.ctx

    def refresh(self) -> None:
        """Follow the controlled job; start another when requests finished it or took a node out."""
        job = self.server.job(self.ctx.job_id)
        ours = {n.node_id: n.instance for n in self.ctx.nodes}
        if job is None or job.state.finished or {k: v.instance for k, v in job.nodes.items()} != ours:
            self.new_job()
        else:
            self.ctx = replace(self.ctx, round_id=job.round.round_id if job.round else -1)

    @property
    def credentials(self) -> bool:
        return any(n.credential for n in self.ctx.nodes)

    @rule(data=st.data())
    def valid_traffic(self, data: st.DataObject) -> None:
        self.refresh()
        node = data.draw(st.sampled_from(self.ctx.nodes))
        action = data.draw(st.sampled_from(["poll", "poll", "join", "failure", "success"]))
        status = self.valid(action, node)
        assert status["node_state"] != "gone" or status["job_state"] in ("succeeded", "failed", "closed"), status

    # -- hostile requests --
    def fire(self, request: Request) -> None:
        before = self.server.snapshot(self.watched)
        job = self.server.job(request.job_id) if request.job_id and request.node_id else None
        live = job is not None and not job.state.finished and request.node_id in job.nodes
        rejoin = live and lost_reply_rejoin(request, job)
        reply = self.send(request)
        found = oracle.problems(request, reply)
        if reply.status >= 300:
            changed = differences(before, self.server.snapshot(self.watched))
            if changed:
                found.append(f"refused but changed the state: {changed}")
        if self.credentials and request.forged and live and not rejoin and reply.status < 400:
            found.append("forged request accepted")
        fresh = msgpack.unpackb(reply.body).get("credential") if rejoin and reply.status < 300 else None
        if fresh:                              # the node's secret went to this join: the valid traffic follows it
            self.ctx = replace(self.ctx, nodes=tuple(replace(n, credential=fresh) if n.node_id == request.node_id
                                                     else n for n in self.ctx.nodes))
        for problem in found:
            issue = known(request, reply, problem)
            if issue is not None:
                event(f"known issue: {issue}")
                continue
            raise AssertionError(f"{problem}; reply {reply.status} {reply.body[:300]!r} to {request.describe()}")

    @rule(data=st.data())
    def hostile_agent_request(self, data: st.DataObject) -> None:
        self.refresh()
        self.fire(data.draw(agent_request(self.ctx)))

    @rule(data=st.data())
    def hostile_admin_request(self, data: st.DataObject) -> None:
        self.refresh()
        self.fire(data.draw(admin_request(self.ctx)))

    @rule(data=st.data())
    def hostile_view_request(self, data: st.DataObject) -> None:
        self.refresh()
        self.fire(data.draw(view_request(self.ctx)))

    @rule(data=st.data())
    def wrong_method(self, data: st.DataObject) -> None:
        self.refresh()
        self.fire(data.draw(method_request(self.ctx)))


def test_every_route_survives_hostile_requests_mixed_with_valid_traffic(server, caplog):
    caplog.set_level(logging.INFO, logger="rdzv_server")
    RouteFuzzer.server = server
    RouteFuzzer.sent = Counter()
    run_state_machine_as_test(RouteFuzzer, settings=settings(
        max_examples=100, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]))
    errors = [r.getMessage() + "\n" + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
              for r in caplog.records if r.name == "rdzv_server" and r.levelno >= logging.ERROR]
    bugs = [text for text in errors if known_log(text) is None]
    assert not bugs, bugs[:3]
    sent = RouteFuzzer.sent
    assert sum(sent.values()) >= 2000 and all(sent[route] for route in ("agent", "admin", "view", "health")), sent
