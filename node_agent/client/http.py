"""HTTP(S) transport to the rendezvous server; aiohttp's exceptions stop here (callers see `transport`'s two).
Refused at once, since waiting will not fix them: a TLS certificate --tls-ca does not verify
(`ClientCode.TLS_UNTRUSTED`), and an endpoint that answers but is not an rdzv-server (`NOT_RDZV_SERVER`:
not our protocol, or not HTTP, e.g. etcd's gRPC port), except a gateway's 502/503/504 (its server is away:
wait). A c10d TCPStore never replies: an endpoint never heard from that gives no reply within PROBE_AFTER_S
(or drops the connection) is asked whether it is one (`c10d_store`). Silence alone is waited for: a stalled
server, or a proxy whose server restarts, look the same. The job id is one percent-encoded path segment
(`team/exp1` is `team%2Fexp1`)."""
from __future__ import annotations

import asyncio
import errno
import ssl
import urllib.parse

import aiohttp
import yarl

from node_agent.client.c10d_store import answers_as_c10d_store
from node_agent.client.endpoints import LEADER_CHECK_S, LEADER_HEADER, Endpoints, origin
from node_agent.client.path_check import ANSWER_WAIT_S, CHECK_TIMEOUT_S, PathCheck, answer_due
from node_agent.client.readyz import readyz_status
from node_agent.client.replies import ClientCode, Path
from node_agent.client.transport import (
    CLOSED_BY_SERVER,
    PathBack,
    ServerRejected,
    ServerUnreachable,
    Transport,
    keepalive_socket,
    refusal,
)
from protocol.codec import CONTENT_TYPE, decode_reply, encode
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, NodeStatus

GATEWAY_AWAY = (502, 503, 504)   # a proxy answering for a server that is away
PROBE_AFTER_S = 1.0              # an rdzv-server answers a join, failure, success or leave well within this
MAX_RESENDS = 2                  # a request sent again because its answer was overdue while the path works


NAMED_MAX = 4     # leaders named by standbys that the path checks look at besides the endpoints given


