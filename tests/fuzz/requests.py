"""Hypothesis strategies of whole HTTP requests for every route, built around what the fuzzer
knows of the server (`Context`: a job it controls, its nodes and their credentials).

A request is a valid one with mutations: a field's value, a missing field, unknown fields, the
credential, the whole body, the headers, the method, the path. Most are refused; some stay valid
by chance, which is fine: only refused requests must leave the state as it was.
"""
from __future__ import annotations

import functools
import gzip
import zlib
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote

import msgpack
from hypothesis import strategies as st

from tests.fuzz import payloads
from tests.fuzz.payloads import Raw
from tests.fuzz.rawhttp import Header, request_bytes

AGENT_ACTIONS = ("join", "poll", "failure", "success", "leave")
POOL_JOBS = tuple(f"fz-{i}" for i in range(8))        # ids fuzzed joins may create jobs under
MSGPACK = "application/msgpack"
JSON = "application/json"
# Durations far beyond any test: a controlled job changes only through requests, never by a timer.
STILL_CONFIG = {"min_nodes": 2, "max_nodes": 2, "max_restarts": 1000, "last_call_s": 0.0,
                "join_timeout_s": 604800.0, "lease_timeout_s": 604800.0, "exclude_after": 0,
                "exclude_window_s": 600.0, "exclude_cooldown_s": 60.0, "exclude_cooldown_max_s": 3600.0}


@dataclass(frozen=True)
class Node:
    node_id: str
    instance: str
    credential: str | None       # from the join reply; None while the server hands out none


@dataclass(frozen=True)
class Context:
    authority: str               # host:port of the server, for Host and Origin
    job_id: str                  # the controlled job
    nodes: tuple[Node, ...]
    round_id: int = -1           # its current round
    config: dict[str, Any] = field(default_factory=lambda: dict(STILL_CONFIG))
    token: str | None = None     # the agent token when the server has one


@dataclass(frozen=True)
class Request:
    method: str
    target: str                           # path and query as sent
    headers: tuple[Header, ...]
    body: bytes
    label: str                            # what kind of hostile request, for counts and reports
    route: str                            # agent | admin | view | health
    job_id: str | None = None
    node_id: str | None = None            # the node the request names (agent routes)
    action: str = ""
    field: str = ""                       # the one field a clean mutation changed (must be named)
    forged: bool = False                  # names a node of the context without that node's credential
    framework: bool = False               # aiohttp itself may refuse it (a plain-text 4xx before any route)
    host: str | None = None               # Host header; None sends none
    content_length: bool = True

    def to_bytes(self) -> bytes:
        return request_bytes(self.method, self.target, self.headers, self.body, host=self.host,
                             content_length=self.content_length)

    def describe(self, limit: int = 400) -> str:
        body = repr(self.body[:limit]) + (f"... ({len(self.body)} bytes)" if len(self.body) > limit else "")
        headers = ", ".join(f"{k!r}: {v!r}"[:200] for k, v in self.headers)
        return f"[{self.label}] {self.method} {self.target[:300]} Host={self.host!r} {{{headers}}} body={body}"


def body_map(request: Request) -> dict[Any, Any]:
    """The request's body as a MessagePack map ({} when it is none)."""
    try:
        body = msgpack.unpackb(request.body)
    except Exception:  # noqa: BLE001 (any malformed body is simply no map)
        return {}
    return body if isinstance(body, dict) else {}


def own_instance_join(request: Request, node: Node) -> bool:
    """A join naming `node` from `node`'s own agent instance. Until a request carrying the node's
    secret has been accepted, the server takes it for a join whose reply was lost and hands out a
    fresh secret (docs/protocol.md, join): a rule, not a forgery."""
    return (request.action == "join" and request.node_id == node.node_id
            and body_map(request).get("instance") == node.instance)


# -- agent routes --------------------------------------------------------------------------------

