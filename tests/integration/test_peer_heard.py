"""A request whose connection ends keeps how long ago the connection's kernel last heard the peer, as
it was at the end (ConnectionGuard: the socket's TCP_INFO, still open then): a FIN just in is fresh,
however long the connection was idle, so a held poll closed by its node's host is told from one a
keepalive gave up on (core/leases.py, closing_heard)."""
from __future__ import annotations

import asyncio

from aiohttp import web

from rdzv_server.web.connections import ConnectionGuard, ack_age_s, request_ack_age_s


async def test_a_peer_closing_a_held_request_is_heard_at_its_fin():
    guard = ConnectionGuard(100)
    heard: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
    held: asyncio.Future[web.Request] = asyncio.get_running_loop().create_future()

    async def hold(request: web.Request) -> web.StreamResponse:
        held.set_result(request)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:      # the connection ended: what the coordinator asks then
            heard.set_result(request_ack_age_s(request))
            raise
        raise AssertionError("never answered")

    app = web.Application(middlewares=[guard.middleware])
    app.router.add_get("/hold", hold)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    assert runner.server is not None
    server = await asyncio.get_running_loop().create_server(guard.factory(runner.server), "127.0.0.1", 0)
    writer = None
    try:
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        request = await asyncio.wait_for(held, 10)
        assert ack_age_s(request.transport) is not None          # Linux: TCP_INFO
        idle = 0.0
        while idle < 1.0:                  # until the server has heard nothing from the client for 1 s
            await asyncio.sleep(0.05)
            idle = ack_age_s(request.transport) or 0.0
        writer.close()                     # the client's FIN
        age = await asyncio.wait_for(heard, 10)
        assert age is not None and age < idle                  # fresher than anything before it: the FIN itself
    finally:
        if writer is not None:
            writer.close()
        server.close()
        await runner.cleanup()


def test_a_socket_closed_under_its_transport_reads_as_unknown() -> None:
    """uvloop's stand-in for a transport's socket raises ValueError once the descriptor is closed
    (a stream the sweep looks at while it closes): unknown, not an error that ends the sweep."""
    class Closed:
        def getsockopt(self, *args: object) -> bytes:
            raise ValueError("negative file descriptor")

    class Transport:
        def get_extra_info(self, name: str) -> object:
            return Closed() if name == "socket" else None

    assert ack_age_s(Transport()) is None  # type: ignore[arg-type]


def test_a_connection_its_peer_closed_reads_as_closed_by_peer_until_the_server_closes_it() -> None:
    """TCP_INFO's state: a FIN in and not yet acted on (CLOSE_WAIT) is the peer's host closing it (Hub.closed_unread:
    a member's agent killed while the loop runs late); an open one is not."""
    import socket
    import time

    from rdzv_server import tcp_info

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with server:
            info = tcp_info.read(server)
            assert info is not None and not info.closed_by_peer
            client.close()                                  # the peer's FIN
            deadline = time.monotonic() + 10
            while not ((info := tcp_info.read(server)) is not None and info.closed_by_peer):
                assert time.monotonic() < deadline, info    # the FIN travels through loopback: a moment
                time.sleep(0.01)
