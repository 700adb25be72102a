"""An overdue answer on loopback: the client does not wait on the connection it has. Apps stand in for
a server whose reply was lost (a poll held forever), a standby (503) and a server that is not there;
node_agent/client/path_check.py has the rules."""
from __future__ import annotations

import asyncio
import gc

import pytest
from aiohttp import web

from node_agent.client import path_check
from node_agent.client.http import RdzvClient
from node_agent.client.replies import Path
from node_agent.client.retry import until_answered
from node_agent.client.transport import ServerUnreachable
from protocol.codec import CONTENT_TYPE, encode
from protocol.messages import JobState, NodeState, NodeStatus
from tests.integration.support import start_app
from tests.ports import free_port

LIMIT = 10.0
STATUS = NodeStatus(job_id="j", job_state=JobState.RUNNING, node_state=NodeState.WAITING, round_id=-1,
                    restart_count=0, poll_hold_s=0.2)


@pytest.fixture(autouse=True)
def short_margin(monkeypatch):
    monkeypatch.setattr(path_check, "HOLD_MARGIN_S", 0.3)


def server(first_answers: bool, ready: dict[str, int], readyz_s: float = 0.0) -> tuple[web.Application, list[object]]:
    """An app whose first poll is never answered (its reply lost), unless `first_answers`; /readyz
    answers `ready["status"]`, after `readyz_s` from its second ask on."""
    peers: list[object] = []

    async def poll(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        if len(peers) == 1 and not first_answers:
            await asyncio.sleep(3600)        # stalled: the reply never comes on this connection
        return web.Response(body=encode(STATUS), content_type=CONTENT_TYPE)

    async def readyz(request: web.Request) -> web.Response:
        ready["asked"] = ready.get("asked", 0) + 1
        if ready["asked"] > 1:
            await asyncio.sleep(readyz_s)
        first = ready["asked"] == 1 and "first" in ready
        return web.json_response({}, status=ready["first"] if first else ready["status"])

    app = web.Application()
    app.router.add_post("/v1/jobs/{job_id}/{action}", poll)
    app.router.add_get("/readyz", readyz)
    return app, peers


async def test_an_overdue_poll_is_sent_again_at_once_on_a_new_connection_once_the_server_answers_one():
    app, peers = server(False, ready := {"status": 200})
    srv = await start_app(app)
    try:
        async with RdzvClient("127.0.0.1", srv.port or 0, "j", "n1") as c:
            c.hold_s = 0.2
            reply = await asyncio.wait_for(c.poll(-1, 60.0), LIMIT)     # not the poll's 70 s timeout
        assert reply.poll_hold_s == 0.2 and len(peers) == 2
        assert peers[0] != peers[1]                 # the second went on a new connection
        assert ready["asked"] >= 1
    finally:
        await srv.close()


async def test_an_overdue_answer_while_only_a_standby_answers_keeps_its_connection_until_one_serves():
    # Abandoning the poll would tell the server the node went away; it is sent again only once an
    # endpoint serves, and the standby is checked on the schedule meanwhile, never in a tight loop.
    app, peers = server(False, ready := {"status": 503})
    srv = await start_app(app)
    try:
        async with RdzvClient("127.0.0.1", srv.port or 0, "j", "n1") as c:
            c.hold_s = 0.2
            poll = asyncio.create_task(c.poll(-1, 60.0))
            await asyncio.sleep(2.0)                # overdue after 0.5 s, then checked on the schedule
            assert not poll.done() and len(peers) == 1
            asked = ready["asked"]
            assert 2 <= asked <= 1.5 / path_check.MIN_PAUSE_S + 2
            ready["status"] = 200                   # the standby takes over
            reply = await asyncio.wait_for(poll, LIMIT)
            assert reply.round_id == -1 and len(peers) == 2 and peers[0] != peers[1]
    finally:
        await srv.close()


async def test_nothing_listening_is_checked_on_the_schedule_and_the_retry_goes_once_it_listens(monkeypatch):
    port = free_port()
    pauses: list[float] = []
    take = path_check.CheckSchedule.next_pause
    monkeypatch.setattr(path_check.CheckSchedule, "next_pause", lambda self: pauses.append(take(self)) or pauses[-1])
    async with RdzvClient("127.0.0.1", port, "j", "n1") as c:
        assert await c.reach() == Path.NO_SERVER
        errors: list[ServerUnreachable] = []
        app, peers = server(True, {"status": 200})
        retry = asyncio.create_task(until_answered(lambda: c.poll(-1, 60.0), on_unreachable=errors.append,
                                                   path_back=c.path_back))
        await asyncio.sleep(1.0)
        assert not retry.done() and len(errors) == 1          # one failed try, then checks, no re-sends
        assert 1 <= len(pauses) <= 1.0 / path_check.MIN_PAUSE_S + 2     # a round before each pause
        srv = web.AppRunner(app)
        await srv.setup()
        site = web.TCPSite(srv, "127.0.0.1", port)
        await site.start()
        try:
            reply = await asyncio.wait_for(retry, LIMIT)
            assert reply.round_id == -1 and len(errors) == 1 and len(peers) == 1
        finally:
            await srv.cleanup()


async def test_a_request_that_fails_while_the_path_is_checked_has_its_error_retrieved(monkeypatch):
    # #21 item 6: "Task exception was never retrieved ... ServerUnreachable". The poll's connection is
    # closed by the server while the client checks the path: that error is the poll's, and retrieved.
    monkeypatch.setattr(path_check, "HOLD_MARGIN_S", 0.1)
    checking = asyncio.Event()

    async def poll(request: web.Request) -> web.StreamResponse:
        await checking.wait()
        assert request.transport is not None
        request.transport.abort()            # the connection goes while the check is under way
        return web.Response()

    async def readyz(request: web.Request) -> web.Response:
        checking.set()
        await asyncio.sleep(0.5)
        return web.json_response({}, status=200)

    app = web.Application()
    app.router.add_post("/v1/jobs/{job_id}/{action}", poll)
    app.router.add_get("/readyz", readyz)
    srv = await start_app(app)
    unretrieved: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        async with RdzvClient("127.0.0.1", srv.port or 0, "j", "n1") as c:
            c.hold_s = 0.1
            with pytest.raises(ServerUnreachable):
                await asyncio.wait_for(c.poll(-1, 60.0), LIMIT)
        gc.collect()
        await asyncio.sleep(0)
        assert not [u for u in unretrieved if "never retrieved" in str(u.get("message"))], unretrieved
    finally:
        loop.set_exception_handler(None)
        await srv.close()


async def test_a_busy_server_that_accepted_the_check_is_waited_for_not_asked_again_each_pause():
    # The first check finds a standby (503); the next connects but /readyz takes 0.9 s (a server
    # swamped by a fleet coming back): the probe says it got through (path_check.connected), and no
    # other check starts in the 0.3-0.65 s pauses meanwhile; the poll then goes again, on a new connection.
    app, peers = server(False, ready := {"status": 200, "first": 503}, readyz_s=0.9)
    srv = await start_app(app)
    try:
        async with RdzvClient("127.0.0.1", srv.port or 0, "j", "n1") as c:
            c.hold_s = 0.2
            reply = await asyncio.wait_for(c.poll(-1, 60.0), LIMIT)
        assert reply.poll_hold_s == 0.2 and len(peers) == 2 and peers[0] != peers[1]
        assert ready["asked"] == 2, ready                # the standby's, then one waited for
    finally:
        await srv.close()
