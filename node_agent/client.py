"""HTTP(S) transport to the rendezvous server. aiohttp's exceptions stop here: callers see the two
kinds from `transport` (`ServerUnreachable`, `ServerRejected`).

Refused at once (waiting will not fix them), so the agent stops with one line:
- a server whose TLS certificate does not verify against --tls-ca (`TLS_UNTRUSTED`);
- an endpoint that answers but is not an rdzv-server (`NOT_RDZV_SERVER`): a reply that is not our
  protocol, or not HTTP at all (a c10d store, etcd's gRPC port). A gateway's 502/503/504 page is the
  exception: the server behind it is away, which is worth waiting for.
The job id is one path segment, percent-encoded (`team/exp1` is `team%2Fexp1`).
"""
from __future__ import annotations

import asyncio
import ssl
import urllib.parse

import aiohttp
import yarl

from protocol.codec import CONTENT_TYPE, decode_reply, encode
from protocol.messages import ErrorReply, NodeStatus
from node_agent.facts import NOT_RDZV_SERVER, TLS_UNTRUSTED
from node_agent.transport import ServerRejected, ServerUnreachable, Transport, keepalive_socket, refusal

GATEWAY_AWAY = (502, 503, 504)   # a proxy answering for a server that is away


class RdzvClient(Transport):
    def __init__(self, host: str, port: int, job_id: str, node_id: str, *, scheme: str = "http",
                 token: str | None = None, tls_ca: str | None = None) -> None:
        bracketed = f"[{host}]" if ":" in host else host
        self.origin = f"{scheme}://{bracketed}:{port}"
        self.base = f"{self.origin}/v1/jobs/{urllib.parse.quote(job_id, safe='')}"
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
        url = yarl.URL(f"{self.base}/{action}", encoded=True)   # keep the job id's %2F as it is
        try:
            async with self._session.post(url, data=encode(message), headers=self._headers,
                                          ssl=self._ssl, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.read()
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as exc:
            raise ServerRejected(TLS_UNTRUSTED, f"TLS with {self.origin} failed: "
                                 f"{getattr(exc, 'certificate_error', None) or exc} (check --tls-ca)") from exc
        except aiohttp.ClientResponseError as exc:   # the reply was not HTTP
            raise ServerRejected(NOT_RDZV_SERVER, f"{self.origin} is not an rdzv-server: its reply is not "
                                 f"HTTP ({str(exc.message).splitlines()[0]}); check the endpoint") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        try:
            reply = decode_reply(body)
        except Exception as exc:   # not our protocol: another service, or a gateway whose server is away
            if resp.status in GATEWAY_AWAY:
                raise ServerUnreachable(f"HTTP {resp.status} from a gateway at {self.origin}") from exc
            raise ServerRejected(NOT_RDZV_SERVER, f"{self.origin} is not an rdzv-server: it answered HTTP "
                                 f"{resp.status} ({resp.content_type or 'no content type'}) that is not the "
                                 f"rendezvous protocol; check the endpoint") from exc
        if isinstance(reply, ErrorReply):
            raise refusal(reply.code, reply.message)
        return reply
