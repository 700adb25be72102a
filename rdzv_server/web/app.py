"""The aiohttp shell: routes, decoding, typed errors. The asyncio machinery is in coordinator.py."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from protocol.codec import CONTENT_TYPE, MAX_BODY_BYTES, REQUEST_TYPES, DecodeError, decode_request, encode
from protocol.errors import HTTP_STATUS, RETRYABLE, ErrorCode, unknown_job
from protocol.messages import ErrorReply, JoinRequest, PollRequest
from protocol.quoting import quote
from protocol.views import NODE_LIMIT_MAX
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, JobRecord
from rdzv_server.core.rendezvous import RendezvousError
from rdzv_server.delivery.connection import Connection
from rdzv_server.looplag import LoopLagMeter
from rdzv_server.serving import LEADER_HEADER
from rdzv_server.web import admin, views
from rdzv_server.web.access import ACCESS, NO_STREAM, Access, access_middleware
from rdzv_server.web.connections import (
    HANG_UP,
    closed_by_peer_now,
    hang_up,
    local_address,
    read_body,
    request_ack_age_s,
    request_waited_s,
    send_and_close,
)
from rdzv_server.web.direct_reply import AlreadyWritten, DirectReply
from rdzv_server.web.metrics import METRICS, ServerMetrics, metrics_endpoint, metrics_middleware
from rdzv_server.web.page import render as page
from rdzv_server.web.routing import COORDINATOR, job_id_of
from rdzv_server.web.views import view_response

log = logging.getLogger("rdzv_server")

# Warnings for operators about how exposed this server is (shown on the status page).
NOTES = web.AppKey("notes", tuple)

def _error(request: web.Request, code: ErrorCode, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """JSON for the views and admin actions; MessagePack (an ErrorReply) for the agents' POSTs."""
    status = HTTP_STATUS[code]
    extra = dict(headers or {})
    if code in RETRYABLE:
        extra.setdefault("Retry-After", "1")
    if request.method != "POST" or request.path.startswith("/v1/admin/"):
        return web.json_response({"code": code.value, "message": message}, status=status, headers=extra)
    return web.Response(body=encode(ErrorReply(code=code.value, message=message)), status=status,
                        content_type=CONTENT_TYPE, headers=extra)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Typed errors as replies; a request answered before its body was all in (refused, too large, too slow, a route
    that reads none) has the rest read, a bounded amount (send_and_close), and its connection closed if more comes:
    aiohttp would read on for 10 s ("lingering"). A review: 40 endless chunked bodies, each refused at 1 MiB, were
    read at ~330 MiB/s, RSS 47 -> 317 MiB, /healthz 1.1 s late."""
    response = await _answer(request, handler)
    if not request.content.is_eof():
        await send_and_close(request, response)
    return response


async def _answer(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except DecodeError as exc:
        return _error(request, exc.code, exc.message)
    except RendezvousError as exc:
        return _error(request, exc.code, exc.message, exc.headers)
    except web.HTTPRequestEntityTooLarge:
        return _error(request, ErrorCode.TOO_LARGE, f"body exceeds {MAX_BODY_BYTES} bytes")
    except web.HTTPNotFound:
        return _error(request, ErrorCode.NOT_FOUND, f"no route {request.method} {quote(request.path)}")
    except web.HTTPMethodNotAllowed as exc:
        return _error(request, ErrorCode.METHOD_NOT_ALLOWED, f"{request.method} not allowed on "
                      f"{quote(request.path)}; use {', '.join(sorted(exc.allowed_methods))}")
    except web.HTTPException:
        raise
    except Exception:  # a bug: log it here, never send a traceback to the client
        log.exception("internal error on %s %s", request.method, request.path)
        return _error(request, ErrorCode.INTERNAL, "internal server error (logged on the server)")


async def agent_request(request: web.Request) -> web.StreamResponse:
    coord = request.app[COORDINATOR]
    action = request.match_info["action"]
    cls = REQUEST_TYPES.get(action)
    if cls is None:
        raise DecodeError(ErrorCode.NOT_FOUND,
                          f"no agent action {quote(action)}; expected one of {', '.join(REQUEST_TYPES)}")
    if request.content_type not in (CONTENT_TYPE, "application/x-msgpack", "application/octet-stream"):
        raise DecodeError(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                          f"content type {quote(request.content_type)}: agent routes take {CONTENT_TYPE}")
    job_id = job_id_of(request)
    body = await read_body(request)         # first: an oversized body is refused at once, even by a standby
    if not await coord.gate.until_serving():
        raise coord.gate.not_serving()
    req = decode_request(cls, body)
    if coord.gate.replicated and not isinstance(req, JoinRequest) and job_id not in coord.core.jobs:
        raise coord.gate.foreign_job(job_id)
    reply = DirectReply(request) if isinstance(req, PollRequest) and DirectReply.fits(request) else None
    try:
        status = await coord.handle(job_id, req, Connection(
            peer=request.remote or "", local=local_address(request.transport),
            ack_age=lambda: request_ack_age_s(request), reply=reply, waited_s=request_waited_s(request),
            peer_closed=lambda: closed_by_peer_now(request.transport), hang_up=lambda: hang_up(request)))
    except Exception:
        if reply is None or not reply.sent:
            raise
        # a bug after the answer went out: a second reply would garble the connection, so close it
        log.exception("internal error on %s %s after its reply was sent", request.method, quote(request.path))
        return AlreadyWritten(keep_alive=False)
    if reply is not None and reply.sent:       # answered during a wake (direct_reply.py)
        return AlreadyWritten(keep_alive=HANG_UP not in request)
    response = web.Response(body=encode(status), content_type=CONTENT_TYPE)
    if HANG_UP in request:            # a held poll that gave way: its descriptor is for a newcomer
        response.force_close()
    return response


# Answered by a standby replica too; everything else there is refused with `not_leader`.
_STANDBY_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})


@web.middleware
async def standby_middleware(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """A replica that does not lead holds no state: its views and admin actions name the leader instead."""
    agent_route = request.method == "POST" and request.path.startswith("/v1/jobs/")   # agent_request decides
    gate = request.app[COORDINATOR].gate
    if (gate.started and gate.leading()) or gate.shutting_down or request.path in _STANDBY_ROUTES or agent_route:
        return await handler(request)
    raise gate.not_serving()


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def no_stream(request: web.Request) -> web.Response:
    """An agent of a version that had the stream asks for one: refused at once, saying what to use."""
    raise DecodeError(ErrorCode.NOT_FOUND, "this server has no stream: long-polls are the only transport "
                      "(POST /v1/jobs/JOB/poll); drop --transport, or --rdzv-conf transport=")


async def readyz(request: web.Request) -> web.Response:
    """Ready to serve agents (loaded, not stopping, leading); else 503, so a Service sends to the leader only."""
    coord = request.app[COORDINATOR]
    ready = coord.serving()
    # A standby names the leader here too: an agent given only this endpoint (one name for every replica)
    # checks /readyz while the leader is away, and must learn where the new one is, not wait for this one.
    url = None if ready or coord.gate.shutting_down else coord.gate.leader_url()
    return web.json_response({"ready": ready}, status=200 if ready else 503,
                             headers={LEADER_HEADER: url} if url else None)


async def status(request: web.Request) -> web.Response:
    """One page of jobs (?offset=, ?limit=), each with its counts and the first few nodes of each list."""
    coord, q = request.app[COORDINATOR], request.query
    offset = views.query_int(q, "offset", 0)
    limit = views.query_int(q, "limit", views.STATUS_LIMIT, low=1, high=views.STATUS_LIMIT_MAX)
    return view_response(views.server_status(coord.core, coord.clock(), offset, limit))


def _job(request: web.Request) -> JobRecord:
    job = request.app[COORDINATOR].core.jobs.get(job_id_of(request))
    if job is None:
        raise RendezvousError(ErrorCode.UNKNOWN_JOB, unknown_job(request.match_info["job_id"]))
    return job


async def job_detail(request: web.Request) -> web.Response:
    """One job with one page of each node list (?node_offset=, ?node_limit=)."""
    q = request.query
    offset = views.query_int(q, "node_offset", 0)
    limit = views.query_int(q, "node_limit", views.NODE_LIMIT, low=1, high=NODE_LIMIT_MAX)
    return view_response(views.job_detail(_job(request), request.app[COORDINATOR].clock(), offset, limit))


async def job_events(request: web.Request) -> web.Response:
    """The kept history; ?after=SEQ for the events newer than SEQ, ?limit=N for at most N."""
    q = request.query
    after = views.query_int(q, "after", -1)
    limit = views.query_int(q, "limit", MAX_EVENTS_PER_JOB, high=MAX_EVENTS_PER_JOB)
    return view_response(views.job_events(_job(request), None if after < 0 else after, limit))


async def index(request: web.Request) -> web.Response:
    """The overview: one page of jobs (?offset=, ?limit=), cards for the first few of them."""
    coord, query = request.app[COORDINATOR], page.PageQuery.of(request.query)
    text = page.index_page(coord.core, coord.clock(), query.refresh, request.app.get(NOTES, ()),
                           offset=query.offset, limit=query.limit)
    return web.Response(text=text, content_type="text/html")


async def job_page(request: web.Request) -> web.Response:
    """One job's HTML page (?node_offset=, ?node_limit=); an unknown or malformed id gets a 404 page."""
    coord = request.app[COORDINATOR]
    job_id, now, query = request.match_info["job_id"], coord.clock(), page.PageQuery.of(request.query)
    text = page.job_page(coord.core, job_id, now, query.refresh, node_offset=query.node_offset,
                         node_limit=query.node_limit)
    if text is None:
        return web.Response(text=page.not_found_page(coord.core, job_id, now), status=404, content_type="text/html")
    return web.Response(text=text, content_type="text/html")


