"""`GET /metrics` of the real app on loopback, after scripted agent traffic over MessagePack.

The coordinator runs on a hand-driven clock, so the times the core measures (round formation,
failure to next round) are exact and the histograms can be checked bucket by bucket. A lease
lapses by moving that clock; the next request re-arms the deadline timer, which then ticks.
"""
from __future__ import annotations

import asyncio

import aiohttp
import msgpack
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from protocol.messages import JobState, NodeState
from rdzv_server.coordinator import Coordinator
from rdzv_server.store.sqlite import SqliteStore
from rdzv_server.web import metrics
from rdzv_server.web.app import COORDINATOR, create_app
from rdzv_server.web.metrics import CAUSES
from tests.integration.support import FixedLag, remember_credential, start_app, url, wait_until, with_credential

MSGPACK = {"Content-Type": "application/msgpack"}
T0 = 1000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


async def start(coordinator: Coordinator) -> TestServer:
    return await start_app(create_app(coordinator))


@pytest.fixture
async def server(clock):
    srv = await start(Coordinator(clock=clock, loop_lag=FixedLag(0.0)))
    try:
        yield srv
    finally:
        await srv.close()


class Node:
    """An agent written against the wire only (plain msgpack dicts)."""

    def __init__(self, http, server, job, node_id, instance="1", **config):
        self.http, self.server, self.job, self.node_id = http, server, job, node_id
        self.instance, self.config = instance, config

    async def post(self, action: str, body: dict) -> dict:
        body = with_credential(self.server, self.job, {"v": 1, "node_id": self.node_id, **body})
        async with self.http.post(url(self.server, f"/v1/jobs/{self.job}/{action}"), data=msgpack.packb(body),
                                  headers=MSGPACK) as resp:
            reply = msgpack.unpackb(await resp.read())
            assert resp.status == 200, reply
            remember_credential(self.server, self.job, self.node_id, reply)
            return reply

    async def join(self) -> dict:
        return await self.post("join", {"addr": "10.0.0.1", "local_world_size": 2, "master_port": 1234,
                                        "instance": self.instance, "config": self.config})

    async def poll(self, known_round: int, wait_s: float = 5.0) -> dict:
        return await self.post("poll", {"known_round": known_round, "wait_s": wait_s})

    async def fail(self, round_id: int, *failures: dict) -> dict:
        return await self.post("failure", {"round_id": round_id, "failures": list(failures)})


