"""An endpoint that is a c10d TCPStore (torchrun's c10d rendezvous, a job's MASTER_PORT) is refused at
once as not an rdzv-server; a peer that merely stays silent or hangs up is waited for, as a stalled
server or a proxy whose server restarts would be. The stores are real (torch in a subprocess)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from node_agent.client.c10d_store import answers_as_c10d_store
from node_agent.client.http import RdzvClient
from node_agent.client.replies import ClientCode
from node_agent.client.transport import ServerRejected, ServerUnreachable
from protocol.messages import JobConfig
from rdzv_server.web.app import create_app
from tests.integration.support import start_app
from tests.ports import loopback_server
from tests.tcpstore import tcp_store

GUARD_S = 30.0     # only against a hang: the outcome, not the time, is what is checked


async def join(client: RdzvClient) -> object:
    return await asyncio.wait_for(client.join(addr="127.0.0.1", host="h", local_world_size=1, master_port=1,
                                              config=JobConfig(min_nodes=1, max_nodes=1), instance="i",
                                              role="default"), GUARD_S)


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "classic"])
async def test_a_c10d_store_at_the_endpoint_is_refused_as_not_an_rdzv_server(libuv: bool) -> None:
    # libuv (torch's default) keeps an HTTP request unanswered; the classic backend resets it
    with tcp_store(libuv) as port:
        assert await answers_as_c10d_store("127.0.0.1", port)
        async with RdzvClient("127.0.0.1", port, "j", "n1") as client:
            with pytest.raises(ServerRejected) as info:
                await join(client)
    assert info.value.code == ClientCode.NOT_RDZV_SERVER
    assert info.value.message.startswith(f"http://127.0.0.1:{port} is not an rdzv-server: a c10d TCPStore")
    assert "\n" not in info.value.message


@contextlib.asynccontextmanager
async def serving(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                  ) -> AsyncIterator[int]:
    async with loopback_server(handle) as port:
        yield port


@pytest.fixture
async def hangs_up() -> AsyncIterator[int]:
    """A peer that accepts, reads the request and closes without a word (so does a TCP proxy whose
    server is restarting)."""
    async def close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.close()
    async with serving(close) as port:
        yield port


async def test_a_peer_that_hangs_up_without_a_reply_is_retried_not_refused(hangs_up: int) -> None:
    assert not await answers_as_c10d_store("127.0.0.1", hangs_up)
    async with RdzvClient("127.0.0.1", hangs_up, "j", "n1") as client:
        with pytest.raises(ServerUnreachable):
            await join(client)


async def test_a_silent_peer_is_not_taken_for_a_store() -> None:
    held: list[asyncio.StreamWriter] = []
    gone = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)      # a stalled server: the connection stays open, nothing comes back
        await gone.wait()
        writer.close()
    async with serving(silent) as port:
        try:
            assert not await answers_as_c10d_store("127.0.0.1", port, timeout=0.5)
        finally:
            gone.set()


async def test_an_rdzv_server_is_no_store_and_answers_as_usual() -> None:
    srv = await start_app(create_app())
    try:
        assert not await answers_as_c10d_store("127.0.0.1", srv.port or 0)   # it answers HTTP 400 instead
        async with RdzvClient("127.0.0.1", srv.port or 0, "j", "n1") as client:
            status = await join(client)
            assert getattr(status, "job_id", None) == "j"
    finally:
        await srv.close()
