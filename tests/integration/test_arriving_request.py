"""The connection guard (web/connections.py) closes a connection whose request aiohttp has read but not yet handed
to a handler last, as one whose request is still unread in its socket: in that turn of the event loop it looks idle,
and a newcomer's accept closed it (a review: an agent's reconnection lost this way 86 times in one flood)."""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from rdzv_server import tcp_info
from rdzv_server.web.connections import ConnectionGuard

REQUEST = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def big(request: web.Request) -> web.Response:
    return web.Response(body=b"x" * (4 << 20))


async def until(predicate, what: str) -> None:
    """Let the server's loop run until `predicate` holds (bounded: the test fails naming `what`)."""
    deadline = time.monotonic() + 10.0
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def connect_two(guard: ConnectionGuard, port: int) -> list:
    """Two client connections, once the server has both (oldest first in `guard._unproven`)."""
    clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    await until(lambda: len(guard._unproven) == 2, "both connections connected")
    return clients


async def serving(guard: ConnectionGuard) -> tuple[web.AppRunner, asyncio.AbstractServer, int]:
    app = web.Application(middlewares=[guard.middleware])
    app.router.add_get("/ok", ok)
    app.router.add_get("/healthz", big)     # answered, proving nothing: the connection stays unproven
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    server = await asyncio.get_running_loop().create_server(guard.factory(runner.server), "127.0.0.1", 0)
    return runner, server, server.sockets[0].getsockname()[1]


async def test_a_request_read_and_not_yet_handled_is_closed_after_the_idle_ones():
    guard = ConnectionGuard(8)
    runner, server, port = await serving(guard)
    clients = []
    try:
        clients += await connect_two(guard, port)
        reading, idle = guard._unproven        # oldest first: the one to go first, were both idle
        # aiohttp reads the request (its parser queues it); the handler's task runs a turn later. In this same
        # turn a newcomer's accept asks for room:
        reading.data_received(REQUEST)
        assert guard._make_room() and idle.transport.is_closing() and not reading.transport.is_closing()
        await until(lambda: reading in guard._open, "the read request answered")
        assert (await clients[0][0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        # answered and idle past ARRIVING_S (as if): the next to go
        guard._open[reading] -= 2.0
        assert guard._make_room() and reading.transport.is_closing()
    finally:
        for _, writer in clients:
            writer.close()
        server.close()
        await runner.cleanup()


async def test_a_connection_at_work_on_requests_it_pipelined_and_never_reads_is_not_spared():
    """A stranger pipelines requests and reads no answer: its queue stays full while the server writes into its
    full socket. It looks arriving to nothing: the oldest idle, it is closed first (sparing such connections let a
    stranger's flood outlast every newcomer, a review)."""
    guard = ConnectionGuard(8)
    runner, server, port = await serving(guard)
    clients = []
    try:
        clients += await connect_two(guard, port)
        pipelining, idle = guard._unproven
        clients[0][1].write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 8)        # never read
        clients[0][1].transport.pause_reading()
        await until(lambda: (pipelining._messages and pipelining not in guard._busy and pipelining._waiter is None
                             and tcp_info.unread_bytes(pipelining.transport) == 0),
                    "the server at work on the pipelined requests (all read), writing into a full socket")
        assert guard._make_room() and pipelining.transport.is_closing() and not idle.transport.is_closing()
    finally:
        for _, writer in clients:
            writer.close()
        server.close()
        await runner.cleanup()
