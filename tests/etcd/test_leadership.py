"""Two replicas in one process on a real etcd: the election, a standby that names the leader, and a
deposed leader whose commit is refused by the fence, which makes it step down and answer not_leader
(its held polls too), then stand by. The aiohttp apps are the real ones, on loopback."""
from __future__ import annotations

import asyncio
import dataclasses
import logging

import msgpack
import pytest

from rdzv_server.coordinator import Coordinator
from rdzv_server.store.etcd.client import EtcdClient, delete
from rdzv_server.store.etcd.election import Leadership
from rdzv_server.store.etcd.store import EtcdStore
from rdzv_server.web.app import create_app
from rdzv_server.web.metrics import StateCollector
from tests.integration.support import remember_credential, start_app, url, wait_until, with_credential

MSGPACK = {"Content-Type": "application/msgpack"}
CONFIG = {"min_nodes": 2, "max_nodes": 2, "lease_timeout_s": 30.0, "last_call_s": 0.0}


class Replica:
    # The product's default lease: with 2 s (a 0.5 s request timeout, 1.5 s of margin) a loaded machine can stall a
    # renewal past it, and the leader steps down under a test that waits on it.
    def __init__(self, settings, ttl: int = 5) -> None:
        self.ttl = ttl
        self.store = EtcdStore(settings)
        self.coordinator = Coordinator(store=self.store)
        self.app = create_app(self.coordinator, standby=True)
        self.srv = None
        self.leadership: Leadership | None = None

    async def start(self, campaign: bool = True) -> Replica:
        self.srv = await start_app(self.app)
        c = self.coordinator
        self.leadership = Leadership(self.store.settings, self.store, url(self.srv, ""), self.ttl,
                                     on_elected=c.take_over, on_deposed=c.step_down)
        c.gate.follow(self.leadership.sure, lambda: None if self.leadership.leading else self.leadership.leader_url,
                      self.leadership.electing)
        self.leadership.on_news = c.gate.election_news
        if campaign:
            self.leadership.start()
        return self

    async def close(self) -> None:
        self.leadership.stop_campaigning()
        await self.srv.close()
        await self.leadership.resign()


async def start_pair(settings, ttl: int = 5) -> list[Replica]:
    replicas = [await Replica(settings, ttl).start()]
    await wait_until(lambda: replicas[0].coordinator.serving(), 20)
    replicas.append(await Replica(settings, ttl).start())
    return replicas


@pytest.fixture
async def pair(settings):
    replicas = await start_pair(settings)
    try:
        yield replicas
    finally:
        for r in replicas:
            await r.close()


def gauge(replica: Replica, name: str) -> float:
    """One of the replica's /metrics gauges without labels."""
    metrics = StateCollector(replica.coordinator).collect()
    [family] = [m for m in metrics if m.name == name]
    return family.samples[0].value


def waiting_for_leader(replica: Replica) -> float:
    """The replica's /metrics gauge of agent requests held for an election."""
    return gauge(replica, "rdzv_requests_waiting_for_leader")


async def post(http, replica: Replica, action: str, body: dict) -> tuple[int, dict, dict]:
    body = with_credential(replica.srv, "j", body)
    async with http.post(url(replica.srv, f"/v1/jobs/j/{action}"), data=msgpack.packb(body), headers=MSGPACK) as r:
        reply = msgpack.unpackb(await r.read())
        remember_credential(replica.srv, "j", body["node_id"], reply)
        return r.status, reply, dict(r.headers)


def join_body(node: str) -> dict:
    return {"v": 1, "node_id": node, "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1,
            "instance": node, "config": CONFIG}


async def test_a_standby_names_the_leader_and_is_not_ready(pair, http):
    leader, standby = pair
    await wait_until(lambda: standby.leadership.leader_url == url(leader.srv, ""), 10)
    status, reply, headers = await post(http, standby, "join", join_body("a"))
    assert status == 503 and reply["code"] == "not_leader" and headers["Rdzv-Leader"] == url(leader.srv, "")
    async with http.get(url(standby.srv, "/readyz")) as r:
        assert r.status == 503
    # /metrics says which replica's job gauges count: the standby's read 0 whatever runs
    assert (gauge(leader, "rdzv_serving"), gauge(standby, "rdzv_serving")) == (1.0, 0.0)
    async with http.get(url(standby.srv, "/v1/status")) as r:
        assert r.status == 503 and (await r.json())["code"] == "not_leader"
    async with http.get(url(leader.srv, "/readyz")) as r:
        assert r.status == 200
    assert (await post(http, leader, "join", join_body("a")))[0] == 200


