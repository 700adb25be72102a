"""node-agent's client among replicas: it follows the leader a standby names, skips a replica it
cannot reach, and leaves a held poll whose replica no longer answers /readyz as the leader.
rdzv-ctl does the same with several servers. Real apps on loopback; the 'standby' is the real app
of a replica that does not lead (create_app(..., standby=True) never elected)."""
from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from node_agent.client import http as client_module
from node_agent.client.http import RdzvClient
from node_agent.client.path_check import MIN_PAUSE_S
from node_agent.client.replies import Path
from node_agent.client.transport import ServerUnreachable
from protocol.codec import CONTENT_TYPE, encode
from protocol.messages import JobConfig, JobState, NodeState, NodeStatus
from rdzv_ctl.client import Client, CtlError
from rdzv_server.coordinator import Coordinator
from rdzv_server.looplag import LoopLagMeter
from rdzv_server.web.app import create_app
from tests.integration.support import start_app, wait_until
from tests.ports import free_port

LIMIT = 10.0
ONE_NODE = JobConfig(min_nodes=1, max_nodes=1, max_restarts=1, last_call_s=0.0)


async def join(client: RdzvClient):
    return await asyncio.wait_for(client.join(addr="127.0.0.1", host="h", local_world_size=1, master_port=1,
                                              config=ONE_NODE, instance="i1", role="default"), LIMIT)


@pytest.fixture
async def leader_and_standby():
    leader = await start_app(create_app(Coordinator(loop_lag=LoopLagMeter())))
    standby_coord = Coordinator()
    standby_coord.gate.leader_url = lambda: f"http://127.0.0.1:{leader.port}"
    standby = await start_app(create_app(standby_coord, standby=True))
    try:
        yield leader, standby
    finally:
        await standby.close()
        await leader.close()


async def test_the_agent_follows_the_leader_a_standby_names(leader_and_standby):
    leader, standby = leader_and_standby
    async with RdzvClient("127.0.0.1", standby.port or 0, "j", "n1", replicas=(("127.0.0.1", free_port()),)) as c:
        status = await join(c)
        assert status.round_id >= 1 and c.endpoints.current == f"http://127.0.0.1:{leader.port}"


async def test_given_only_a_standby_the_path_check_finds_the_leader_it_names(leader_and_standby):
    """One endpoint for every replica (the old leader restarted as a standby, or one name for both): its
    /readyz names the leader, which the path check then finds ready; before, the agent waited for that
    standby to lead until --server-wait ran out and its workers were stopped."""
    leader, standby = leader_and_standby
    async with RdzvClient("127.0.0.1", standby.port or 0, "j", "n1") as c:
        await asyncio.wait_for(c.path_back(), LIMIT)
        assert c.endpoints.current == f"http://127.0.0.1:{leader.port}"
        assert (await join(c)).round_id >= 1


async def test_a_leader_named_earlier_stays_checked_when_a_standby_names_a_lost_one():
    """Given one endpoint: a standby about to take over still names the leader just lost. The one named before
    (not ready yet, then leading) must stay checked; replaced by the lost one, nothing checked could answer."""
    later_port, lost = free_port(), f"http://127.0.0.1:{free_port()}"
    standby_coord, named = Coordinator(), [f"http://127.0.0.1:{later_port}"]
    standby_coord.gate.leader_url = lambda: named[0]
    standby = await start_app(create_app(standby_coord, standby=True))
    leader = TestServer(create_app(Coordinator(loop_lag=LoopLagMeter())), host="127.0.0.1", port=later_port)
    try:
        async with RdzvClient("127.0.0.1", standby.port or 0, "j", "n1") as c:
            assert await c.reach() is Path.STANDBY              # learns the first leader's URL
            named[0] = lost
            for _ in range(2):                                  # a round that hears the lost one named
                await asyncio.sleep(MIN_PAUSE_S)                # rounds closer than this are one round
                assert await c.reach() is Path.STANDBY
            await leader.start_server()
            reached: list[Path] = []
            while Path.REACHED not in reached:
                assert len(reached) < 20, f"the leader named first is no longer checked: {reached[-3:]}"
                await asyncio.sleep(MIN_PAUSE_S)
                reached.append(await c.reach())
    finally:
        await standby.close()
        await leader.close()


