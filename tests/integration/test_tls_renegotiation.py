"""No TLS 1.2 renegotiation on a port we serve (the agent's copy port: node_agent/copies/tls.py; the server's:
rdzv_server/cli.py): a certificate holder renegotiating in a loop would cost a handshake's CPU each time. OpenSSL 3
refuses a client's renegotiation by default, 1.1.1 allowed it; here each context is also given OpenSSL 1.1.1's
default (ALLOW_CLIENT_RENEGOTIATION), so that only our own OP_NO_RENEGOTIATION can refuse it. `openssl s_client
-tls1_2` asks (its `R` command) and is refused; a peer that does not ask is answered as before."""
from __future__ import annotations

import asyncio
import shutil
import socket
import ssl

import pytest

from node_agent.client.listener import Listener
from node_agent.copies.tls import copy_tls
from protocol.accepting import Caps
from rdzv_server import cli
from tests.e2e.certs import make_ca, make_server_cert

ALLOW_CLIENT_RENEGOTIATION = 1 << 8      # SSL_OP_ALLOW_CLIENT_RENEGOTIATION (OpenSSL 3); Python names it not
WAIT_S = 20.0


def contexts(tmp_path) -> tuple[dict[str, ssl.SSLContext], str, str, str]:
    """The two server-side contexts as the product makes them, and the CA, a certificate and its key."""
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    server = cli.config_from(cli.build_parser().parse_args(["--tls-cert", cert, "--tls-key", key])).tls
    assert server is not None
    return {"copy port": copy_tls(cert, key, ca[0]).listen, "server": server}, ca[0], cert, key


@pytest.mark.parametrize("which", ["copy port", "server"])
def test_every_server_context_refuses_renegotiation(which: str, tmp_path) -> None:
    made, _, _, _ = contexts(tmp_path)
    assert made[which].options & ssl.OP_NO_RENEGOTIATION


async def _until(stream: asyncio.StreamReader, *marks: bytes) -> bytes:
    """What s_client printed, up to a line holding one of `marks` or its end."""
    seen = b""
    while not any(m in seen for m in marks):
        line = await stream.readline()
        if not line:
            break
        seen += line
    return seen


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line tool")
@pytest.mark.skipif(ssl.OPENSSL_VERSION_INFO < (3,), reason="ALLOW_CLIENT_RENEGOTIATION is OpenSSL 3's option")
@pytest.mark.parametrize("which", ["copy port", "server"])
async def test_a_client_asking_to_renegotiate_is_refused_and_a_peer_still_served(which: str, tmp_path) -> None:
    made, ca, cert, key = contexts(tmp_path)
    tls = made[which]
    tls.options |= ALLOW_CLIENT_RENEGOTIATION        # as OpenSSL 1.1.1 was: ours alone must refuse it

    async def answer(line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok " + line)
        await writer.drain()

    listener = Listener(answer, Caps(total=8, per_source=8), [].append, tls=tls)
    port = await listener.start("127.0.0.1")
    client = await asyncio.create_subprocess_exec(
        "openssl", "s_client", "-tls1_2", "-connect", f"127.0.0.1:{port}", "-CAfile", ca, "-cert", cert,
        "-key", key, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        assert client.stdin is not None and client.stdout is not None
        said = await asyncio.wait_for(_until(client.stdout, b"Verify return code"), WAIT_S)
        assert b"Protocol  : TLSv1.2" in said
        client.stdin.write(b"R\n")
        await client.stdin.drain()
        said = await asyncio.wait_for(_until(client.stdout, b"RENEGOTIATING"), WAIT_S)
        client.stdin.write(b"rdzv-agent after\n")          # answered only where the renegotiation went through
        await client.stdin.drain()
        said = await asyncio.wait_for(_until(client.stdout, b"ok rdzv-agent after", b"no renegotiation"), WAIT_S)
        assert b"no renegotiation" in said and b"ok rdzv-agent" not in said

        def ask() -> bytes:                                  # a peer that does not renegotiate
            connect = ssl.create_default_context(cafile=ca)
            connect.load_cert_chain(cert, key)
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw, \
                    connect.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"rdzv-agent ask\n")
                return s.makefile("rb").readline()

        assert await asyncio.to_thread(ask) == b"ok rdzv-agent ask\n"
    finally:
        if client.returncode is None:
            client.kill()
        await client.wait()
        await listener.close()
