"""The stream transport: one WebSocket to the server per node (docs/protocol.md, "The stream").

Requests (join, failure, success, leave) go on the stream as frames with an id and are answered by
a reply frame of that id; a poll is answered from the statuses the server pushes once subscribed
(no request goes out: the stream is the lease, kept by a heartbeat every lease_timeout_s / 3).
Against a server that does not offer the stream (its /healthz names no `stream` version), or when
asked for `poll`, every call goes over HTTP as `RdzvClient` sends it, as in `auto` once something on
the way refuses the upgrade itself: the stream is an upgrade, never a requirement. A standby's
`not_leader` (a refused upgrade, or an error frame) names the leader, which is followed as on HTTP;
a closed stream is `ServerUnreachable` for what waited on it, and the next call opens a new one
(subscribing again re-syncs the node's view).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import aiohttp
import msgspec

from node_agent.client.endpoints import LEADER_CHECK_S, LEADER_HEADER
from node_agent.client.http import GATEWAY_AWAY, PROBE_AFTER_S, RdzvClient
from node_agent.client.transport import ServerRejected, ServerUnreachable, bound_unacked_sends, refusal
from protocol.codec import encode
from protocol.errors import ErrorCode
from protocol.messages import PROTOCOL_VERSION, NodeStatus, PollRequest, poll_ready
from protocol.stream import (
    MAX_FRAME_BYTES,
    STREAM_PATH,
    STREAM_VERSION,
    Error,
    Heartbeat,
    Hello,
    Reply,
    Request,
    Status,
    Subscribe,
    decode_server_frame,
    encode_frame,
)

TRANSPORTS = ("auto", "stream", "poll")     # auto: the stream where the server offers it
HEARTBEATS_PER_LEASE = 3



class _Link:
    """One open stream: its socket, reader and heartbeat tasks, requests awaiting a reply, the latest push."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.pending: dict[int, asyncio.Future[Reply]] = {}
        self.latest: NodeStatus | None = None
        self.news = asyncio.Event()
        self.broken: Exception | None = None
        self.subscribed: tuple[str, int] | None = None     # (credential, master_port) last subscribed with
        self.lease_s = 5.0
        self.tasks: list[asyncio.Task[None]] = []

    def fail(self, exc: Exception) -> None:
        if self.broken is None:
            self.broken = exc
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(self.broken)
        self.pending.clear()
        self.news.set()


