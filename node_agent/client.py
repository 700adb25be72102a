"""HTTP(S) transport to the rendezvous server. aiohttp's exceptions stop here: callers see the two
kinds from `transport` (`ServerUnreachable`, `ServerRejected`).

A server whose TLS certificate does not verify against --tls-ca is not "unreachable" (waiting will
not fix it): it is refused at once with the code `TLS_UNTRUSTED`, so the agent stops with one line.
"""
from __future__ import annotations

import asyncio
import ssl

import aiohttp

from protocol.codec import CONTENT_TYPE, decode_reply, encode
from protocol.messages import ErrorReply, NodeStatus
from node_agent.facts import TLS_UNTRUSTED
from node_agent.transport import ServerRejected, ServerUnreachable, Transport, keepalive_socket, refusal


class RdzvClient(Transport):
    def __init__(self, host: str, port: int, job_id: str, node_id: str, *, scheme: str = "http",
                 token: str | None = None, tls_ca: str | None = None) -> None:
        bracketed = f"[{host}]" if ":" in host else host
        self.base = f"{scheme}://{bracketed}:{port}/v1/jobs/{job_id}"
        super().__init__(node_id)
        self._headers = {"Content-Type": CONTENT_TYPE}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._tls_ca = tls_ca
        self._ssl: ssl.SSLContext | bool = True
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RdzvClient:
        if self._tls_ca is not None:
            self._ssl = ssl.create_default_context(cafile=self._tls_ca)
        connector = aiohttp.TCPConnector(limit=8, force_close=False, socket_factory=keepalive_socket)
        self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        assert self._session is not None, "use `async with RdzvClient(...)`"
        try:
            async with self._session.post(f"{self.base}/{action}", data=encode(message), headers=self._headers,
                                          ssl=self._ssl, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.read()
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as exc:
            raise ServerRejected(TLS_UNTRUSTED, f"TLS with {self.base.split('/v1/')[0]} failed: "
                                 f"{getattr(exc, 'certificate_error', None) or exc} (check --tls-ca)") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        try:
            reply = decode_reply(body)
        except Exception as exc:   # not our protocol (a proxy's error page, a cut body): not an answer
            raise ServerUnreachable(f"unreadable reply (HTTP {resp.status}) from {self.base}") from exc
        if isinstance(reply, ErrorReply):
            raise refusal(reply.code, reply.message)
        return reply
