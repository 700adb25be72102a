"""The agent's two transports: RdzvClient against the real app on loopback, LocalClient in-process.

Both must give the agent the same thing: a NodeStatus, or one of two exceptions (`ServerRejected`
for a refusal, `ServerUnreachable` for "not now", retryable codes included).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from node_agent.client.http import RdzvClient
from node_agent.client.local import LocalClient
from node_agent.client.replies import ClientCode
from node_agent.client.retry import unreachable_line
from node_agent.client.transport import (
    ACTION_OF,
    CLOSED_BY_SERVER,
    ServerRejected,
    ServerUnreachable,
    Transport,
    refusal,
)
from protocol.codec import REQUEST_TYPES
from protocol.errors import RETRYABLE, ErrorCode
from protocol.messages import JobConfig, JobState, NodeState, NodeStatus, WorkerFailure
from rdzv_server.coordinator import Coordinator
from rdzv_server.web.app import create_app
from rdzv_server.web.routing import COORDINATOR
from tests.integration.support import start_app

LIMIT = 10.0
ONE_NODE = JobConfig(min_nodes=1, max_nodes=1, max_restarts=1, last_call_s=0.0)
Connect = Callable[[str, str], Awaitable[Transport]]
E = TypeVar("E", bound=Exception)


@pytest.fixture(params=["http", "local"])
async def connect(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Connect, Callable[[], Coordinator]]]:
    """Opens transports of one kind for (job id, node id); all share one coordinator, which `coordinator()`
    returns once the first transport is open."""
    opened: list[Transport] = []
    servers: list[TestServer] = []
    coordinators: list[Coordinator] = []

    async def open_one(job_id: str, node_id: str) -> Transport:
        if request.param == "http":
            if not servers:
                app = create_app()
                servers.append(await start_app(app))
                coordinators.append(app[COORDINATOR])
            transport: Transport = RdzvClient("127.0.0.1", servers[0].port or 0, job_id, node_id)
            await transport.__aenter__()
        else:
            local = LocalClient(job_id, node_id)
            if coordinators:   # one in-process server for every node of the test
                local.coordinator = coordinators[0]
            else:
                await local.__aenter__()
                coordinators.append(local.coordinator)
            transport = local
        opened.append(transport)
        return transport

    yield open_one, lambda: coordinators[0]
    for transport in opened:
        if isinstance(transport, RdzvClient):
            await transport.__aexit__(None, None, None)
    if servers:
        await servers[0].close()
    elif coordinators:
        await coordinators[0].stop()


async def join(t: Transport, config: JobConfig = ONE_NODE) -> NodeStatus:
    return await asyncio.wait_for(t.join(addr="127.0.0.1", host="h", local_world_size=2, master_port=1234,
                                         config=config, instance="i1", role="default"), LIMIT)


async def test_a_whole_job_through_the_transport(connect) -> None:
    open_one, _ = connect
    t = await open_one("job1", "n1")
    status = await join(t)
    assert status.job_id == "job1" and status.node_state == NodeState.MEMBER
    assert status.assignment is not None and status.assignment.local_world_size == 2
    round_id = status.assignment.round_id
    assert (await t.poll(round_id, 0.0)).round_id == round_id
    failure = WorkerFailure(local_rank=1, rank=1, exitcode=3, message="boom", host="h")
    after = await asyncio.wait_for(t.report_failure(round_id, [failure]), LIMIT)
    assert after.restart_count == 1 and after.assignment is not None and after.assignment.round_id > round_id
    done = await asyncio.wait_for(t.report_success(after.assignment.round_id), LIMIT)
    assert done.job_state == JobState.SUCCEEDED
    assert (await t.leave("done")).node_state == NodeState.GONE


async def test_refusals_keep_the_servers_code_and_words(connect) -> None:
    open_one, _ = connect
    with pytest.raises(ServerRejected) as info:
        await (await open_one("nosuch", "n1")).poll(-1, 0.0)
    assert info.value.code == ErrorCode.UNKNOWN_JOB.value and "nosuch" in info.value.message
    await join(await open_one("job2", "n1"))
    with pytest.raises(ServerRejected) as info:
        await join(await open_one("job2", "n2"), JobConfig(min_nodes=1, max_nodes=2))
    assert info.value.code == ErrorCode.CONFIG_CONFLICT.value and "max_nodes" in info.value.message


async def test_a_server_going_away_is_unreachable_not_a_refusal(connect) -> None:
    open_one, coordinator = connect
    t = await open_one("job3", "n1")
    await join(t)
    coordinator().release_polls()   # what a stopping server does first: "shutting_down" from now on
    with pytest.raises(ServerUnreachable) as info:
        await t.poll(-1, 0.0)
    assert ErrorCode.SHUTTING_DOWN.value in str(info.value)


@pytest.mark.parametrize("code", sorted(RETRYABLE, key=lambda c: c.value))
def test_every_retryable_code_means_try_again(code: ErrorCode) -> None:
    assert isinstance(refusal(code.value, "later"), ServerUnreachable)


@pytest.mark.parametrize("code", sorted(set(ErrorCode) - RETRYABLE, key=lambda c: c.value))
def test_every_other_code_is_a_refusal(code: ErrorCode) -> None:
    exc = refusal(code.value, "no")
    assert isinstance(exc, ServerRejected) and (exc.code, exc.message) == (code.value, "no")


def test_a_code_from_a_newer_server_is_a_refusal() -> None:
    assert isinstance(refusal("some_future_code", "no"), ServerRejected)


async def test_each_request_goes_to_the_protocols_action_for_its_type() -> None:
    sent: list[tuple[str, type]] = []

    class Recording(Transport):
        async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
            sent.append((action, type(message)))
            return NodeStatus(job_id="j", job_state=JobState.WAITING, node_state=NodeState.WAITING, round_id=-1,
                              restart_count=0)

    t = Recording("n1")
    await join(t)
    await t.poll(-1, 0.0)
    await t.report_failure(1, [WorkerFailure(local_rank=0, rank=0, exitcode=1)])
    await t.report_success(1)
    await t.leave("bye")
    await t.report_stall(1, 5.0, [])
    assert sent == list(REQUEST_TYPES.items())
    assert ACTION_OF == {cls: action for action, cls in REQUEST_TYPES.items()}


async def test_http_errors_below_the_protocol_are_unreachable() -> None:
    hold = asyncio.Event()

    async def not_ours(request: web.Request) -> web.Response:
        if request.match_info["action"] == "poll":
            await hold.wait()   # a server that accepted the request and never answers
        return web.Response(status=502, text="<html>bad gateway</html>")

    app = web.Application()
    app.router.add_post("/v1/jobs/{job_id}/{action}", not_ours)
    srv = await start_app(app)
    try:
        async with RdzvClient("127.0.0.1", srv.port or 0, "j", "n1") as client:
            with pytest.raises(ServerUnreachable) as info:
                await join(client)
            assert "HTTP 502 from a gateway" in str(info.value)   # the server behind it is away: retry
            client.REQUEST_TIMEOUT_S = 0.2
            with pytest.raises(ServerUnreachable) as info:
                await asyncio.wait_for(client.poll(-1, 0.0), LIMIT)
            assert "TimeoutError" in str(info.value)
    finally:
        hold.set()
        await srv.close()
    async with RdzvClient("127.0.0.1", srv.port or 0, "j", "n1") as client:   # nobody listens there now
        with pytest.raises(ServerUnreachable):
            await join(client)


async def join_a_raw_server(serve, expected: type[E]) -> tuple[int, E]:
    """A join sent to a plain TCP server answering with `serve`: its port, and the `expected` error raised."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with RdzvClient("127.0.0.1", port, "j", "n1") as client:
            with pytest.raises(expected) as info:
                await join(client)
    finally:
        server.close()
        await server.wait_closed()
    return port, info.value


