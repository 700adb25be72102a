"""What every reply must satisfy, whatever was sent (the fuzz test and `make fuzz` share these rules).

- never a 5xx (a refusal for a server limit is 503 `limit_reached` with Retry-After; the fuzzer stays
  under the limits, so any 5xx is a finding);
- a 4xx carries one error body in the server's format (MessagePack for POSTs to agent paths, JSON
  otherwise): a known `code` whose HTTP status matches, and a one-line `message` with no traceback;
- a refused single-field mutation is named in the message (`$.config.min_nodes`, `field 'reason'`);
- JSON is strict (no NaN/Infinity), and no HTML page echoes a hostile tag unescaped.
"""
from __future__ import annotations

import json
from typing import Any

import msgpack

from protocol.errors import HTTP_STATUS
from tests.fuzz.rawhttp import Reply
from tests.fuzz.requests import Request

STATUS_OF_CODE = {code.value: status for code, status in HTTP_STATUS.items()}
MAX_MESSAGE_CHARS = 1000        # every echo of client input in a message is cut (to 300 characters)
TAGS = ("<script>alert('fz')", "<img src=x>")


def _strict_constant(name: str) -> Any:
    raise ValueError(f"JSON has {name}")


def decode_error(reply: Reply) -> dict[str, Any] | str:
    """The error map of `reply`, or why it is not one."""
    try:
        if reply.content_type == "application/msgpack":
            body = msgpack.unpackb(reply.body, raw=False)
        elif reply.content_type == "application/json":
            body = json.loads(reply.body, parse_constant=_strict_constant)
        else:
            return f"error body of type {reply.content_type or 'none'!r}: {reply.body[:120]!r}"
    except (ValueError, msgpack.UnpackException) as exc:
        return f"error body does not decode ({exc}): {reply.body[:120]!r}"
    if not isinstance(body, dict) or not isinstance(body.get("code"), str) or not isinstance(body.get("message"), str):
        return f"error body is not {{code, message}}: {body!r:.200}"
    return body


def field_named(name: str, message: str) -> bool:
    """Whether `message` names the field at `name` ("config.min_nodes", "failures[0].rank")."""
    last = name.rsplit(".", 1)[-1].split("[", 1)[0]
    return last in message or last.replace("_", " ") in message     # "local rank(s) [7]" names local_rank


def problems(request: Request, reply: Reply) -> list[str]:
    """What is wrong with `reply` as an answer to `request` ([] when nothing)."""
    found: list[str] = []
    if reply.status >= 500:
        found.append(f"HTTP {reply.status}")
    if request.framework and 400 <= reply.status < 500 and reply.content_type == "text/plain":
        return found      # aiohttp refused it before any of the server's code ran
    html_404 = reply.status == 404 and reply.content_type == "text/html" and request.target.startswith("/jobs/")
    if reply.status >= 400 and request.method != "HEAD" and not html_404:   # (a job page has its own 404 page)
        error = decode_error(reply)
        if isinstance(error, str):
            found.append(error)
        else:
            code, message = error["code"], error["message"]
            if STATUS_OF_CODE.get(code) != reply.status:
                found.append(f"code {code!r} with HTTP {reply.status} (the table says {STATUS_OF_CODE.get(code)})")
            if not message.strip() or "\n" in message or "\r" in message:
                found.append(f"message is not one line: {message[:200]!r}")
            if len(message) > MAX_MESSAGE_CHARS:
                found.append(f"message of {len(message)} characters")
            if "Traceback" in message:
                found.append("message carries a traceback")
            if code == "bad_request" and request.field and not field_named(request.field, message):
                found.append(f"refusal does not name the field {request.field!r}: {message[:200]!r}")
    if reply.status == 503 and reply.header("Retry-After") is None:
        found.append("503 without Retry-After")
    if reply.status < 300 and reply.content_type == "application/json" and request.method != "HEAD":
        try:
            json.loads(reply.body, parse_constant=_strict_constant)
        except ValueError as exc:
            found.append(f"JSON reply is not strict JSON: {exc}")
    if reply.status == 200 and reply.content_type == "application/msgpack":
        status = agent_status(reply)
        found += status_problems(status) if status is not None else ["200 agent reply is not a NodeStatus map"]
    if reply.content_type == "text/html":
        text = reply.body.decode("utf-8", "replace")
        found += [f"HTML page echoes {tag!r} unescaped" for tag in TAGS if tag in text]
        if reply.header("X-Content-Type-Options") != "nosniff":
            found.append("HTML reply without X-Content-Type-Options: nosniff")
    return found


def status_problems(status: dict[str, Any]) -> list[str]:
    """What is wrong with a NodeStatus map (its `reason` is a line an agent prints)."""
    reason = status.get("reason")
    if isinstance(reason, str) and ("\n" in reason or "\r" in reason):
        return [f"reason is not one line: {reason[:200]!r}"]
    return []


def agent_status(reply: Reply) -> dict[str, Any] | None:
    """The NodeStatus map of a 200 agent reply (None when it is not one)."""
    try:
        body = msgpack.unpackb(reply.body, raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    return body if isinstance(body, dict) and "job_state" in body else None
