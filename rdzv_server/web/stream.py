"""`GET /v1/jobs/{job_id}/stream`: one WebSocket per node (docs/protocol.md, "The stream").

Access is the agent routes' (token, the browser rules of access.py); a replica that does not serve
refuses the upgrade as it refuses a request (503 `not_leader` naming the leader). Frames from the
node are decoded here and handed to the coordinator (requests) or the hub (subscribe, heartbeats:
rdzv_server/streams.py); frames to it are written straight to the connection's transport as
WebSocket frames (no task or await per frame). A frame that breaks the protocol ends the stream
with an `error` frame naming what was wrong; a request refused by the core only gets an error reply.
"""
from __future__ import annotations

import logging
import struct
from collections.abc import Iterable

from aiohttp import WSMsgType, web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from protocol.codec import REQUEST_TYPES, DecodeError, decode_request
from protocol.errors import ErrorCode
from protocol.messages import PROTOCOL_VERSION, ErrorReply, NodeStatus
from protocol.quoting import quote
from protocol.stream import (
    MAX_FRAME_BYTES,
    Error,
    FrameError,
    Heartbeat,
    Hello,
    Reply,
    Request,
    Subscribe,
    decode_client_frame,
    encode_frame,
)
from rdzv_server.core.errors import RendezvousError
from rdzv_server.serving import LEADER_HEADER
from rdzv_server.streams import StreamHub, Subscription
from rdzv_server.web.connections import TCP_INFO_LAST_DATA_RECV, tcp_info_age_s
from rdzv_server.web.routing import COORDINATOR, job_id_of

log = logging.getLogger("rdzv_server")

HUB = web.AppKey("stream_hub", StreamHub)
ROUTE_NAME = "agent-stream"
ELECTION_WAIT_S = 3.0             # a request waits this long for an election to end (as on HTTP, app.py)
WRITE_BUFFER_CAP = 64 * 1024      # bytes a node may leave unread before its stream is closed


def ws_frame(payload: bytes, opcode: int = 0x2) -> bytes:
    """One unmasked, final WebSocket frame (RFC 6455 5.2): binary by default."""
    n = len(payload)
    if n < 126:
        return bytes((0x80 | opcode, n)) + payload
    if n < 1 << 16:
        return struct.pack("!BBH", 0x80 | opcode, 126, n) + payload
    return struct.pack("!BBQ", 0x80 | opcode, 127, n) + payload


class WsStream:
    """The hub's view of one WebSocket: push a frame, close with an error frame, kernel silence."""

    def __init__(self, request: web.Request, cap: int) -> None:
        self.transport = request.transport
        self.cap = cap

    def push(self, frame: bytes) -> bool:
        t = self.transport
        if t is None or t.is_closing():
            return False
        t.write(ws_frame(frame))
        return t.get_write_buffer_size() <= self.cap

    def close(self, code: ErrorCode, message: str, leader: str = "") -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if t.get_write_buffer_size() > self.cap:
            t.abort()            # it does not read: nothing more can reach it
            return
        t.write(ws_frame(encode_frame(Error(code=code.value, message=message, leader=leader))))
        t.write(ws_frame(struct.pack("!H", 1008 if code is not ErrorCode.SHUTTING_DOWN else 1001), 0x8))
        t.close()

    def kernel_silence_s(self) -> float:
        age = tcp_info_age_s(self.transport, TCP_INFO_LAST_DATA_RECV)
        return float("inf") if age is None else age


async def agent_stream(request: web.Request) -> web.StreamResponse:
    coord, hub = request.app[COORDINATOR], request.app[HUB]
    job_id = job_id_of(request)
    if not coord.serving():
        raise coord.gate.not_serving()          # before the upgrade: a standby names the leader (503)
    ws = web.WebSocketResponse(max_msg_size=MAX_FRAME_BYTES, compress=False, autoping=True)
    if not ws.can_prepare(request).ok:
        raise DecodeError(ErrorCode.BAD_REQUEST, "this route takes a WebSocket upgrade (docs/protocol.md)")
    await ws.prepare(request)
    stream = WsStream(request, WRITE_BUFFER_CAP)
    sub = hub.opened(job_id, "", stream)
    try:
        await _frames(request, ws, hub, sub, stream)
    except FrameError as exc:
        hub.end(sub, exc.code, exc.message, f"bad frame: {exc.code.value}")
    except Exception:  # a bug: logged, the node told without a traceback
        log.exception("internal error on a stream of job %s", quote(job_id))
        hub.end(sub, ErrorCode.INTERNAL, "internal server error (logged on the server)", "internal")
    finally:
        hub.closed(sub)
    return ws


