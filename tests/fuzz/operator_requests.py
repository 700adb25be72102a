"""Hypothesis strategies of operator-side requests: admin actions (JSON), the status views, and
every route under a method it does not take."""
from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tests.fuzz import payloads
from tests.fuzz.rawhttp import Header
from tests.fuzz.requests import (
    AGENT_ACTIONS,
    CONTENT_TYPES,
    JSON,
    MSGPACK,
    POOL_JOBS,
    Context,
    Request,
    agent_request,
    hostile_headers,
    segments,
    valid_body,
)

ADMIN_FIELDS: dict[str, dict[str, Any]] = {
    "close": {"reason": "fuzz"}, "drain": {"reason": "fuzz"}, "clear-exclusion": {},
    "resize": {"min_nodes": 2, "max_nodes": 2}}


def _job(ctx: Context) -> st.SearchStrategy[str]:
    return st.one_of(st.just(ctx.job_id), st.just(ctx.job_id), st.sampled_from(POOL_JOBS), segments())


def _node(ctx: Context) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([n.node_id for n in ctx.nodes]), segments())


def admin_path(action: str, job: str, node: str) -> str:
    if action in ("drain", "clear-exclusion"):
        return f"/v1/admin/jobs/{job}/nodes/{node}/{action}"
    return f"/v1/admin/jobs/{job}/{action}"


@st.composite
def admin_request(draw: st.DrawFn, ctx: Context) -> Request:
    action = draw(st.sampled_from(list(ADMIN_FIELDS)))
    job, node = draw(_job(ctx)), draw(_node(ctx))
    fields: dict[str, Any] = dict(ADMIN_FIELDS[action])
    kind = draw(st.sampled_from(["value", "value", "value", "unknown", "raw", "bytes", "empty", "headers"]))
    field_name = ""
    body: bytes
    if kind == "value" and fields:
        name = draw(st.sampled_from(list(fields)))
        fields[name] = value = draw(payloads.json_values())
        field_name = name if not isinstance(value, payloads.Raw) else ""
        body = payloads.json_body(fields)
    elif kind == "unknown":
        fields[draw(st.sampled_from(["credential", "min_nodes", "MAX_NODES", "", "\u0000", "a" * 300, "node_id"]))] = \
            draw(payloads.json_values())
        body = payloads.json_body(fields)
    elif kind == "raw":
        body = draw(st.sampled_from(payloads.RAW_JSON)).data
    elif kind == "bytes":
        body = draw(st.one_of(st.binary(max_size=100), st.sampled_from([
            b"\xef\xbb\xbf{}", '{"reason": "x"}'.encode("utf-16"), b"{\"reason\": \"x\"", b"{}{}", b"[]",
            b'{"reason": "a", "reason": 5}', b'{"min_nodes": 1, "min_nodes": 2e400}', b" \t\r\n "])))
    elif kind == "empty":
        body = b""
    else:
        body = payloads.json_body(fields)
    if job not in (ctx.job_id, *POOL_JOBS) or (action in ("drain", "clear-exclusion") and
                                               node not in [n.node_id for n in ctx.nodes]):
        field_name = ""          # a malformed id in the path is refused first, and named instead
    headers: list[Header] = [("Content-Type", JSON)]
    other_type = draw(st.integers(0, 5)) == 0
    if other_type:
        headers = [("Content-Type", ctype) for ctype in [draw(st.sampled_from(CONTENT_TYPES))] if ctype is not None]
    request = Request("POST", admin_path(action, job, node), tuple(headers), body, f"admin.{action}.{kind}", "admin",
                      job_id=job, node_id=node, action=action, field=field_name, host=ctx.authority,
                      framework=other_type)
    if kind == "headers":
        request = draw(hostile_headers(request, ctx))
    return request


VIEW_PATHS = ["/", "/jobs/{j}", "/v1/status", "/v1/jobs/{j}", "/v1/jobs/{j}/events", "/metrics", "/healthz",
              "/readyz", "/favicon.ico", "/v1", "/v1/", "/v1/jobs", "/v1/jobs/", "/v1/admin", "/jobs/", "/jobs/{j}/",
              "/static/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/v1/jobs/{j}/events/x", "*"]