async def test_a_deposed_leader_commits_nothing_steps_down_and_releases_its_polls(pair, http, settings):
    old, other = pair
    assert (await post(http, old, "join", join_body("a")))[0] == 200
    poll = asyncio.create_task(post(http, old, "poll", {"v": 1, "node_id": "a", "known_round": -1, "wait_s": 60.0}))
    await wait_until(lambda: old.coordinator.hub.open == 1, 10)
    # the old leader's key goes (as when its lease expires unseen) and the other replica wins
    client = EtcdClient(settings)
    await asyncio.to_thread(client.txn, [], [delete(old.store.leader_key)])
    client.close()
    await wait_until(lambda: other.coordinator.serving(), 20)
    assert old.leadership.leading         # it has not noticed yet: its lease still looks alive to it
    status, reply, _ = await post(http, old, "join", join_body("b"))
    assert status == 503 and reply["code"] == "store_unavailable"       # the fence refused the commit
    status, reply, _ = await poll
    assert status == 503 and reply["code"] == "not_leader"
    await wait_until(lambda: not old.coordinator.started and not old.leadership.leading, 10)
    saved = await asyncio.to_thread(EtcdStore(settings).load)
    assert set(saved.jobs["j"].nodes) == {"a"}                          # b's join was never committed
    assert set(other.coordinator.core.jobs["j"].nodes) == {"a"}
    await wait_until(lambda: old.leadership.leader_url == url(other.srv, ""), 10)   # standing by again
    status, reply, headers = await post(http, old, "join", join_body("b"))
    assert reply["code"] == "not_leader" and headers["Rdzv-Leader"] == url(other.srv, "")


async def test_a_clean_stop_hands_leadership_over_without_waiting_out_the_lease(settings, http):
    leader, standby = await start_pair(settings, ttl=60)     # the lease alone would keep it for a minute
    try:
        await wait_until(lambda: standby.leadership.leader_url is not None, 10)
        assert (await post(http, leader, "join", join_body("a")))[0] == 200
        await leader.close()
        await wait_until(lambda: standby.coordinator.serving(), 20)
        assert set(standby.coordinator.core.jobs["j"].nodes) == {"a"}
        restarted = [e for e in standby.coordinator.core.jobs["j"].events if e.kind == "server_restarted"]
        assert len(restarted) == 1 and "after a clean shutdown" in restarted[0].message
    finally:
        await standby.close()


async def test_a_request_during_an_election_waits_for_the_takeover_instead_of_a_refusal(settings, http):
    replica = await Replica(settings).start(campaign=False)     # no leader known yet, none elected
    try:
        join = asyncio.create_task(post(http, replica, "join", join_body("a")))
        await wait_until(lambda: waiting_for_leader(replica) == 1, 10)     # what /metrics says
        replica.leadership.start()
        status, reply, _ = await asyncio.wait_for(join, 20)
        assert status == 200 and reply["node_state"] == "waiting"
        assert waiting_for_leader(replica) == 0
    finally:
        await replica.close()


async def test_a_replica_on_another_prefix_does_not_have_a_running_jobs_agents_start_over(settings, http, caplog):
    # Two deployments: the job runs on `settings`' prefix; a replica given a wrong --etcd-prefix leads its own (empty)
    # one. When the job's leader is gone, its agents reach that replica: `unknown_job` would have them join it as a
    # new job, from scratch (their snapshots' ranks moved and removed); `not_leader` has them wait for their own.
    ours = await Replica(settings).start()
    await wait_until(lambda: ours.coordinator.serving(), 20)
    wrong = await Replica(dataclasses.replace(settings, prefix=settings.prefix + "typo/")).start()
    try:
        await wait_until(lambda: wrong.coordinator.serving(), 20)
        assert (await post(http, ours, "join", join_body("a")))[0] == 200
        caplog.set_level(logging.WARNING, logger="rdzv_server")
        for _ in range(2):
            status, reply, _ = await post(http, wrong, "poll", {"v": 1, "node_id": "a", "known_round": 1,
                                                                 "wait_s": 0.0})
            assert status == 503 and reply["code"] == "not_leader", reply
            assert "has no job 'j'" in reply["message"] and "--etcd-prefix" in reply["message"]
        said = [r.getMessage() for r in caplog.records if "has no such job" in r.getMessage()]
        assert len(said) == 1, said            # once per job, not per request
        assert "j" not in wrong.coordinator.core.jobs
        status, reply, _ = await post(http, wrong, "join", join_body("b"))    # a new job's join still makes it
        assert status == 200
    finally:
        await wrong.close()
        await ours.close()
