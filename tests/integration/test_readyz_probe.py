"""The agent's path check over real sockets (node_agent/client/readyz.py): /readyz's status over plain
HTTP and TLS, what is not an answer, and a TLS server too busy to accept: the probe that has connected
is kept past its round (one connection in the server's queue, not one more each round) and its late
answer counts."""
from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from node_agent.client.http import RdzvClient
from node_agent.client.path_check import CHECK_TIMEOUT_S
from node_agent.client.readyz import readyz_status
from node_agent.client.replies import Path
from tests.e2e.certs import make_ca, make_server_cert


async def _serve(status: int, tls: ssl.SSLContext | None = None,
                 headers: dict[str, str] | None = None) -> tuple[web.AppRunner, int]:
    async def readyz(_: web.Request) -> web.Response:
        return web.Response(status=status, text="ready" if status == 200 else "standby", headers=headers)

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    return runner, runner.addresses[0][1]


@pytest.fixture
def tls(tmp_path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(the server's context, a client context trusting its CA)."""
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=ca[0])


@pytest.fixture
async def unaccepting() -> AsyncIterator[socket.socket]:
    """A listening socket nobody accepts from (a server too busy to): the kernel completes handshakes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield listener
    listener.close()


async def _ask(server: str, context: ssl.SSLContext | None = None) -> tuple[int | None, int]:
    told: list[bool] = []
    status = await readyz_status(server, ssl_context=context, connect_s=2.0, answer_s=5.0,
                                 connected=lambda: told.append(True))
    return status, len(told)


@pytest.mark.parametrize("status", [200, 503])
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])   # an address as it is, a name resolved
async def test_the_status_over_plain_http(status, host):
    runner, port = await _serve(status)
    try:
        assert await _ask(f"http://{host}:{port}") == (status, 1)
    finally:
        await runner.cleanup()


async def test_the_status_over_tls_with_the_ca_and_none_without_it(tls):
    server_ctx, client_ctx = tls
    runner, port = await _serve(200, server_ctx)
    try:
        assert await _ask(f"https://127.0.0.1:{port}", client_ctx) == (200, 1)
        assert await _ask(f"https://127.0.0.1:{port}") == (None, 1)      # the system's CAs do not trust it
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("leader,seen", [("http://10.0.0.6:29400", "http://10.0.0.6:29400"),
                                         ("ftp://x", None), ("http://a b", None), ("http://" + "a" * 600, None)])
@pytest.mark.parametrize("over_tls", [False, True])
async def test_a_standby_names_the_leader_and_nothing_else_is_taken(tls, leader, seen, over_tls):
    server_ctx, client_ctx = tls
    runner, port = await _serve(503, server_ctx if over_tls else None, headers={"Rdzv-Leader": leader})
    named: list[str] = []
    try:
        status = await readyz_status(f"{'https' if over_tls else 'http'}://127.0.0.1:{port}",
                                     ssl_context=client_ctx if over_tls else None, connect_s=2.0, answer_s=5.0,
                                     named=named.append)
        assert (status, named) == (503, [seen] if seen else [])
    finally:
        await runner.cleanup()


async def test_nothing_listening_is_none_and_never_connected(unaccepting):
    port = unaccepting.getsockname()[1]
    unaccepting.close()
    assert await _ask(f"http://127.0.0.1:{port}") == (None, 0)


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH_9.2\r\n", b"HTTP/1.1 2x0 OK\r\n", b""])
async def test_an_answer_that_is_not_http_is_none(answer):
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        writer.close()

    server = await asyncio.start_server(reply, "127.0.0.1", 0)
    try:
        assert await _ask(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}") == (None, 1)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_tls_server_too_busy_to_accept_has_one_probe_queued_and_its_late_answer_counts(
        tls, unaccepting, tmp_path):
    server_ctx, _ = tls
    port = unaccepting.getsockname()[1]
    endpoint = f"https://127.0.0.1:{port}"
    client = RdzvClient("127.0.0.1", port, "job", "node", scheme="https", tls_ca=str(tmp_path / "test-ca.pem"))
    async with client:
        assert await client.path.check([endpoint]) is None        # no answer within the round
        assert await client.path.check([endpoint]) is None        # nor the next: asked through the same probe

        conn, _ = await asyncio.to_thread(unaccepting.accept)     # the server gets to it, late
        try:
            await asyncio.to_thread(_answer_over_tls, conn, server_ctx)
            assert await client.path.reach([endpoint]) == Path.REACHED
        finally:
            conn.close()
        unaccepting.setblocking(False)
        with pytest.raises(BlockingIOError):                    # no other probe ever queued
            unaccepting.accept()


def _answer_over_tls(conn: socket.socket, context: ssl.SSLContext) -> None:
    conn.settimeout(CHECK_TIMEOUT_S * 10)
    with context.wrap_socket(conn, server_side=True) as tls_conn:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = tls_conn.recv(4096)
            assert chunk, "the probe closed before its request"
            request += chunk
        assert request.startswith(b"GET /readyz HTTP/1.1\r\n")
        tls_conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nready")