async def test_an_unreachable_replica_is_skipped_for_the_next(leader_and_standby):
    leader, _ = leader_and_standby
    async with RdzvClient("127.0.0.1", free_port(), "j", "n1", replicas=(("127.0.0.1", leader.port or 0),)) as c:
        await join(c)
        assert c.endpoints.current == f"http://127.0.0.1:{leader.port}"


async def test_no_replica_answering_is_an_outage_not_a_refusal():
    async with RdzvClient("127.0.0.1", free_port(), "j", "n1", replicas=(("127.0.0.1", free_port()),)) as c:
        with pytest.raises(ServerUnreachable):
            await join(c)


async def test_a_held_poll_is_left_when_its_replica_stops_answering_as_the_leader(monkeypatch):
    """A leader frozen or replaced keeps the poll's connection open: /readyz tells."""
    held = asyncio.Event()
    checked = asyncio.Event()
    ready = {"status": 200, "asked": 0}

    async def hold(request: web.Request) -> web.Response:
        held.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def readyz(request: web.Request) -> web.Response:
        ready["asked"] += 1
        if ready["asked"] >= 3:
            checked.set()
        return web.json_response({}, status=ready["status"])

    other = {"status": 503, "asked": 0}

    async def other_readyz(request: web.Request) -> web.Response:
        other["asked"] += 1
        return web.json_response({}, status=other["status"])

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=encode(NodeStatus(job_id="j", job_state=JobState.RUNNING,
                                                   node_state=NodeState.WAITING, round_id=7, restart_count=0)),
                            content_type=CONTENT_TYPE)

    app = web.Application()
    app.router.add_post("/v1/jobs/{job_id}/{action}", hold)
    app.router.add_get("/readyz", readyz)
    standby = web.Application()
    standby.router.add_post("/v1/jobs/{job_id}/{action}", answer)
    standby.router.add_get("/readyz", other_readyz)
    srv, srv2 = await start_app(app), await start_app(standby)
    monkeypatch.setattr(client_module, "LEADER_CHECK_S", 0.1)
    try:
        async with RdzvClient("127.0.0.1", srv.port or 0, "j", "n1", replicas=(("127.0.0.1", srv2.port or 0),)) as c:
            poll = asyncio.create_task(c.poll(1, 60.0))
            await held.wait()
            await asyncio.wait_for(checked.wait(), LIMIT)     # three checks answered 200: the poll stays held
            assert not poll.done()
            ready["status"] = 503                        # it stops leading, and the other does not serve yet:
            asked = other["asked"]
            await wait_until(lambda: other["asked"] >= asked + 2)   # both checked on the schedule meanwhile
            assert not poll.done()                       # kept: nobody serves, and it may yet be answered
            other["status"] = 200                        # the other replica takes over: the poll goes there
            reply = await asyncio.wait_for(poll, LIMIT)
            assert reply.round_id == 7 and c.endpoints.current == f"http://127.0.0.1:{srv2.port}"
    finally:
        await srv.close()
        await srv2.close()


async def test_rdzv_ctl_follows_the_leader(leader_and_standby):
    leader, standby = leader_and_standby
    ctl = Client(f"http://127.0.0.1:{free_port()},http://127.0.0.1:{standby.port}", 5.0)
    doc = await asyncio.to_thread(ctl.get, "/v1/status")
    assert doc["jobs"] == [] and ctl.server == f"http://127.0.0.1:{leader.port}"


async def test_rdzv_ctl_asks_the_next_replica_before_a_frozen_one_times_out(leader_and_standby, monkeypatch):
    """A frozen replica (SIGSTOP: the kernel still accepts its connections) answers nothing: rdzv-ctl asks it
    only QUICK_S before the next replica, whose leader answers, instead of the whole --timeout."""
    leader, standby = leader_and_standby
    monkeypatch.setattr(Client, "QUICK_S", 0.2)
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)          # never accepted: connections complete in the kernel, no answer ever comes
        ctl = Client(f"http://127.0.0.1:{frozen.getsockname()[1]},http://127.0.0.1:{standby.port}", 3600.0)
        doc = await asyncio.wait_for(asyncio.to_thread(ctl.get, "/v1/status"), LIMIT)
    assert doc["jobs"] == [] and ctl.server == f"http://127.0.0.1:{leader.port}"