async def _frames(request: web.Request, ws: web.WebSocketResponse, hub: StreamHub, sub: Subscription,
                  stream: WsStream) -> None:
    """Read frames until the stream ends; a frame that breaks the protocol raises FrameError."""
    while True:
        msg = await ws.receive()
        if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
            return
        if msg.type is WSMsgType.ERROR:        # e.g. over max_msg_size: aiohttp closed it (1009)
            sub.ended = "bad frame: too_large" if "size" in str(msg.data).lower() else "bad frame: websocket"
            return
        hub.heard(sub)
        if msg.type is not WSMsgType.BINARY:
            raise FrameError(ErrorCode.BAD_REQUEST, "frames are binary WebSocket messages holding a MessagePack map")
        frame = decode_client_frame(msg.data)
        if isinstance(frame, Hello):
            _hello(sub, frame)
        elif not sub.node_id:
            raise FrameError(ErrorCode.BAD_REQUEST,
                             f"the first frame must be `hello`, got {quote(type(frame).__name__)}")
        elif isinstance(frame, Request):
            stream.push(encode_frame(await _request(request, sub, frame)))
        elif isinstance(frame, Subscribe):
            try:
                hub.subscribe(sub, frame.credential, frame.known_round, frame.master_port)
            except RendezvousError as exc:
                raise FrameError(exc.code, exc.message) from None
        else:
            assert isinstance(frame, Heartbeat)


def _hello(sub: Subscription, frame: Hello) -> None:
    if sub.node_id:
        raise FrameError(ErrorCode.BAD_REQUEST, "`hello` twice: a stream speaks for one node")
    if frame.v != PROTOCOL_VERSION:
        raise FrameError(ErrorCode.UNSUPPORTED_VERSION, f"protocol version {quote(frame.v)} is not supported; "
                         f"this server speaks {PROTOCOL_VERSION}")
    sub.node_id = frame.node_id


async def _request(request: web.Request, sub: Subscription, frame: Request) -> Reply:
    """One request on the stream, answered as on HTTP (a refusal is an error reply, not the end)."""
    coord, counts = request.app[COORDINATOR], request.app[HUB].counts
    cls = REQUEST_TYPES.get(frame.action)
    if cls is None or frame.action == "poll":
        raise FrameError(ErrorCode.BAD_REQUEST, f"no stream action {quote(frame.action)}; expected one of join, "
                         "failure, success, leave (subscribe instead of polling)")
    try:
        req = decode_request(cls, bytes(frame.body))
    except DecodeError as exc:
        counts.request(frame.action, exc.code.value)
        return Reply(id=frame.id, error=ErrorReply(code=exc.code.value, message=exc.message))
    if req.node_id != sub.node_id:
        raise FrameError(ErrorCode.FORBIDDEN, f"a request for node {quote(req.node_id)} on the stream of node "
                         f"{quote(sub.node_id)}: a stream speaks for the node its hello named")
    try:
        if not await coord.gate.until_serving(ELECTION_WAIT_S):
            raise coord.gate.not_serving()
        status: NodeStatus = await coord.handle(sub.job_id, req, request.remote or "", _local(request))
    except RendezvousError as exc:
        counts.request(frame.action, exc.code.value)
        return Reply(id=frame.id, error=ErrorReply(code=exc.code.value, message=_with_leader(exc)))
    counts.request(frame.action, "ok")
    return Reply(id=frame.id, status=status)


def _with_leader(exc: RendezvousError) -> str:
    leader = (exc.headers or {}).get(LEADER_HEADER, "")
    return f"{exc.message} [leader: {leader}]" if leader else exc.message


def _local(request: web.Request) -> str:
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return str(sockname[0]) if sockname else ""


class StreamCollector(Collector):
    """rdzv_open_streams, rdzv_stream_frames_pushed_total, rdzv_stream_flush_seconds (a summary),
    rdzv_stream_last_flush_seconds, rdzv_streams_closed_total{reason}, rdzv_stream_requests_total{action,outcome}."""

    def __init__(self, hub: StreamHub) -> None:
        self.hub = hub

    def collect(self) -> Iterable[Metric]:
        hub = self.hub
        yield GaugeMetricFamily("rdzv_open_streams", "Agent streams open now.", value=len(hub.open))
        yield CounterMetricFamily("rdzv_stream_frames_pushed", "Status frames pushed on streams.",
                                  value=hub.counts.pushed)
        flushes = SummaryMetricFamily("rdzv_stream_flush_seconds", "Fan-outs: every subscriber of the woken jobs "
                                      "looked at and its changed view written (the kernel's sends included).",
                                      count_value=hub.counts.flushes, sum_value=hub.counts.flush_s)
        yield flushes
        yield GaugeMetricFamily("rdzv_stream_last_flush_seconds", "How long the last fan-out took.",
                                value=hub.counts.last_flush_s)
        closed = CounterMetricFamily("rdzv_streams_closed", "Streams ended, by why (bad frames, silence, a "
                                     "slow reader, the client).", labels=["reason"])
        for reason, count in sorted(hub.counts.closed.items()):
            closed.add_metric([reason], count)
        yield closed
        requests = CounterMetricFamily("rdzv_stream_requests", "Requests answered on streams, by action and "
                                       "outcome (ok, or the error code).", labels=["action", "outcome"])
        for (action, outcome), count in sorted(hub.counts.requests.items()):
            requests.add_metric([action, outcome], count)
        yield requests


def add_stream_route(app: web.Application) -> None:
    hub = StreamHub(app[COORDINATOR])
    app[HUB] = hub
    app.router.add_get("/v1/jobs/{job_id}/stream", agent_stream, name=ROUTE_NAME)


def register_metrics(app: web.Application, registry: CollectorRegistry) -> None:
    registry.register(StreamCollector(app[HUB]))
