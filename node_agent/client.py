"""HTTP transport to the rendezvous server. aiohttp's exceptions stop here: callers see the two
kinds from `transport` (`ServerUnreachable`, `ServerRejected`)."""
from __future__ import annotations

import asyncio

import aiohttp

from protocol.codec import CONTENT_TYPE, decode_reply, encode
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, NodeStatus
from node_agent.transport import ServerRejected, ServerUnreachable, Transport


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
            raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
        try:
            reply = decode_reply(body)
        except Exception:
            raise ServerUnreachable(f"unreadable reply (HTTP {resp.status}) from {self.base}") from None
        if isinstance(reply, ErrorReply):
            if reply.code == ErrorCode.SHUTTING_DOWN.value:
                raise ServerUnreachable(f"server going away: {reply.message}")
            if reply.code == ErrorCode.STORE_UNAVAILABLE.value:
                raise ServerUnreachable(f"server cannot save state: {reply.message}")
            raise ServerRejected(reply.code, reply.message)
        return reply
