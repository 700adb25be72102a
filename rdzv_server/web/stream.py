"""`GET /v1/jobs/{job_id}/stream`: one WebSocket per node (docs/protocol.md, "The stream").

Access is the agent routes' (token, the browser rules of access.py); a replica that does not serve
refuses the upgrade as it refuses a request (503 `not_leader` naming the leader). Frames from the
node are decoded here and handed to the coordinator (requests) or the hub (subscribe, heartbeats:
rdzv_server/streams.py); once upgraded the connection is read and written by its own protocol
(web/stream_connection.py: no aiohttp objects, task or await per frame). A frame that breaks the
protocol ends the stream with an `error` frame naming what was wrong; a request refused by the core
only gets an error reply.
"""
from __future__ import annotations

from collections.abc import Awaitable, Iterable

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from protocol.codec import REQUEST_TYPES, DecodeError, decode_request
from protocol.errors import ErrorCode
from protocol.messages import PROTOCOL_VERSION, ErrorReply, NodeStatus
from protocol.quoting import quote
from protocol.stream import (
    MAX_FRAME_BYTES,
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
from rdzv_server.web.connections import local_address
from rdzv_server.web.direct_reply import AlreadyWritten
from rdzv_server.web.routing import COORDINATOR, job_id_of
from rdzv_server.web.stream_connection import StreamConnection, handshake, websocket

HUB = web.AppKey("stream_hub", StreamHub)
ROUTE_NAME = "agent-stream"
WRITE_BUFFER_CAP = 64 * 1024      # bytes a node may leave unread before its stream is closed


async def agent_stream(request: web.Request) -> web.StreamResponse:
    coord, hub = request.app[COORDINATOR], request.app[HUB]
    job_id = job_id_of(request)
    if not coord.serving():
        raise coord.gate.not_serving()          # before the upgrade: a standby names the leader (503)
    answer = handshake(request)
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the node closed its connection before the upgrade")
    conn = StreamConnection(websocket(MAX_FRAME_BYTES), transport, hub, job_id, _message, WRITE_BUFFER_CAP,
                            request.remote or "", local_address(transport))
    conn.adopt(request, answer)
    return AlreadyWritten(status=101)     # aiohttp lets the connection go


def _message(conn: StreamConnection, payload: bytes) -> Awaitable[None] | None:
    """One message from the node: hello, then requests (awaited), subscribe and heartbeats."""
    sub, hub = conn.sub, conn.hub
    frame = decode_client_frame(payload)
    if isinstance(frame, Hello):
        _hello(sub, frame)
    elif not sub.node_id:
        raise FrameError(ErrorCode.BAD_REQUEST,
                         f"the first frame must be `hello`, got {quote(type(frame).__name__)}")
    elif isinstance(frame, Request):
        return _answer(conn, frame)
    elif isinstance(frame, Subscribe):
        try:
            hub.subscribe(sub, frame.credential, frame.known_round, frame.master_port)
        except RendezvousError as exc:
            raise FrameError(exc.code, exc.message) from None
    else:
        assert isinstance(frame, Heartbeat)
    return None


async def _answer(conn: StreamConnection, frame: Request) -> None:
    conn.push(encode_frame(await _request(conn, frame)))


def _hello(sub: Subscription, frame: Hello) -> None:
    if sub.node_id:
        raise FrameError(ErrorCode.BAD_REQUEST, "`hello` twice: a stream speaks for one node")
    if frame.v != PROTOCOL_VERSION:
        raise FrameError(ErrorCode.UNSUPPORTED_VERSION, f"protocol version {quote(frame.v)} is not supported; "
                         f"this server speaks {PROTOCOL_VERSION}")
    sub.node_id = frame.node_id


async def _request(conn: StreamConnection, frame: Request) -> Reply:
    """One request on the stream, answered as on HTTP (a refusal is an error reply, not the end)."""
    sub, coord, counts = conn.sub, conn.hub.coord, conn.hub.counts
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
        if not await coord.gate.until_serving():
            raise coord.gate.not_serving()
        status: NodeStatus = await coord.handle(sub.job_id, req, conn.remote, conn.local)
    except RendezvousError as exc:
        counts.request(frame.action, exc.code.value)
        return Reply(id=frame.id, error=ErrorReply(code=exc.code.value, message=_with_leader(exc)))
    counts.request(frame.action, "ok")
    return Reply(id=frame.id, status=status)


def _with_leader(exc: RendezvousError) -> str:
    leader = (exc.headers or {}).get(LEADER_HEADER, "")
    return f"{exc.message} [leader: {leader}]" if leader else exc.message


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