class Scrape:
    """One parsed /metrics answer: `s["name", label=value, ...]` is a sample's value (KeyError if absent)."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def __getitem__(self, key) -> float:
        name, labels = (key, {}) if isinstance(key, str) else (key[0], key[1])
        return self.samples[(name, frozenset(labels.items()))]

    def labels_of(self, name: str, label: str) -> set[str]:
        return {dict(k)[label] for n, k in self.samples if n == name}


async def scrape(http, server) -> Scrape:
    async with http.get(url(server, "/metrics")) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
        return Scrape(await resp.text())


def http_count(s: Scrape, route: str, method: str, status: int) -> float:
    return s["rdzv_http_requests_total", {"route": route, "method": method, "status": str(status)}]


def failure(rank: int, timestamp: float, reason: str = "exited") -> dict:
    return {"local_rank": rank, "rank": rank, "exitcode": 1, "reason": reason, "timestamp": timestamp}


async def test_join_failure_lease_lapse_and_rejoin_are_counted_exactly(server, http, clock):
    cfg = dict(min_nodes=2, max_nodes=2, max_restarts=3, lease_timeout_s=10)
    a, b = Node(http, server, "m", "a", **cfg), Node(http, server, "m", "b", **cfg)
    assert (await a.join())["node_state"] == "waiting"
    clock.now = T0 + 0.5
    round1 = (await b.join())["assignment"]["round_id"]                  # start round, formed in 0.5 s
    clock.now = T0 + 1.0
    # Two workers of b failed, the first 0.25 s ago: one restart, two worker failures.
    reply = await b.fail(round1, failure(1, T0 + 0.9, "hang"), failure(0, T0 + 0.75))
    assert reply["restart_count"] == 1 and reply["round_id"] == round1 + 1
    for t in (5.0, 9.5):       # b is heard from, a is not (no silence of the server's own just before a's lease ends)
        clock.now = T0 + t
        await b.poll(known_round=round1 + 1, wait_s=0)
    clock.now = T0 + 10.5                                               # a's lease (until T0+10) lapsed
    server.app[COORDINATOR].clock_moved()
    woken = await b.poll(known_round=round1 + 1)                        # re-arms the timer: a is lost
    assert woken["node_state"] == "waiting" and woken["job_state"] == "waiting"

    s = await scrape(http, server)
    assert s["rdzv_jobs", {"state": "waiting"}] == 1 and s["rdzv_jobs", {"state": "running"}] == 0
    assert s["rdzv_nodes", {"state": "waiting"}] == 1 and s["rdzv_nodes", {"state": "member"}] == 0
    assert s["rdzv_nodes_lost_total"] == 1
    assert s["rdzv_failure_to_round_seconds_count", {"cause": "node_lost"}] == 0  # no round formed for it

    clock.now = T0 + 12.0
    assert (await Node(http, server, "m", "a", instance="2", **cfg).join())["node_state"] == "member"
    async with http.get(url(server, "/nope")) as resp:
        assert resp.status == 404
    async with http.get(url(server, "/v1/jobs/ghost")) as resp:
        assert resp.status == 404

    s = await scrape(http, server)
    assert s["rdzv_jobs", {"state": "running"}] == 1
    assert {st: s["rdzv_jobs", {"state": st.value}] for st in JobState if st != JobState.RUNNING} == \
        {st: 0 for st in JobState if st != JobState.RUNNING}
    assert s.labels_of("rdzv_nodes", "state") == {st.value for st in NodeState} - {"gone"}
    assert s["rdzv_nodes", {"state": "member"}] == 2 and s["rdzv_nodes", {"state": "waiting"}] == 0
    assert {c: s["rdzv_rounds_total", {"cause": c}] for c in CAUSES} == \
        {c: (1 if c in ("start", "failure", "scale_up") else 0) for c in CAUSES}
    assert s["rdzv_restarts_total"] == 1
    assert s["rdzv_worker_failures_total", {"reason": "exited"}] == 1
    assert s["rdzv_worker_failures_total", {"reason": "hang"}] == 1
    assert s["rdzv_worker_failures_total", {"reason": "other"}] == 0
    assert s["rdzv_nodes_lost_total"] == 1
    assert s["rdzv_open_long_polls"] == 0
    assert s["rdzv_deadline_wakeups_total"] >= 1       # a lease lost: the timer woke for it
    # Formation: 0.5 s (start), 0 s (failure: at once), 1.5 s (a lost at T0+10.5, back at T0+12).
    assert s["rdzv_round_formation_seconds_count"] == 3 and s["rdzv_round_formation_seconds_sum"] == 2.0
    formation = {le: s["rdzv_round_formation_seconds_bucket", {"le": le}] for le in ("0.001", "0.5", "1.0", "2.5")}
    assert formation == {"0.001": 1, "0.5": 2, "1.0": 2, "2.5": 3}
    recovery = {"cause": "failure"}
    assert s["rdzv_failure_to_round_seconds_count", recovery] == 1
    assert s["rdzv_failure_to_round_seconds_sum", recovery] == 0.25    # from the first failure in time
    assert s["rdzv_failure_to_round_seconds_bucket", {**recovery, "le": "0.1"}] == 0
    assert s["rdzv_failure_to_round_seconds_bucket", {**recovery, "le": "0.25"}] == 1
    # Requests, by route template (the action filled in), never by raw path.
    assert http_count(s, "/v1/jobs/{job_id}/join", "POST", 200) == 3
    assert http_count(s, "/v1/jobs/{job_id}/failure", "POST", 200) == 1
    assert http_count(s, "/v1/jobs/{job_id}/poll", "POST", 200) == 3       # b healthy twice, then b woken
    assert http_count(s, "/metrics", "GET", 200) == 1                   # this scrape is counted after it
    assert http_count(s, "unmatched", "GET", 404) == 1
    assert http_count(s, "/v1/jobs/{job_id}", "GET", 404) == 1
    join = {"route": "/v1/jobs/{job_id}/join", "method": "POST", "status": "200"}
    assert s["rdzv_http_request_duration_seconds_count", join] == 3
    assert s["rdzv_http_request_duration_seconds_bucket", {**join, "le": "+Inf"}] == 3
    assert s.labels_of("rdzv_http_requests_total", "route") == {
        "/v1/jobs/{job_id}/join", "/v1/jobs/{job_id}/failure", "/v1/jobs/{job_id}/poll", "/metrics",
        "unmatched", "/v1/jobs/{job_id}"}
    for family in s.families.values():
        assert family.name.startswith("rdzv_") and family.documentation, family.name


async def test_lost_member_forms_a_round_timed_from_its_last_contact(server, http, clock):
    cfg = dict(min_nodes=1, max_nodes=2, last_call_s=0, lease_timeout_s=10)
    a, b = Node(http, server, "n", "a", **cfg), Node(http, server, "n", "b", **cfg)
    await a.join()                                                      # start: a alone
    round2 = (await b.join())["assignment"]["round_id"]                # scale_up: a and b
    coord = server.app[COORDINATOR]
    async with aiohttp.ClientSession() as doomed:                       # b's long-poll, then b dies
        poll = asyncio.create_task(Node(doomed, server, "n", "b").poll(known_round=round2))
        await wait_until(lambda: coord.hub.open == 1)
        s = await scrape(http, server)
        assert s["rdzv_open_long_polls"] == 1
        poll.cancel()
    # No event announces that the server saw the connection close; the handler's unwinding (and
    # so the middleware's count) is complete once the core marked the node dropped.
    await wait_until(lambda: coord.core.jobs["n"].nodes["b"].dropped)
    clock.now = T0 + 1.5                                                # past the 1 s reconnect grace
    coord.clock_moved()
    woken = await a.poll(known_round=round2)
    assert woken["round_id"] == round2 + 1 and woken["assignment"]["world_size"] == 2
    s = await scrape(http, server)
    assert {c: s["rdzv_rounds_total", {"cause": c}] for c in ("start", "scale_up", "node_lost", "failure")} == \
        {"start": 1, "scale_up": 1, "node_lost": 1, "failure": 0}
    assert s["rdzv_nodes_lost_total"] == 1 and s["rdzv_restarts_total"] == 0
    lost = {"cause": "node_lost"}
    assert s["rdzv_failure_to_round_seconds_count", lost] == 1
    assert s["rdzv_failure_to_round_seconds_sum", lost] == 1.5         # b's last contact was at T0
    assert s["rdzv_failure_to_round_seconds_bucket", {**lost, "le": "1.0"}] == 0
    assert s["rdzv_failure_to_round_seconds_bucket", {**lost, "le": "2.5"}] == 1
    assert http_count(s, "/v1/jobs/{job_id}/poll", "POST", 499) == 1    # b's abandoned poll
    assert http_count(s, "/v1/jobs/{job_id}/poll", "POST", 200) == 1
    assert s["rdzv_nodes", {"state": "member"}] == 1 and s["rdzv_open_long_polls"] == 0


async def test_failure_past_the_budget_fails_the_job_without_counting_a_restart(server, http):
    a = Node(http, server, "f", "a", min_nodes=1, max_nodes=1, max_restarts=0)
    round1 = (await a.join())["assignment"]["round_id"]
    reply = await a.fail(round1, failure(0, T0))
    assert reply["job_state"] == "failed"
    s = await scrape(http, server)
    assert s["rdzv_restarts_total"] == 0 and s["rdzv_worker_failures_total", {"reason": "exited"}] == 1
    assert s["rdzv_jobs", {"state": "failed"}] == 1 and s["rdzv_jobs", {"state": "running"}] == 0
    assert s["rdzv_rounds_total", {"cause": "failure"}] == 0
    assert all(s["rdzv_nodes", {"state": st.value}] == 0 for st in NodeState if st != NodeState.GONE)


async def test_a_restarted_server_counts_only_its_own_restarts(tmp_path, http, clock):
    cfg = dict(min_nodes=1, max_nodes=1, max_restarts=5)
    first = await start(Coordinator(clock=clock, store=SqliteStore(str(tmp_path)), loop_lag=FixedLag(0.0)))
    try:
        a = Node(http, first, "r", "a", **cfg)
        round1 = (await a.join())["assignment"]["round_id"]
        assert (await a.fail(round1, failure(0, T0)))["restart_count"] == 1
        assert (await scrape(http, first))["rdzv_restarts_total"] == 1
    finally:
        await first.close()
    clock.now = T0 + 5
    second = await start(Coordinator(clock=clock, store=SqliteStore(str(tmp_path)), loop_lag=FixedLag(0.0)))
    try:
        a = Node(http, second, "r", "a", **cfg)
        round2 = (await a.poll(known_round=-1))["round_id"]
        assert (await a.fail(round2, failure(0, T0 + 5, "custom")))["restart_count"] == 2
        s = await scrape(http, second)
        assert s["rdzv_restarts_total"] == 1                            # not 2: restart 1 was the first run's
        assert s["rdzv_worker_failures_total", {"reason": "other"}] == 1
        assert s["rdzv_rounds_total", {"cause": "failure"}] == 1
    finally:
        await second.close()


def note(round_id: int, steps: int, first: float, last: float) -> dict:
    """A progress note as an agent sends it on its polls: 20 steps in the last 10 s (2 steps per second)."""
    return {"round_id": round_id, "probes": 2, "steps": steps, "first_step_at": first, "last_step_at": last,
            "window_s": 10.0, "window_steps": 20, "demand": 0.5}


async def test_each_job_has_its_progress_and_hangs_are_counted(server, http, clock):
    cfg = dict(min_nodes=2, max_nodes=2, max_restarts=3, last_call_s=0, lease_timeout_s=1000)
    a, b = Node(http, server, "g", "a", **cfg), Node(http, server, "g", "b", **cfg)
    await a.join()
    first = (await b.join())["assignment"]["round_id"]
    await Node(http, server, "quiet", "q", min_nodes=1, max_nodes=1, lease_timeout_s=1000).join()  # never steps
    clock.now = T0 + 50
    for node in (a, b):
        await node.post("poll", {"known_round": first, "wait_s": 0, "progress": note(first, 100, T0 + 1, T0 + 50)})
    s = await scrape(http, server)
    assert s["rdzv_job_steps", {"job": "g"}] == 100 and s["rdzv_job_steps_per_second", {"job": "g"}] == 2.0
    assert s["rdzv_job_effective_training_ratio", {"job": "g"}] == 1.0
    assert s["rdzv_job_restart_lost_seconds", {"job": "g"}] == 0
    # a job that never stepped has no progress series (no signal is not 0 steps/s), only its slow-node count
    assert s.labels_of("rdzv_job_steps", "job") == s.labels_of("rdzv_job_effective_training_ratio", "job") == {"g"}
    assert s["rdzv_slow_nodes", {"job": "g"}] == 0 and s["rdzv_slow_nodes", {"job": "quiet"}] == 0
    assert s["rdzv_hangs_total"] == 0 and s["rdzv_job_series_omitted"] == 0

    # a hangs: its ranks wait on b's rank 3, which sits idle; the round is failed for it (a restart)
    ranks = {n.node_id: (await n.poll(known_round=first, wait_s=0))["assignment"]["rank_offset"] for n in (a, b)}
    clock.now = T0 + 51
    for node, state in ((a, "waiting"), (b, "stopped")):
        offset = ranks[node.node_id]
        seen = [{"rank": offset, "local_rank": 0, "state": "waiting", "stalled_s": 6.0, "steps": 100},
                {"rank": offset + 1, "local_rank": 1, "state": state, "stalled_s": 6.0, "steps": 100}]
        reply = await node.post("stall", {"round_id": first, "threshold_s": 5.0, "ranks": seen})
    assert reply["round_id"] == first + 1
    clock.now = T0 + 61
    for node in (a, b):          # the new round's first step at T0+61: the restart cost 11 s, b's 9 s in a restore
        phases = {"rank": 3, "stop": 1.0, "restore": 9.0, "first_step": 1.0} if node is b else None
        await node.post("poll", {"known_round": first + 1, "wait_s": 0,
                                 "progress": {**note(first + 1, 10, T0 + 61, T0 + 70), "anatomy": phases}})
    clock.now = T0 + 101
    s = await scrape(http, server)
    assert s["rdzv_hangs_total"] == 1 and s["rdzv_rounds_total", {"cause": "hang"}] == 1
    assert s["rdzv_failure_to_round_seconds_count", {"cause": "hang"}] == 1
    assert s["rdzv_job_steps", {"job": "g"}] == 110
    assert s["rdzv_job_restart_lost_seconds", {"job": "g"}] == 11.0
    assert s["rdzv_job_restart_phase_seconds", {"job": "g", "phase": "restore"}] == 9.0
    assert s["rdzv_job_restart_phase_seconds", {"job": "g", "phase": "cuda"}] == 0.0
    assert s["rdzv_job_effective_training_ratio", {"job": "g"}] == pytest.approx((100 - 11) / 100, abs=1e-4)
    for family in s.families.values():
        assert family.name.startswith("rdzv_") and family.documentation, family.name


async def test_per_job_series_are_capped(server, http, clock, monkeypatch):
    monkeypatch.setattr(metrics, "MAX_JOB_SERIES", 2)
    for job in ("c", "a", "d", "b"):
        await Node(http, server, job, "n", min_nodes=1, max_nodes=1).join()
    s = await scrape(http, server)
    assert s.labels_of("rdzv_slow_nodes", "job") == {"a", "b"}        # the first by id, so series never flap
    assert s["rdzv_job_series_omitted"] == 2


async def test_a_job_waiting_for_a_stopped_agent_shows_it_awaited(server, http, clock):
    """`systemctl restart` of b's agent in an elastic job whose ranks hold state of their own: the job keeps b's place
    (rdzv_server/core/awaiting.py) and /metrics says it waits for one node; b's next agent back, for none."""
    cfg = dict(min_nodes=2, max_nodes=3, last_call_s=1, lease_timeout_s=10)
    nodes = [Node(http, server, "w", n, **cfg) for n in "abc"]
    for node in nodes:
        await node.join()
    clock.now = T0 + 1.5                                               # the last call's end: round a, b, c
    server.app[COORDINATOR].clock_moved()
    first = (await nodes[0].poll(known_round=-1, wait_s=0))["round_id"]
    await nodes[1].post("poll", {"known_round": first, "wait_s": 0, "copies": {"local_step": 10, "copying": False}})
    kept = await nodes[1].post("leave", {"reason": "agent received SIGTERM", "stopped": True})
    assert kept["place_kept_s"] == 11.0 and kept["node_state"] == "gone"
    s = await scrape(http, server)
    assert s["rdzv_job_awaited_nodes", {"job": "w"}] == 1
    await Node(http, server, "w", "b", instance="2", **cfg).join()          # its next agent: the round forms
    s = await scrape(http, server)
    assert s["rdzv_job_awaited_nodes", {"job": "w"}] == 0