class RdzvClient(Transport):
    def __init__(self, host: str, port: int, job_id: str, node_id: str, *, scheme: str = "http",
                 token: str | None = None, tls_ca: str | None = None,
                 replicas: tuple[tuple[str, int], ...] = ()) -> None:
        """`replicas`: more endpoints of the same server (replicas on etcd), after host:port."""
        self.endpoints = Endpoints([origin(scheme, h, p) for h, p in ((host, port), *replicas)])
        self._path = f"/v1/jobs/{urllib.parse.quote(job_id, safe='')}"
        super().__init__(node_id)
        self._headers = {"Content-Type": CONTENT_TYPE}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._tls_ca = tls_ca
        self._ssl: ssl.SSLContext | bool = True
        self._session: aiohttp.ClientSession | None = None
        self._heard: set[str] = set()      # endpoints that have answered HTTP: no TCPStore there
        self.path = PathCheck(self._readyz)  # is the path back? (fresh connections; path_check.py)
        self._named: list[str] = []          # leaders standbys' /readyz named, newest first: checked too

    async def __aenter__(self) -> RdzvClient:
        if self._tls_ca is not None:
            self._ssl = ssl.create_default_context(cafile=self._tls_ca)
        elif any(e.startswith("https:") for e in self.endpoints.configured):
            self._ssl = ssl.create_default_context()    # made once: the path checks use it too
        connector = aiohttp.TCPConnector(limit=8, force_close=False, socket_factory=keepalive_socket)
        self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.path.close()
        if self._session is not None:
            await self._session.close()

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        """One request, to the leader (a standby names it), skipping unreachable replicas; overdue: check the path."""
        data = encode(message)
        due = answer_due(action, float(getattr(message, "wait_s", 0.0)), self.hold_s)
        moves = resent = 0
        while True:
            try:
                reply, leader = await self._post(action, data, timeout, due)
            except PathBack:
                resent += 1      # at once, on a new connection; a server slow but there is waited for longer
                due = timeout if resent >= MAX_RESENDS else due * 2
                continue
            except ServerUnreachable:
                moves += 1
                if moves >= len(self.endpoints.configured) and not self.endpoints.following:
                    raise
                self.endpoints.skip()
                continue
            if isinstance(reply, ErrorReply):
                if reply.code == ErrorCode.NOT_LEADER.value and moves <= len(self.endpoints.configured):
                    moves += 1
                    if self.endpoints.follow(leader):
                        continue
                    self.endpoints.skip()
                raise refusal(reply.code, reply.message)
            if reply.poll_hold_s > 0:
                self.hold_s = reply.poll_hold_s
            return reply

    async def path_back(self) -> bool:
        """Wait for an endpoint ready on a fresh connection, sending there next; whether none was at first."""
        ready = await self.path.check(self._check_order())
        self.endpoints.use(ready or await self.path.until_back(self._check_order))
        return ready is None

    async def reach(self) -> Path:
        return await self.path.reach(self._check_order())

    async def _post(self, action: str, data: bytes, timeout: float,
                    due: float) -> tuple[NodeStatus | ErrorReply, str]:
        request = asyncio.ensure_future(self._post_once(self.endpoints.current, action, data, timeout))
        try:
            if action != "poll" and self.endpoints.current not in self._heard:
                return await self._first_contact(request, self.endpoints.current)
            return await self._answer_or_check(request, due)
        finally:
            request.cancel()     # if still under way: closes its connection, a stalled one is not used again
            await asyncio.gather(request, return_exceptions=True)   # its error is ours, or moot: retrieved

    async def _answer_or_check(self, request: asyncio.Future[tuple[NodeStatus | ErrorReply, str]],
                               due: float) -> tuple[NodeStatus | ErrorReply, str]:
        """`request`'s answer; once it is overdue (or, held at a replica, every LEADER_CHECK_S), the
        path is checked: `PathBack` (send again, there) once an endpoint answers a new connection."""
        waited = 0.0
        while True:
            slice_s = min(due - waited, LEADER_CHECK_S) if self.endpoints.replicated else due - waited
            done, _ = await asyncio.wait({request}, timeout=slice_s)
            if done:
                return request.result()
            waited += slice_s
            ready = await self.path.check(self._check_order())
            if request.done():
                return request.result()
            if ready is None:
                # Nobody serves: keep the connection (it may yet be answered; keepalive ends it) and check
                # on the schedule; once an endpoint answers, the request goes again there.
                back = asyncio.ensure_future(self.path.until_back(self._check_order))
                try:
                    either: set[asyncio.Future[object]] = {request, back}   # type: ignore[arg-type]
                    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    back.cancel()
                    await asyncio.gather(back, return_exceptions=True)
                if request.done():
                    return request.result()
                ready = back.result()
            if waited >= due or ready != self.endpoints.current:
                self.endpoints.use(ready)
                raise PathBack(f"no answer in {waited:.1f}s; {ready} answers a new connection")

    async def _first_contact(self, request: asyncio.Future[tuple[NodeStatus | ErrorReply, str]],
                             server: str) -> tuple[NodeStatus | ErrorReply, str]:
        """`request`'s reply; an endpoint never heard from that does not answer soon, or drops the connection,
        is asked whether it is a c10d TCPStore (refused if so). The caller cancels `request` if need be."""
        done, _ = await asyncio.wait({request}, timeout=PROBE_AFTER_S)
        failed = request.exception() if done else None
        dropped = isinstance(failed, ServerUnreachable) and not isinstance(failed.__cause__,
                                                                           aiohttp.ClientConnectorError)
        if done and (server in self._heard or not dropped):
            return request.result()      # answered (HTTP), or failed to connect at all (nothing listens)
        url = yarl.URL(server)
        if await answers_as_c10d_store(url.host or "", url.port or 0):
            raise ServerRejected(ClientCode.NOT_RDZV_SERVER,
                                 f"{server} is not an rdzv-server: a c10d TCPStore answers there (torchrun's "
                                 f"c10d rendezvous and every training job's MASTER_PORT host one); point the "
                                 f"endpoint at rdzv-server")
        return await request

    def _check_order(self) -> list[str]:
        """Where the path checks look: every endpoint, then the leaders standbys named. Given one endpoint (one
        name for all replicas) that is a standby now, only the leader it names can be found ready."""
        order = self.endpoints.in_order()
        return [*order, *(n for n in self._named if n not in order)]

    def _leader_named(self, url: str) -> None:
        """Kept, not replaced: a standby about to take over still names the leader just lost, and the one
        named before (the standby itself, at another URL) must stay checked. At most NAMED_MAX."""
        url = url.rstrip("/")
        self._named = [url, *(n for n in self._named if n != url)][:NAMED_MAX]

    async def _readyz(self, server: str) -> int | None:
        """`server`'s /readyz status over a new connection (None: none); limits: path_check.py."""
        return await readyz_status(server, ssl_context=self._ssl if isinstance(self._ssl, ssl.SSLContext) else None,
                                   connect_s=CHECK_TIMEOUT_S, answer_s=ANSWER_WAIT_S, connected=self.path.connected,
                                   named=self._leader_named)

    async def _post_once(self, server: str, action: str, data: bytes,
                         timeout: float) -> tuple[NodeStatus | ErrorReply, str]:
        assert self._session is not None, "use `async with RdzvClient(...)`"
        url = yarl.URL(f"{server}{self._path}/{action}", encoded=True)   # keep the job id's %2F as it is
        try:
            async with self._session.post(url, data=data, headers=self._headers,
                                          ssl=self._ssl, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                self._heard.add(server)
                body = await resp.read()
                leader = resp.headers.get(LEADER_HEADER, "")
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as exc:
            raise ServerRejected(ClientCode.TLS_UNTRUSTED, f"TLS with {server} failed: "
                                 f"{getattr(exc, 'certificate_error', None) or exc} (check --tls-ca)") from exc
        except aiohttp.ClientResponseError as exc:   # the reply was not HTTP
            raise ServerRejected(ClientCode.NOT_RDZV_SERVER, f"{server} is not an rdzv-server: its reply is not "
                                 f"HTTP ({str(exc.message).splitlines()[0]}); check the endpoint") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            closed = "" if not closed_by_server(exc) else f"; {CLOSED_BY_SERVER}"
            raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ") + closed) from exc
        try:
            reply = decode_reply(body)
        except Exception as exc:   # not our protocol: another service, or a gateway whose server is away
            if resp.status in GATEWAY_AWAY:
                raise ServerUnreachable(f"HTTP {resp.status} from a gateway at {server}") from exc
            raise ServerRejected(ClientCode.NOT_RDZV_SERVER, f"{server} is not an rdzv-server: it answered HTTP "
                                 f"{resp.status} ({resp.content_type or 'no content type'}) that is not the "
                                 f"rendezvous protocol; check the endpoint") from exc
        return reply, leader


def closed_by_server(exc: BaseException) -> bool:
    """Whether a failed try reached the server, which closed the connection (a reset, or a disconnect before the
    reply), rather than never connecting or timing out."""
    if isinstance(exc, (aiohttp.ClientConnectorError, asyncio.TimeoutError)):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)
