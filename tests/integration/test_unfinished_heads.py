"""Request heads in flight (web/heads.py): a connection's unfinished head is bounded in time and, with every other's,
in bytes; a body is no head, and a head pipelined behind a finished request is counted as any other. Measured by
what the guard counts and which connections it closes."""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from rdzv_server.web import heads as heads_module
from rdzv_server.web.connections import ConnectionGuard
from rdzv_server.web.heads import PIECE, Heads

UNFINISHED = b"GET /ok HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 7000 + b"\r\n"     # no blank line: not whole
NEXT = b"GET /ok HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 7000) for i in range(4))


async def ok(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(text="ok")


async def until(predicate, what: str) -> None:
    """Let the server's loop run until `predicate` holds (bounded: the test fails naming `what`)."""
    deadline = time.monotonic() + 10.0
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(65536), 10.0) == b""
    except ConnectionError:
        return True


class Served:
    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def __aenter__(self) -> Served:
        app = web.Application(middlewares=[self.guard.middleware])
        app.router.add_route("*", "/ok", ok)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        assert self.runner.server is not None
        self.server = await asyncio.get_running_loop().create_server(self.guard.factory(self.runner.server),
                                                                      "127.0.0.1", 0)
        return self

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.clients.append(await asyncio.open_connection("127.0.0.1", self.server.sockets[0].getsockname()[1]))
        return self.clients[-1]

    async def __aexit__(self, *exc: object) -> None:
        for _, writer in self.clients:
            writer.close()
        self.server.close()
        await self.runner.cleanup()


def guarded(timeout_s: float = 60.0, budget: int = 1 << 20) -> ConnectionGuard:
    guard = ConnectionGuard(64)
    guard.heads = Heads(lambda handler: handler in guard._busy, timeout_s=timeout_s, budget=budget)
    return guard


async def test_heads_in_flight_past_the_budget_close_the_oldest_and_spare_whole_requests():
    guard = guarded(budget=40_000)       # five unfinished heads of ~7 KiB, not six
    async with Served(guard) as served:
        flood = []
        for sent in range(1, 9):
            reader, writer = await served.connect()
            writer.write(UNFINISHED)
            flood.append(reader)
            await until(lambda sent=sent: len(guard.heads._flight) + guard.heads.closed == sent, "the head in flight")
        heads = guard.heads
        await until(lambda: heads.closed == 3 and heads.total == 5 * len(UNFINISHED), "the oldest three closed")
        assert [await closed_by_server(r) for r in flood[:3]] == [True] * 3      # the oldest three
        reader, writer = await served.connect()               # a whole request is answered meanwhile
        writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert guard.heads.closed == 3 and len(guard.heads._flight) == 5


async def test_an_unfinished_head_and_a_silent_connection_are_closed_at_their_deadline_an_idle_one_is_not():
    guard = guarded(timeout_s=0.5)
    async with Served(guard) as served:
        idle_reader, idle = await served.connect()            # a whole request answered: idle after, not waiting
        idle.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await idle_reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        slow_reader, slow = await served.connect()
        slow.write(UNFINISHED[:100])
        silent_reader, _ = await served.connect()
        assert await closed_by_server(slow_reader) and await closed_by_server(silent_reader)
        assert guard.heads.closed == 2 and not guard.heads._flight and not guard.heads._silent
        idle.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")      # the idle one still served
        assert (await idle_reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")


async def test_a_body_is_not_counted_and_a_head_pipelined_after_it_is():
    guard = guarded()
    async with Served(guard) as served:
        reader, writer = await served.connect()
        writer.write(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n\r\n" + b"b" * 200_000)
        await until(lambda: any(r.content.total_bytes == 200_000 for r in guard._busy.values()), "the body read")
        assert guard.heads.total == 0
        # the body's end and, in the same bytes, a next head never finished: counted but for the piece the body ends in
        writer.write(b"b" * 100_000 + NEXT)
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        await until(lambda: guard.heads.total >= len(NEXT) - PIECE, "the next head counted")
        assert guard.heads.total <= len(NEXT) and guard.heads.closed == 0


async def test_an_aiohttp_without_the_fields_read_is_said_once_at_start_and_once_at_connections(monkeypatch, caplog):
    """A future aiohttp lacking the private fields switches the bound off: said, once, not silently."""
    caplog.set_level(logging.WARNING, logger="rdzv_server")
    said = lambda: sum("request heads are not bounded" in r.getMessage() for r in caplog.records)  # noqa: E731
    monkeypatch.setattr(heads_module, "FIELDS", ("_request_count", "_no_such_field"))
    ConnectionGuard(64)                                       # at start: the class lacks one
    assert said() == 1
    monkeypatch.undo()
    guard = ConnectionGuard(64)                               # this aiohttp's class has both: nothing said
    assert said() == 1
    stripped = [object(), object()]                           # handlers lacking them all the same: said at the first
    assert [guard.heads.wrap(h) for h in stripped] == stripped
    assert said() == 2
    async with Served(guard) as served:                       # and then served unwrapped, unbounded
        reader, writer = await served.connect()
        writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert said() == 2 and not guard.heads._silent and not guard.heads._flight
