"""The aiohttp shell around the rendezvous core: decode, call the core with the clock, wake, encode.

Long-polls wait on a per-job asyncio.Event that is set (and replaced) whenever the job's epoch
moves, so agents learn of a new round the moment it is decided. One background task sleeps until
the core's next deadline and ticks it; any request that may bring a deadline closer re-arms it.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Awaitable, Callable, Optional

from aiohttp import web

from protocol.codec import CONTENT_TYPE, MAX_BODY_BYTES, REQUEST_TYPES, DecodeError, decode_request, encode
from protocol.errors import HTTP_STATUS, ErrorCode
from protocol.messages import ErrorReply, NodeState, NodeStatus, PollRequest
from rdzv_server import views
from rdzv_server.rendezvous import Rendezvous, RendezvousError

log = logging.getLogger("rdzv_server")

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class Coordinator:
    """Owns the core and the asyncio machinery around it (waiters, the deadline timer)."""

    def __init__(self, core: Optional[Rendezvous] = None, clock: Callable[[], float] = time.time) -> None:
        self.core = core or Rendezvous()
        self.clock = clock
        self.shutting_down = False
        self.open_polls = 0
        self._job_events: dict[str, asyncio.Event] = {}
        self._epochs: dict[str, int] = {}
        self._logged: dict[str, int] = {}
        self._rearm: Optional[asyncio.Event] = None
        self._timer: Optional[asyncio.Task] = None

    # -- lifecycle --
    async def start(self) -> None:
        self._rearm = asyncio.Event()
        self._timer = asyncio.create_task(self._deadline_loop(), name="rdzv-deadlines")
        for job_id in self.core.jobs:
            self._after(job_id)

    async def stop(self) -> None:
        self.shutting_down = True
        for ev in self._job_events.values():
            ev.set()
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)

    # -- change propagation --
    def _after(self, job_id: str) -> None:
        """After any core call on `job_id`: log new decisions, wake long-polls, re-arm the timer."""
        job = self.core.jobs.get(job_id)
        if job is None:
            return
        last = self._logged.get(job_id, 0)
        for ev in job.events:
            if ev.seq > last:
                log.info("%s", ev.message, extra={"job_id": job_id, "event": ev.kind, "node_id": ev.node_id,
                                                  "round_id": ev.round_id})
        self._logged[job_id] = job.event_seq
        if self._epochs.get(job_id) != job.epoch:
            self._epochs[job_id] = job.epoch
            old = self._job_events.pop(job_id, None)
            if old is not None:
                old.set()
        if self._rearm is not None:
            self._rearm.set()

    def job_event(self, job_id: str) -> asyncio.Event:
        ev = self._job_events.get(job_id)
        if ev is None:
            ev = self._job_events[job_id] = asyncio.Event()
        return ev

    async def _deadline_loop(self) -> None:
        assert self._rearm is not None
        while True:
            deadline = self.core.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            try:
                await asyncio.wait_for(self._rearm.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._rearm.clear()
            for job_id in self.core.tick(self.clock()):
                self._after(job_id)

    # -- requests --
    def call(self, job_id: str, fn: Callable[..., NodeStatus], req: object) -> NodeStatus:
        try:
            return fn(job_id, req, self.clock())
        finally:
            self._after(job_id)

    async def long_poll(self, job_id: str, req: PollRequest) -> NodeStatus:
        status = self.call(job_id, self.core.poll, req)
        wait = min(req.wait_s, status.lease_timeout_s / 2)
        deadline = self.clock() + wait
        self.open_polls += 1
        try:
            while not _poll_ready(status, req.known_round) and not self.shutting_down:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self.job_event(job_id).wait(), remaining)
                except asyncio.TimeoutError:
                    pass
                if job_id not in self.core.jobs:
                    break
                status = self.core.view(job_id, req.node_id, self.clock())
        except asyncio.CancelledError:
            # The agent's connection closed mid-poll: likely dead. Give it a short grace.
            if not self.shutting_down:
                self.core.connection_dropped(job_id, req.node_id, self.clock())
                self._after(job_id)
            raise
        finally:
            self.open_polls -= 1
        if self.shutting_down:
            raise RendezvousError(ErrorCode.SHUTTING_DOWN, "server is shutting down; retry shortly")
        return status


def _poll_ready(status: NodeStatus, known_round: int) -> bool:
    if status.job_state.finished or status.node_state == NodeState.GONE:
        return True
    if status.node_state == NodeState.MEMBER:
        return status.round_id != known_round
    return known_round != -1


COORDINATOR = web.AppKey("coordinator", Coordinator)


def _error(code: ErrorCode, message: str, *, as_json: bool) -> web.Response:
    status = HTTP_STATUS[code]
    if as_json:
        return web.json_response({"code": code.value, "message": message}, status=status)
    return web.Response(body=encode(ErrorReply(code=code.value, message=message)), status=status,
                        content_type=CONTENT_TYPE)


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    as_json = request.method != "POST"
    try:
        return await handler(request)
    except DecodeError as exc:
        return _error(exc.code, exc.message, as_json=as_json)
    except RendezvousError as exc:
        return _error(exc.code, exc.message, as_json=as_json)
    except web.HTTPRequestEntityTooLarge:
        return _error(ErrorCode.TOO_LARGE, f"body exceeds {MAX_BODY_BYTES} bytes", as_json=as_json)
    except web.HTTPNotFound:
        return _error(ErrorCode.NOT_FOUND, f"no route {request.method} {request.path}", as_json=as_json)
    except web.HTTPMethodNotAllowed as exc:
        return _error(ErrorCode.METHOD_NOT_ALLOWED,
                      f"{request.method} not allowed on {request.path}; use {', '.join(sorted(exc.allowed_methods))}",
                      as_json=as_json)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception:  # a bug: log it here, never send a traceback to the client
        log.exception("internal error on %s %s", request.method, request.path)
        return _error(ErrorCode.INTERNAL, "internal server error (logged on the server)", as_json=as_json)


def _job_id(request: web.Request) -> str:
    job_id = request.match_info["job_id"]
    if not _JOB_ID.match(job_id):
        raise DecodeError(ErrorCode.BAD_REQUEST,
                          f"job id must be 1-128 of [A-Za-z0-9._:-] starting with a letter or digit, got {job_id!r}")
    return job_id


async def agent_request(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    action = request.match_info["action"]
    cls = REQUEST_TYPES.get(action)
    if cls is None:
        raise DecodeError(ErrorCode.NOT_FOUND,
                          f"no agent action {action!r}; expected one of {', '.join(REQUEST_TYPES)}")
    if request.content_type not in (CONTENT_TYPE, "application/x-msgpack", "application/octet-stream"):
        raise DecodeError(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                          f"content type {request.content_type!r}: agent routes take {CONTENT_TYPE}")
    job_id = _job_id(request)
    if coord.shutting_down:
        raise RendezvousError(ErrorCode.SHUTTING_DOWN, "server is shutting down; retry shortly")
    req = decode_request(cls, await request.read())
    core = coord.core
    if action == "poll":
        status = await coord.long_poll(job_id, req)
    else:
        fn = {"join": core.join, "failure": core.report_failure, "success": core.report_success,
              "leave": core.leave}[action]
        status = coord.call(job_id, fn, req)
    return web.Response(body=encode(status), content_type=CONTENT_TYPE)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def status(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    return web.json_response(views.server_status(coord.core, coord.clock()))


async def job_detail(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    job = coord.core.jobs.get(_job_id(request))
    if job is None:
        raise RendezvousError(ErrorCode.UNKNOWN_JOB, f"no job {request.match_info['job_id']!r} on this server")
    return web.json_response(views.job_detail(job, coord.clock()))


async def job_events(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    job = coord.core.jobs.get(_job_id(request))
    if job is None:
        raise RendezvousError(ErrorCode.UNKNOWN_JOB, f"no job {request.match_info['job_id']!r} on this server")
    return web.json_response(views.job_events(job))


async def index(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    return web.Response(text=views.status_page(coord.core, coord.clock()), content_type="text/html")


def create_app(coordinator: Optional[Coordinator] = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[COORDINATOR] = coordinator or Coordinator()

    async def lifecycle(app: web.Application):
        await app[COORDINATOR].start()
        yield
        await app[COORDINATOR].stop()

    async def on_shutdown(app: web.Application) -> None:
        # Release long-polls first so they answer "going away" instead of being cut.
        coord = app[COORDINATOR]
        coord.shutting_down = True
        for ev in list(coord._job_events.values()):
            ev.set()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    app.router.add_post("/v1/jobs/{job_id}/{action}", agent_request)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/jobs/{job_id}", job_detail)
    app.router.add_get("/v1/jobs/{job_id}/events", job_events)
    app.router.add_get("/", index)
    return app