@pytest.mark.parametrize("how", ["reset", "closed"])
async def test_a_connection_the_server_took_and_closed_is_not_told_as_a_server_that_may_not_run(how: str) -> None:
    """A server at its connection limit closes connections to make room (aborted over TLS: a reset): the agent's
    line says the server closed it, not "is an rdzv-server running there?" (a review found the hint misleading);
    nobody listening keeps the hint."""
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        if how == "reset":
            writer.transport.abort()     # unread bytes left: the kernel answers with a reset
        else:
            writer.close()

    port, error = await join_a_raw_server(closing, ServerUnreachable)
    assert CLOSED_BY_SERVER in str(error)
    line = unreachable_line(f"127.0.0.1:{port}", 60, str(error))
    assert "running there" not in line and "connection limit" in line
    async with RdzvClient("127.0.0.1", port, "j", "n1") as client:   # nobody listens there now
        with pytest.raises(ServerUnreachable) as info:
            await join(client)
    assert CLOSED_BY_SERVER not in str(info.value)
    assert "is an rdzv-server running there?" in unreachable_line(f"127.0.0.1:{port}", 60, str(info.value))


@pytest.mark.parametrize("status, content_type, body", [
    (404, "text/html", "<html>not found</html>"),                     # another web service
    (200, "application/json", '{"kind": "etcd"}'),                    # an HTTP API that is not ours
    (400, "application/msgpack", "\x81\xa1a\x01"),                     # MessagePack, but not our protocol
])
async def test_an_endpoint_that_is_not_an_rdzv_server_is_refused_as_such(status: int, content_type: str,
                                                                          body: str) -> None:
    async def other(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body.encode("latin-1"), content_type=content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", other)
    srv = await start_app(app)
    port = srv.port or 0
    try:
        async with RdzvClient("127.0.0.1", port, "j", "n1") as client:
            with pytest.raises(ServerRejected) as info:
                await join(client)
    finally:
        await srv.close()
    assert info.value.code == ClientCode.NOT_RDZV_SERVER
    assert info.value.message.startswith(f"http://127.0.0.1:{port} is not an rdzv-server: it answered "
                                         f"HTTP {status} ({content_type})")


async def test_an_endpoint_that_does_not_speak_http_is_refused_as_such() -> None:
    async def junk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"\x00\x01 not http\r\n\r\n")   # as a c10d TCPStore or a gRPC port might answer
        await writer.drain()
        writer.close()

    _, error = await join_a_raw_server(junk, ServerRejected)
    assert error.code == ClientCode.NOT_RDZV_SERVER and "its reply is not HTTP" in error.message


@pytest.mark.parametrize("job_id", ["team/exp1", "a" * 300, "app_id:7@host+x=y~z"])
async def test_job_ids_with_slashes_and_long_ones_travel_as_one_path_segment(connect, job_id: str) -> None:
    open_one, coordinator = connect
    client = await open_one(job_id, "n1")
    status = await join(client)
    assert status.job_id == job_id and status.job_state == JobState.RUNNING
    assert (await client.poll(status.round_id, 0.0)).job_id == job_id
    assert list(coordinator().core.jobs) == [job_id]