def valid_body(ctx: Context, action: str, node: Node) -> dict[str, Any]:
    """A request `node` could send as it is (credential included when it has one)."""
    body: dict[str, Any] = {"v": 1, "node_id": node.node_id}
    if action == "join":
        body.update(addr="10.1.0.7", local_world_size=1, master_port=2000, config=dict(ctx.config),
                    instance=node.instance, role="default", host="fuzz-host")
    elif action == "poll":
        body.update(known_round=ctx.round_id, wait_s=0.0, master_port=0)
    elif action == "failure":
        body.update(round_id=ctx.round_id, failures=[{
            "local_rank": 0, "rank": 0, "exitcode": 1, "signal": "", "reason": "exited", "message": "boom",
            "traceback": "", "timestamp": 0.0, "host": "", "node_id": ""}])
    elif action == "success":
        body.update(round_id=ctx.round_id)
    else:
        body.update(reason="left")
    if node.credential is not None:
        body["credential"] = node.credential
    return body


def field_paths(body: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every field of a body as a path of keys and indexes (nested maps and the first failure)."""
    paths: list[tuple[Any, ...]] = []
    for key, value in body.items():
        paths.append((key,))
        if isinstance(value, dict):
            paths += [(key, k) for k in value]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            paths += [(key, 0, k) for k in value[0]]
    return paths


def path_name(path: tuple[Any, ...]) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path).replace(".[", "[")


def _parent(body: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        body = body[key]
    return body


def _no_long_poll(body: dict[str, Any]) -> dict[str, Any]:
    """A poll that stays valid must not be held (the server would wait up to a minute; 2 s by default)."""
    if "wait_s" not in body:
        body["wait_s"] = 0.0
    wait = body.get("wait_s")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 < wait <= 60:
        body["wait_s"] = 0.0
    return body


@st.composite
def agent_request(draw: st.DrawFn, ctx: Context) -> Request:
    action = draw(st.sampled_from(AGENT_ACTIONS + ("join", "poll", "failure", "success")))
    node = draw(st.sampled_from(ctx.nodes))
    body = valid_body(ctx, action, node)
    label, field_name, forged = "agent.valid", "", False
    kind = draw(st.sampled_from(["value", "value", "value", "missing", "unknown", "credential", "credential",
                                 "other-node", "several", "body", "headers", "path"]))
    raw: bytes | None = None
    if kind in ("value", "missing", "several"):
        for _ in range(draw(st.integers(2, 4)) if kind == "several" else 1):
            path = draw(st.sampled_from(field_paths(body)))     # (an earlier mutation may have replaced a map)
            parent = _parent(body, path)
            value = draw(payloads.msgpack_values()) if kind != "missing" else Raw(b"", "missing")
            if kind == "missing":
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = value
            if path == ("credential",) or (path == ("node_id",) and body.get("node_id") != node.node_id):
                forged = True
        label = f"agent.{kind}"
        # Only a plain value must be named: a body-level fault (invalid UTF-8, nesting) may be named instead.
        field_name = path_name(path) if kind == "missing" or (kind == "value" and not isinstance(value, Raw)) else ""
    elif kind == "unknown":
        nested = {"join": body.get("config"), "failure": (body.get("failures") or [None])[0]}.get(action)
        target = body if nested is None or draw(st.booleans()) else nested
        target[draw(payloads.msgpack_keys())] = draw(payloads.msgpack_values())
        label = "agent.unknown-field"
    elif kind == "credential":
        how = draw(st.sampled_from(["omit", "wrong", "empty", "long", "value", "other"]))
        others = [n.credential for n in ctx.nodes if n.credential and n.credential != node.credential]
        if how == "omit" or (how == "other" and not others):
            body.pop("credential", None)
        elif how == "other":
            body["credential"] = draw(st.sampled_from(others))
        else:
            body["credential"] = {"wrong": "0" * 32, "empty": "", "long": "c" * 65}.get(how) or draw(
                payloads.msgpack_values())
        label, forged = f"agent.credential-{how}", True
    elif kind == "other-node":          # another node's body with this node's credential
        other = draw(st.sampled_from(ctx.nodes))
        body["node_id"] = other.node_id
        label, forged = "agent.other-node", other.node_id != node.node_id
    elif kind == "body":
        raw, label = draw(hostile_msgpack_body(body))
    if action == "poll":
        body = _no_long_poll(body)
    encoded = raw if raw is not None else payloads.packb(body)
    headers: list[Header] = [("Content-Type", MSGPACK)]
    if ctx.token is not None:
        headers.append(("Authorization", f"Bearer {ctx.token}"))
    request = Request("POST", f"/v1/jobs/{ctx.job_id}/{action}", tuple(headers), encoded, label, "agent",
                      job_id=ctx.job_id, node_id=body.get("node_id") if isinstance(body.get("node_id"), str) else None,
                      action=action, field=field_name, forged=forged, host=ctx.authority)
    if kind == "headers":
        request = draw(hostile_headers(request, ctx))
    elif kind == "path":
        request = draw(hostile_agent_path(request))
    elif draw(st.integers(0, 9)) == 0:
        request = replace(request, job_id=draw(st.sampled_from(POOL_JOBS)))
        request = replace(request, target=f"/v1/jobs/{request.job_id}/{action}", label=request.label + "@pool")
    return request


@st.composite
def hostile_msgpack_body(draw: st.DrawFn, body: dict[str, Any]) -> tuple[bytes, str]:
    good = payloads.packb(body)
    how = draw(st.sampled_from(["random", "empty", "truncated", "trailing", "twice", "not-a-map", "json",
                                "duplicate-keys", "deep", "huge", "raw-value", "key-types"]))
    if how == "random":
        return draw(st.binary(max_size=200)), "body.random-bytes"
    if how == "empty":
        return b"", "body.empty"
    if how == "truncated":
        return good[: draw(st.integers(0, max(0, len(good) - 1)))], "body.truncated"
    if how == "trailing":
        return good + draw(st.binary(min_size=1, max_size=20)), "body.trailing-bytes"
    if how == "twice":
        return good + good, "body.two-maps"
    if how == "not-a-map":
        return payloads.packb(draw(payloads.msgpack_values())), "body.not-a-map"
    if how == "json":
        return payloads.json_body({k: v for k, v in body.items() if not isinstance(k, bytes)}), "body.json"
    if how == "duplicate-keys":
        key = draw(st.sampled_from([k for k in body if k != "wait_s"]))     # (a valid wait would hold the poll)
        pairs = list(body.items()) + [(key, draw(payloads.msgpack_values()))]
        return payloads.packb(payloads.Pairs(draw(st.permutations(pairs)))), "body.duplicate-keys"
    if how == "deep":
        return draw(st.sampled_from([payloads.nested_lists(100_000).data, payloads.nested_maps(50_000).data,
                                     b"\x81\xa1v" + payloads.nested_lists(5000).data])), "body.deep-nesting"
    if how == "huge":
        return payloads.packb({**body, "pad": "x" * (1 << 20)}), "body.over-1MiB"
    if how == "raw-value":
        return draw(st.sampled_from(payloads.RAW_VALUES)).data, "body.raw-value"
    pairs = [(draw(payloads.msgpack_keys()), v) if draw(st.booleans()) else (k, v) for k, v in body.items()]
    return payloads.packb(payloads.Pairs(pairs)), "body.key-types"


CONTENT_TYPES = [None, "", "application/x-msgpack", "application/octet-stream", "text/plain", JSON,
                 "application/msgpack; charset=utf-8", "APPLICATION/MSGPACK", "*/*", "multipart/form-data; boundary=x",
                 "application/x-www-form-urlencoded", "application/msgpack, text/plain", "\x00", "a" * 2000,
                 "text/html; charset=\"\\"]


@st.composite
def hostile_headers(draw: st.DrawFn, request: Request, ctx: Context) -> Request:
    """The same request with hostile headers (the framing stays valid: hostile bytes are for socket_attacks)."""
    headers = [h for h in request.headers if h[0] != "Content-Type"]
    body, content_length = request.body, True
    how = draw(st.sampled_from(["content-type", "encoding", "chunked", "authorization", "origin", "noise",
                                "host", "expect", "duplicate-content-type"]))
    if how == "content-type":
        ctype = draw(st.sampled_from(CONTENT_TYPES))
        if ctype is not None:
            headers.append(("Content-Type", ctype))
    else:
        headers.append(("Content-Type", JSON if request.route == "admin" else MSGPACK))
    if how == "encoding":
        enc = draw(st.sampled_from(["gzip", "deflate", "br", "identity", "gzip, gzip", "x-unknown", "GZIP", ""]))
        if draw(st.booleans()):
            body = gzip.compress(body) if "gzip" in enc.lower() else zlib.compress(body) if enc == "deflate" else body
        else:
            body = draw(st.binary(max_size=64))
        headers.append(("Content-Encoding", enc))
    elif how == "chunked":
        size = draw(st.integers(1, max(1, len(body))))
        chunks = [body[i:i + size] for i in range(0, len(body), size)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        headers.append(("Transfer-Encoding", "chunked"))
        content_length = False
    elif how == "authorization":
        headers = [h for h in headers if h[0] != "Authorization"]
        headers.append(("Authorization", draw(st.sampled_from([
            "Bearer", "Bearer ", "Bearer " + "0" * 64, "Bearer " + "t" * 5000, "Basic !!!!", "Basic Og==",
            "Basic " + "QUJD" * 500, "Digest x", "bearer\tx", b"Bearer \xe9"]))))
    elif how == "origin":
        headers.append(("Origin", draw(st.sampled_from(["http://evil.example", "null", f"http://{ctx.authority}",
                                                         "https://" + ctx.authority, ""]))))
    elif how == "noise":
        headers += [(f"X-Fuzz-{i}", draw(st.sampled_from(["", "a" * 4000, "\u00ff", "x"]))) for i in
                    range(draw(st.integers(1, 80)))]
        headers.append(("X-Forwarded-For", "127.0.0.1"))
    elif how == "expect":
        headers.append(("Expect", draw(st.sampled_from(["100-continue", "nonsense"]))))
    elif how == "duplicate-content-type":
        headers.append(("Content-Type", draw(st.sampled_from(["text/plain", MSGPACK, JSON]))))
    host = request.host
    if how == "host":
        host = draw(st.sampled_from([None, "", "evil.example", "localhost", "[::1]", "127.0.0.1:99999",
                                     "a" * 300, "evil.example:80@127.0.0.1", ctx.authority.upper()]))
    return replace(request, headers=tuple(headers), body=body, content_length=content_length, host=host,
                   label=f"{request.route}.header-{how}", field="", framework=True)


SEGMENTS = ["", ".", "..", "%2e%2e", "%2F", "a%2Fb", "a%00b", "%00", "%ff", "%", "%zz", "a" * 129, "a" * 3000,
            "-a", "_a", ".a", "a%20b", "%C3%A9", "%E2%80%AE", "a;b", "a:b", "a@b", "%3Cscript%3E", "a+b", "~",
            "%ED%A0%80", "%F4%90%80%80", "a%0D%0AX-Injected:%201", "0", "A" * 128]


@functools.cache
def segments() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(SEGMENTS), st.text(min_size=1, max_size=40).map(lambda t: quote(t, safe="")),
                     st.sampled_from(POOL_JOBS))


@st.composite
def hostile_agent_path(draw: st.DrawFn, request: Request) -> Request:
    job = draw(segments())
    action = draw(st.one_of(st.sampled_from(AGENT_ACTIONS), st.sampled_from(
        ["", "JOIN", "join/", "join%00", "join/extra", "__init__", "x" * 1000, "join?x=1", "..%2Fjoin"])))
    prefix = draw(st.sampled_from(["/v1/jobs/", "/v1//jobs/", "//v1/jobs/", "/v1/jobs//", "/V1/jobs/", "/v1/jobs/./"]))
    return replace(request, target=f"{prefix}{job}/{action}", label="agent.path", job_id=None, field="",
                   forged=False)