QUERY_VALUES = ["0", "1", "-1", "nan", "inf", "1e309", "9" * 5000, "", "%00", "0x10", "%D9%A3", "3600", "3601",
                "1.5", "%ff", "a" * 3000]


@st.composite
def view_request(draw: st.DrawFn, ctx: Context) -> Request:
    template = draw(st.sampled_from(VIEW_PATHS))
    job = draw(_job(ctx))
    path = template.replace("{j}", job)
    how = draw(st.sampled_from(["plain", "plain", "refresh", "query", "host", "headers"]))
    if how == "refresh":
        path += "?refresh=" + draw(st.sampled_from(QUERY_VALUES))
    elif how == "query":
        path += "?" + draw(st.sampled_from(["&&&", "a=%ff", "refresh=1&refresh=2", "=", "x" * 5000, "a=b;c",
                                             "refresh", "%", "a[]=1&a[]=2"]))
    host: str | None = ctx.authority
    if how == "host":
        host = draw(st.sampled_from([None, "", "evil.example", "evil.example:80", "localhost", "LOCALHOST:1", "[::1]",
                                     "[::1", "127.0.0.1:99999", "a" * 300, "127.0.0.1 evil", "xn--80ak6aa92e"]))
    headers: list[Header] = []
    if ctx.token is not None and draw(st.booleans()):
        headers.append(("Authorization", f"Bearer {ctx.token}"))
    if how == "headers":
        headers.append(draw(st.sampled_from([("Authorization", "Basic Og=="), ("Authorization", "Bearer x"),
                                             ("Accept", "application/json"), ("Range", "bytes=0-10"),
                                             ("If-None-Match", "*"), ("Accept-Encoding", "gzip, br"),
                                             ("Cookie", "a=" + "b" * 4000), ("X-Forwarded-Host", "evil.example")])))
    method = draw(st.sampled_from(["GET", "GET", "GET", "HEAD"]))
    return Request(method, path, tuple(headers), b"", f"view.{how}", "health" if "healthz" in path else "view",
                   job_id=job, host=host, content_length=False, framework=how == "host" or not path.startswith("/"))


METHODS = ["GET", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "POST", "M-SEARCH", "PROPFIND"]
# Valid tokens that aiohttp's parser does not know: it answers them itself, before any route.
UNKNOWN_METHODS = ["FOO", "get", "Post", "X" * 100]


@st.composite
def method_request(draw: st.DrawFn, ctx: Context) -> Request:
    """Any route under any method, with a body that would be valid for it."""
    route = draw(st.sampled_from(["agent", "admin", "view"]))
    node = ctx.nodes[0]
    if route == "agent":
        action = draw(st.sampled_from(AGENT_ACTIONS))
        path, ctype = f"/v1/jobs/{ctx.job_id}/{action}", MSGPACK
        body = payloads.packb(valid_body(ctx, action, node))
    elif route == "admin":
        action = draw(st.sampled_from(list(ADMIN_FIELDS)))
        path, ctype, body = admin_path(action, ctx.job_id, node.node_id), JSON, b"{}"
    else:
        path, ctype, body = draw(st.sampled_from(VIEW_PATHS)).replace("{j}", ctx.job_id), JSON, b""
    method = draw(st.sampled_from(METHODS + UNKNOWN_METHODS))
    return Request(method, path, (("Content-Type", ctype),), body if draw(st.booleans()) else b"", f"method.{route}",
                   route if route != "view" or "healthz" not in path else "health", job_id=ctx.job_id,
                   node_id=node.node_id, host=ctx.authority, framework=method in UNKNOWN_METHODS or path == "*")


def any_request(ctx: Context) -> st.SearchStrategy[Request]:
    return st.one_of(agent_request(ctx), agent_request(ctx), agent_request(ctx), admin_request(ctx),
                     view_request(ctx), method_request(ctx))
