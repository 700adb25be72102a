"""Operator actions over HTTP: JSON in, JSON out, under /v1/admin/ (routes: `add_routes`; bodies and
effects: docs/operators.md).

Each answers 200 with the job as `GET /v1/jobs/{job_id}` shows it after the action, or a JSON error
`{"code", "message"}`. Who may call them is decided in access.py; the peer is the TCP peer
(`request.remote`), never a forwarded-for header, so a client cannot claim to be local.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import msgspec
from aiohttp import web

from protocol.codec import DecodeError
from protocol.errors import ErrorCode, unknown_job
from protocol.ids import node_id_problem
from protocol.quoting import one_line, quote
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.operator_rules import ClearExclusion, CloseJob, DrainNode, OperatorAction, ResizeJob
from rdzv_server.web import views
from rdzv_server.web.connections import read_body
from rdzv_server.web.routing import COORDINATOR, job_id_of

log = logging.getLogger("rdzv_server")

MAX_REASON_CHARS = 500
PREFIX = "/v1/admin/jobs/{job_id}"


def add_routes(app: web.Application) -> None:
    """Register the admin routes on `app` (who may use them: access.py)."""
    app.router.add_post(PREFIX + "/close", close_job)
    app.router.add_post(PREFIX + "/nodes/{node_id}/drain", drain_node)
    app.router.add_post(PREFIX + "/nodes/{node_id}/clear-exclusion", clear_exclusion)
    app.router.add_post(PREFIX + "/resize", resize_job)
    app.router.add_post("/v1/admin/hosts/{host}/clear-unhealthy", clear_unhealthy)


def bad_request(message: str) -> DecodeError:
    return DecodeError(ErrorCode.BAD_REQUEST, message)


def _node_id(request: web.Request) -> str:
    node_id = request.match_info["node_id"]
    if problem := node_id_problem(node_id):
        raise bad_request(problem)
    return node_id


async def _body(request: web.Request, fields: dict[str, type]) -> dict[str, Any]:
    """The JSON object in the body ({} when empty), checked against `fields` (name -> type)."""
    raw = await read_body(request)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise bad_request(f"body is not valid JSON: {why}") from None
    if not isinstance(body, dict):
        raise bad_request(f"body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        expected = ", ".join(fields) or "no fields"
        names = ", ".join(map(quote, unknown[:5])) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise bad_request(f"unknown field(s) {names}; this action takes {expected}")
    body = {k: v for k, v in body.items() if v is not None}
    for name, value in body.items():
        want = fields[name]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise bad_request(f"field {name!r} must be {'an integer' if want is int else 'a string'}, "
                              f"got {quote(value)}")
        if isinstance(value, str):      # no UTF-8 codec (the store's) encodes a lone surrogate (JSON's "\ud800")
            try:
                value.encode()
            except UnicodeEncodeError:
                raise bad_request(f"field {name!r} is not valid Unicode text: it holds a lone surrogate "
                                  f"(a \\ud800-\\udfff escape), got {quote(value)}") from None
    return body


async def _reason(request: web.Request) -> str:
    """The body's `reason`, on one line: every agent prints it and later refusals quote it."""
    reason = (await _body(request, {"reason": str})).get("reason", "").strip()
    if len(reason) > MAX_REASON_CHARS:
        raise bad_request(f"field 'reason' must be at most {MAX_REASON_CHARS} characters, got {len(reason)}")
    return one_line(reason)


async def _operate(request: web.Request, what: str, job_id: str, action: OperatorAction) -> web.Response:
    """Apply one operator action (logged with the peer that asked) and answer with the job."""
    coord = request.app[COORDINATOR]
    if coord.gate.shutting_down:
        raise coord.gate.not_serving()
    log.info("operator request from %s: %s", request.remote, what,
             extra={"job_id": job_id, "event": "operator_request"})
    job = await coord.operate(job_id, action)
    return views.view_response(views.job_detail(job, coord.clock()))


async def close_job(request: web.Request) -> web.Response:
    job_id, reason = job_id_of(request), await _reason(request)
    return await _operate(request, f"close job {job_id} ({reason or 'no reason given'})", job_id, CloseJob(reason))


async def drain_node(request: web.Request) -> web.Response:
    job_id, node_id = job_id_of(request), _node_id(request)
    reason = await _reason(request)
    return await _operate(request, f"drain node {node_id} ({reason or 'no reason given'})", job_id,
                          DrainNode(node_id, reason))


async def clear_exclusion(request: web.Request) -> web.Response:
    job_id, node_id = job_id_of(request), _node_id(request)
    await _body(request, {})
    return await _operate(request, f"clear exclusion or drain of node {node_id}", job_id,
                          ClearExclusion(node_id))


async def clear_unhealthy(request: web.Request) -> web.Response:
    """Server-wide, not one job's: the hold keeps the host out of every job (core/unhealthy.py)."""
    host = request.match_info["host"]
    if not host or len(host) > 256 or not host.isprintable():
        raise bad_request(f"not a host name: {quote(host)}")
    await _body(request, {})
    log.info("operator request from %s: clear unhealthy host %s", request.remote, quote(host),
             extra={"event": "operator_request"})
    return web.json_response({"cleared": msgspec.to_builtins(request.app[COORDINATOR].clear_unhealthy(host))})


async def resize_job(request: web.Request) -> web.Response:
    job_id = job_id_of(request)
    body = await _body(request, {"min_nodes": int, "max_nodes": int})
    if not body:
        raise bad_request("give min_nodes and/or max_nodes (an omitted one keeps its value)")
    job = request.app[COORDINATOR].core.jobs.get(job_id)
    if job is None:
        raise RendezvousError(ErrorCode.UNKNOWN_JOB, unknown_job(job_id))
    min_nodes = body.get("min_nodes", job.config.min_nodes)
    max_nodes = body.get("max_nodes", job.config.max_nodes)
    return await _operate(request, f"resize to nodes {quote(min_nodes)}:{quote(max_nodes)}", job_id,
                          ResizeJob(min_nodes, max_nodes))
