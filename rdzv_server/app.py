"""The aiohttp shell: routes, decoding, typed errors. The asyncio machinery is in coordinator.py."""
from __future__ import annotations

import asyncio
import logging
import re
from typing import Awaitable, Callable, Optional

from aiohttp import web

from protocol.codec import CONTENT_TYPE, MAX_BODY_BYTES, REQUEST_TYPES, DecodeError, decode_request, encode
from protocol.errors import HTTP_STATUS, ErrorCode
from protocol.messages import ErrorReply
from rdzv_server import views
from rdzv_server.coordinator import Coordinator
from rdzv_server.rendezvous import RendezvousError

log = logging.getLogger("rdzv_server")

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


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
    if not _JOB_ID.fullmatch(job_id):
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
    status = await coord.handle(action, job_id, req)
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
        app[COORDINATOR].release_polls()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    app.router.add_post("/v1/jobs/{job_id}/{action}", agent_request)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/jobs/{job_id}", job_detail)
    app.router.add_get("/v1/jobs/{job_id}/events", job_events)
    app.router.add_get("/", index)
    return app