async def test_rdzv_ctl_gives_a_replica_slow_to_answer_the_whole_timeout(monkeypatch):
    """Only a slow replica: after the quick pass it is asked again for the whole --timeout, and its answer
    is taken (a busy leader is not an outage)."""
    monkeypatch.setattr(Client, "QUICK_S", 0.2)
    answer, asked = asyncio.Event(), [0]

    async def slow_status(request: web.Request) -> web.Response:
        asked[0] += 1
        if asked[0] == 1:
            await asyncio.Event().wait()     # never answered: the quick pass gives up on this one
        await answer.wait()
        return web.json_response({"jobs": ["slow"]})

    app = web.Application()
    app.router.add_get("/v1/status", slow_status)
    srv = await start_app(app)
    slow = f"http://127.0.0.1:{srv.port}"
    try:
        ctl = Client(f"http://127.0.0.1:{free_port()},{slow}", 3600.0)
        pending = asyncio.ensure_future(asyncio.to_thread(ctl.get, "/v1/status"))
        await wait_until(lambda: ctl.slow, LIMIT)
        answer.set()
        doc = await asyncio.wait_for(pending, LIMIT)
    finally:
        await srv.close()
    assert doc["jobs"] == ["slow"] and ctl.server == slow


async def test_rdzv_ctl_says_each_replicas_failure_not_only_the_frozen_ones(monkeypatch):
    """A review: a frozen replica first, a live one that needs a token: rdzv-ctl said only "cannot reach ...
    timed out" of the frozen one, and the live one's "pass --token-file" was lost. Each replica's line is said."""
    monkeypatch.setattr(Client, "QUICK_S", 0.2)

    async def needs_token(request: web.Request) -> web.Response:
        return web.json_response({"error": "unauthorized"}, status=401)

    app = web.Application()
    app.router.add_get("/v1/status", needs_token)
    srv = await start_app(app)
    try:
        with socket.socket() as frozen:
            frozen.bind(("127.0.0.1", 0))
            frozen.listen(8)          # never accepted: no answer ever comes
            ctl = Client(f"http://127.0.0.1:{frozen.getsockname()[1]},http://127.0.0.1:{srv.port}", 0.5)
            with pytest.raises(CtlError) as failed:
                await asyncio.wait_for(asyncio.to_thread(ctl.get, "/v1/status"), LIMIT)
    finally:
        await srv.close()
    assert "timed out" in str(failed.value) and "pass --token-file" in str(failed.value), failed.value


async def test_a_followed_leader_that_is_gone_sends_the_agent_back_to_its_endpoint():
    """One endpoint (a Kubernetes Service in front of both replicas, or a DNS name for both): a standby
    there names the leader, the agent follows it to the leader's own address; when that leader is gone,
    the agent goes back to the endpoint it was given, where a standby names the new leader, instead of
    knocking at the old leader's address until --server-wait ends."""
    first = await start_app(create_app(Coordinator(loop_lag=LoopLagMeter())))
    second = await start_app(create_app(Coordinator(loop_lag=LoopLagMeter())))
    standby_coord = Coordinator()
    leader = {"url": f"http://127.0.0.1:{first.port}"}
    standby_coord.gate.leader_url = lambda: leader["url"]
    standby = await start_app(create_app(standby_coord, standby=True))
    try:
        async with RdzvClient("127.0.0.1", standby.port or 0, "j", "n1") as c:
            await join(c)
            assert c.endpoints.current == f"http://127.0.0.1:{first.port}"
            await first.close()                          # the leader is gone; the other replica took over
            leader["url"] = f"http://127.0.0.1:{second.port}"
            status = await asyncio.wait_for(join(c), LIMIT)
            assert status.round_id >= 1 and c.endpoints.current == f"http://127.0.0.1:{second.port}"
    finally:
        await standby.close()
        await second.close()
        await first.close()
