"""HTTP transport to the rendezvous server. aiohttp's exceptions stop here: callers see the two
kinds from `transport` (`ServerUnreachable`, `ServerRejected`)."""
from __future__ import annotations

import asyncio

import aiohttp

from protocol.codec import CONTENT_TYPE, decode_reply, encode
from protocol.messages import ErrorReply, NodeStatus
from node_agent.transport import ServerUnreachable, Transport, refusal


class RdzvClient(Transport):
    def __init__(self, host: str, port: int, job_id: str, node_id: str) -> None:
        bracketed = f"[{host}]" if ":" in host else host
        self.base = f"http://{bracketed}:{port}/v1/jobs/{job_id}"
        super().__init__(node_id)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RdzvClient:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8, force_close=False))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        assert self._session is not None, "use `async with RdzvClient(...)`"
        try:
            async with self._session.post(f"{self.base}/{action}", data=encode(message),
                                          headers={"Content-Type": CONTENT_TYPE},
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        try:
            reply = decode_reply(body)
        except Exception as exc:   # not our protocol (a proxy's error page, a cut body): not an answer
            raise ServerUnreachable(f"unreadable reply (HTTP {resp.status}) from {self.base}") from exc
        if isinstance(reply, ErrorReply):
            raise refusal(reply.code, reply.message)
        return reply