def create_app(coordinator: Coordinator | None = None, *, allow_remote_admin: bool = False,
               access: Access | None = None, standby: bool = False) -> web.Application:
    """The server's app; `standby`: serve only once elected; `allow_remote_admin`: Access(allow_remote_admin=True)."""
    app = web.Application(middlewares=[metrics_middleware, error_middleware, access_middleware,
                                       standby_middleware],
                          client_max_size=MAX_BODY_BYTES)
    app[ACCESS] = access or Access(allow_remote_admin=allow_remote_admin)
    # the server watches its own loop (leases wait out its stalls); a coordinator given is taken as built
    app[COORDINATOR] = coordinator or Coordinator(loop_lag=LoopLagMeter())
    app[METRICS] = ServerMetrics(app[COORDINATOR])
    app[COORDINATOR].effect_listeners.append(app[METRICS].on_effects)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await app[COORDINATOR].start(take_over=not standby)
        yield
        await app[COORDINATOR].stop()

    async def on_shutdown(app: web.Application) -> None:
        # Release long-polls first so they answer "going away" instead of being cut.
        app[COORDINATOR].release_polls()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    app.router.add_post("/v1/jobs/{job_id}/{action}", agent_request)
    app.router.add_get("/v1/jobs/{job_id}/stream", no_stream, name=NO_STREAM)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/jobs/{job_id}", job_detail)
    app.router.add_get("/v1/jobs/{job_id}/events", job_events)
    admin.add_routes(app)
    app.router.add_get("/", index)
    app.router.add_get("/jobs/{job_id}", job_page)
    return app