class StreamClient(RdzvClient):
    def __init__(self, host: str, port: int, job_id: str, node_id: str, *, transport: str = "auto",
                 **kwargs: Any) -> None:
        """`transport`: "auto" (the stream where the server offers it), "stream" (only), "poll" (HTTP)."""
        super().__init__(host, port, job_id, node_id, **kwargs)
        self.mode = transport
        self.streaming: bool | None = {"auto": None, "stream": True, "poll": False}[transport]
        self._link: _Link | None = None
        self._ids = itertools.count()

    async def __aexit__(self, *exc: object) -> None:
        await self._drop_link()
        await super().__aexit__(*exc)

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        if self.streaming is None:
            self.streaming = await self._offered()
        if not self.streaming:      # None: not known yet; this request goes over HTTP, which says what is wrong
            return await super()._send(action, message, timeout)
        try:
            link = await self._open(timeout)
        except UpgradeRefused:
            if self.mode != "auto":
                raise
            # The server offers the stream but something on the way (a proxy, a gateway that does not
            # pass WebSocket upgrades) refused it: auto means the stream only where it works.
            self.streaming = False
            return await super()._send(action, message, timeout)
        if isinstance(message, PollRequest):
            return await self._poll(link, message)
        return await self._call(link, action, message, timeout)

    async def _offered(self) -> bool | None:
        """Whether the server speaks the stream (its /healthz says so); None when that cannot be told now
        (nothing answers, or not soon: a TCPStore never does; a certificate that does not verify): the
        request then goes over HTTP, whose answer says what is wrong, and the next one asks again."""
        assert self._session is not None
        try:
            async with self._session.get(f"{self.endpoints.current}/healthz", ssl=self._ssl,
                                         timeout=aiohttp.ClientTimeout(total=PROBE_AFTER_S)) as resp:
                if resp.status in GATEWAY_AWAY:
                    return None
                body = await resp.json(content_type=None)
        except (aiohttp.ClientConnectorError, aiohttp.ClientSSLError, aiohttp.ServerDisconnectedError,
                asyncio.TimeoutError, OSError):
            return None
        except (aiohttp.ClientError, ValueError):
            return False                   # HTTP, but not our server's answer: an old server, or another service
        return isinstance(body, dict) and body.get("stream") == STREAM_VERSION

    async def _open(self, timeout: float) -> _Link:
        link = self._link
        if link is not None and link.broken is None:
            return link
        await self._drop_link()
        assert self._session is not None
        for _ in range(len(self.endpoints.configured) + 1):
            try:
                ws = await asyncio.wait_for(self._session.ws_connect(
                    f"{self.base}/{STREAM_PATH}", headers=self._auth(), ssl=self._ssl, autoping=True, compress=0,
                    max_msg_size=MAX_FRAME_BYTES, timeout=aiohttp.ClientWSTimeout(ws_close=2.0)),
                    min(timeout, self.REQUEST_TIMEOUT_S))     # a frozen server accepts, then never answers
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status == 503 and exc.headers and self.endpoints.follow(exc.headers.get(LEADER_HEADER, "")):
                    continue               # a standby named the leader
                raise _handshake_refusal(exc) from None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                if self.endpoints.replicated or self.endpoints.following:
                    self.endpoints.skip()
                raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
            # the server sends nothing to an idle node: the heartbeats' ACKs tell a dead path (transport.py)
            bound_unacked_sends(ws.get_extra_info("socket"))
            link = self._link = _Link(ws)
            await ws.send_bytes(encode_frame(Hello(v=PROTOCOL_VERSION, node_id=self.node_id)))
            link.tasks = [asyncio.create_task(self._read(link)), asyncio.create_task(self._beat(link))]
            return link
        raise ServerUnreachable("no replica answered as the leader")

    def _auth(self) -> dict[str, str]:
        return {k: v for k, v in self._headers.items() if k == "Authorization"}

    async def _drop_link(self) -> None:
        link, self._link = self._link, None
        if link is None:
            return
        link.fail(ServerUnreachable("the stream was closed"))
        for task in link.tasks:
            task.cancel()
        await asyncio.gather(*link.tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await link.ws.close()

    async def _read(self, link: _Link) -> None:
        why: Exception = ServerUnreachable("the server closed the stream")
        try:
            async for msg in link.ws:
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    continue
                frame = decode_server_frame(msg.data)
                if isinstance(frame, Reply):
                    fut = link.pending.pop(frame.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(frame)
                elif isinstance(frame, Status):
                    link.latest, link.lease_s = frame.status, frame.status.lease_timeout_s
                    link.news.set()
                elif isinstance(frame, Error):
                    why = self._closed_with(frame)
        except Exception as exc:   # a frame that is not ours, a reset: the stream is over either way
            why = ServerUnreachable(f"the stream broke: {type(exc).__name__}: {exc}")
        link.fail(why)

    def _closed_with(self, frame: Error) -> Exception:
        if frame.code == ErrorCode.NOT_LEADER.value and frame.leader:
            self.endpoints.follow(frame.leader)
        return refusal(frame.code, frame.message)

    async def _beat(self, link: _Link) -> None:
        """A heartbeat every lease / 3: the server counts it as contact (a silent stream is closed)."""
        frame = encode_frame(Heartbeat())
        with contextlib.suppress(Exception):
            while link.broken is None:
                await asyncio.sleep(link.lease_s / HEARTBEATS_PER_LEASE)   # a period, not a wait for an event
                await link.ws.send_bytes(frame)

    async def _call(self, link: _Link, action: str, message: object, timeout: float) -> NodeStatus:
        rid = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        link.pending[rid] = fut
        try:
            await link.ws.send_bytes(encode_frame(Request(id=rid, action=action, body=msgspec.Raw(encode(message)))))
            reply = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServerUnreachable(f"no reply to {action} on the stream within {timeout:g}s") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            broke = ServerUnreachable(f"the stream broke: {exc}")
            link.fail(broke)
            raise broke from exc
        finally:
            link.pending.pop(rid, None)
        if reply.error is not None:
            if reply.error.code == ErrorCode.NOT_LEADER.value:
                link.fail(ServerUnreachable(reply.error.message))    # reconnect: the upgrade names the leader
            raise refusal(reply.error.code, reply.error.message)
        assert reply.status is not None
        if reply.status.lease_timeout_s:
            link.lease_s = reply.status.lease_timeout_s
        return reply.status

    async def _poll(self, link: _Link, req: PollRequest) -> NodeStatus:
        """The latest pushed view once it answers `req` (as the server's long-poll would), or at the end
        of its wait; subscribes first (again, to publish a new master_port)."""
        port = req.master_port or (link.subscribed[1] if link.subscribed else 0)
        if link.subscribed != (req.credential, port):
            link.latest = None
            link.subscribed = (req.credential, port)
            await link.ws.send_bytes(encode_frame(Subscribe(credential=req.credential, known_round=req.known_round,
                                                            master_port=port)))
        loop = asyncio.get_running_loop()
        ends = loop.time() + req.wait_s
        while True:
            latest = link.latest
            if link.broken is not None:
                raise link.broken
            if latest is not None and (poll_ready(latest, req.known_round) or loop.time() >= ends):
                return latest
            link.news.clear()
            left = ends - loop.time() if latest is not None else self.REQUEST_TIMEOUT_S
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(link.news.wait(), min(max(left, 0.0), LEADER_CHECK_S))
            if not link.news.is_set() and latest is None and loop.time() >= ends + self.REQUEST_TIMEOUT_S:
                link.fail(ServerUnreachable("no status on the stream after subscribing"))
            elif (not link.news.is_set() and self.endpoints.replicated
                  and await self._probe(self.endpoints.current) != 200):   # a fresh connection: is it still leader?
                link.fail(ServerUnreachable(f"{self.endpoints.current} no longer answers as the leader"))
                self.endpoints.skip()         # as on HTTP: the next replica given names the leader


class UpgradeRefused(ServerRejected):
    """The upgrade to the stream was refused for what it is (not for the node's token or origin): in
    `auto`, the client goes on over HTTP."""


def _handshake_refusal(exc: aiohttp.WSServerHandshakeError) -> Exception:
    """A refused upgrade, as the HTTP client would see the same refusal."""
    if exc.status == 401:
        return ServerRejected(ErrorCode.UNAUTHORIZED.value, "the stream's upgrade was refused: missing or wrong "
                              "token (start node-agent with --token-file)")
    if exc.status == 403:
        return ServerRejected(ErrorCode.FORBIDDEN.value, f"the stream's upgrade was refused: {exc.message}")
    if exc.status in (400, 404, 405, 426, 501):
        return UpgradeRefused(ErrorCode.NOT_FOUND.value, f"the stream's upgrade was refused (HTTP {exc.status}): "
                              "the server, or something on the way to it, does not pass WebSocket upgrades "
                              "(use --transport poll, or auto)")
    return ServerUnreachable(f"the stream's upgrade got HTTP {exc.status}: {exc.message}")
