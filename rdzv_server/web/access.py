"""Who may use which route: bearer tokens, the admin rule, browser safety, security headers.

Routes fall into four classes (`route_class`):
- health (`/healthz`, `/readyz`): always open;
- agent (`POST /v1/jobs/...`): the agent token where there is one. A request with an `Origin` is a web
  page's (agents send none): it must be same-origin at one of the server's names;
- views (status JSON, the page, `/metrics`): the agent or admin token (a browser's HTTP Basic password),
  unless `--public-status`; without a token only a `Host` that is one of the server's names is answered;
- admin (`/v1/admin/...`): a JSON content type (no cross-site page can send one without a CORS preflight,
  never granted) and no foreign `Origin`; then the admin token, or, without one, one of the server's
  names as `Host` and a loopback peer unless `--allow-remote-admin`.
The `Host` checks defeat DNS rebinding. Tokens are compared in constant time, never logged or shown.
"""
from __future__ import annotations

import base64
import binascii
import functools
import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from protocol.errors import ErrorCode
from protocol.quoting import quote
from protocol.tokens import read_token_file
from rdzv_server.core.errors import RendezvousError

JSON = "application/json"

HTML_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class TokenError(Exception):
    """A token file that cannot be used; the message names the file and why."""


def read_token(path: str, flag: str) -> bytes:
    """The token in `path` (surrounding whitespace removed), or TokenError naming `flag`."""
    try:
        return read_token_file(path)
    except ValueError as exc:
        raise TokenError(f"{flag} {path}: {exc}") from None


@dataclass(frozen=True)
class Access:
    """The server's access settings (from its command line)."""
    agent_token: bytes | None = None
    admin_token: bytes | None = None
    public_status: bool = False
    allow_remote_admin: bool = False
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)


ACCESS = web.AppKey("access", Access)
NO_STREAM = "no-stream"     # the route that refuses an old agent's stream, as an agent route (web/app.py)


def route_class(request: web.Request) -> str:
    path = request.path
    if path in ("/healthz", "/readyz"):
        return "health"
    if path.startswith("/v1/admin/"):
        return "admin"
    if path.startswith("/v1/jobs/") and (request.method == "POST" or request.match_info.route.name == NO_STREAM):
        return "agent"        # the agent's requests, and an old agent's ask for a stream (refused)
    return "views"


def presented_token(request: web.Request) -> bytes | None:
    """The token in `Authorization: Bearer T` or as the password of `Basic` auth; a non-ASCII header
    is refused (no token is: aiohttp hands its bytes over as lone surrogates)."""
    header = request.headers.get("Authorization", "")
    if not header.isascii():
        raise _unauthorized("the Authorization header is not ASCII (a token is printable ASCII): "
                            "send 'Authorization: Bearer TOKEN'", 'Bearer realm="rdzv-server"')
    scheme, _, value = header.partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return value.strip().encode()
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        return decoded.partition(b":")[2]
    return None


def _matches(given: bytes | None, *tokens: bytes | None) -> bool:
    # every token is compared (a list, not a short-circuiting generator): constant time over the tokens
    return given is not None and any([hmac.compare_digest(given, t) for t in tokens if t is not None])


def _unauthorized(message: str, scheme: str) -> RendezvousError:
    return RendezvousError(ErrorCode.UNAUTHORIZED, message, {"WWW-Authenticate": scheme})


def check(request: web.Request, access: Access) -> None:
    """Raise RendezvousError when `request` may not use its route."""
    kind = route_class(request)
    if kind == "health":
        return
    given = presented_token(request)
    if kind == "agent":
        if "Origin" in request.headers:      # a web page's request: only a page of this server, at one of its names
            if not _same_origin(request.headers["Origin"], request):
                raise RendezvousError(ErrorCode.FORBIDDEN,
                                      "agent routes refuse requests from a web page of another origin")
            _check_host(request, access, "agent routes from a web page")
        if access.agent_token is not None and not _matches(given, access.agent_token):
            raise _unauthorized("missing or wrong token: start node-agent with --token-file "
                                "(the file the server's --token-file names)", 'Bearer realm="rdzv-server"')
        return
    if kind == "views":
        if access.public_status or (access.agent_token is None and access.admin_token is None):
            _check_host(request, access, "views without a token")
        elif not _matches(given, access.agent_token, access.admin_token):
            raise _unauthorized("this server's status needs its token: send it as "
                                "'Authorization: Bearer TOKEN' (or as the password of HTTP Basic auth)",
                                'Basic realm="rdzv-server"')
        return
    _check_admin(request, access, given)


def _check_admin(request: web.Request, access: Access, given: bytes | None) -> None:
    if request.method == "POST":
        if request.content_type != JSON:
            raise RendezvousError(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                                  f"admin actions take Content-Type: {JSON}, got {quote(request.content_type)} "
                                  f"(with curl: -H 'Content-Type: {JSON}')")
        origin = request.headers.get("Origin")
        if origin is not None and not _same_origin(origin, request):
            raise RendezvousError(ErrorCode.FORBIDDEN, "admin actions from a web page of another origin "
                                  "are refused")
    if access.admin_token is not None:
        if not _matches(given, access.admin_token):
            raise _unauthorized("admin actions need the admin token: rdzv-ctl --admin-token-file F "
                                "(the file the server's --admin-token-file names)", 'Bearer realm="rdzv-admin"')
        return
    if not (access.allow_remote_admin or is_loopback(request.remote)):
        raise RendezvousError(ErrorCode.FORBIDDEN,
                              f"admin actions are only accepted from loopback (127.0.0.1, ::1); this request came "
                              f"from {request.remote or 'an unknown peer'}. Run rdzv-ctl on the server's host, or "
                              f"give the server an --admin-token-file (or --allow-remote-admin on a trusted "
                              f"network)")
    _check_host(request, access, "admin actions without an admin token")


def _same_origin(origin: str, request: web.Request) -> bool:
    """An `Origin` of this server itself (scheme://host[:port] equal to what the request addressed)."""
    host = request.headers.get("Host", "")
    return origin in (f"http://{host}", f"https://{host}")


def _check_host(request: web.Request, access: Access, what: str) -> None:
    """The `Host` must be one of the server's names: a page whose domain an attacker rebound to this
    server's address (DNS rebinding) sends its own domain there, and its `Origin` matches it."""
    host = request.headers.get("Host", "")
    name = _host_name(host)
    if name and (_ip(name) is not None or name in _own_names() or name in access.allowed_hosts):
        return
    raise RendezvousError(ErrorCode.FORBIDDEN,
                          f"Host {quote(host)} is not one of this server's names; start rdzv-server with "
                          f"--allowed-host {quote(name) if name else 'NAME'} to serve it ({what} only "
                          f"answer the server's own names, against DNS rebinding)")


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):                        # [v6]:port
        return host[1:host.find("]")] if "]" in host else ""
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`text` as an IP address (an IPv6 zone ignored); None when it is not one."""
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


@functools.cache
def _own_names() -> frozenset[str]:
    return frozenset({"localhost", "localhost.localdomain", socket.gethostname().lower(), socket.getfqdn().lower()})


def is_loopback(remote: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (::ffff:127.x.y.z)."""
    addr = _ip(remote or "")
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr is not None and addr.is_loopback


@web.middleware
async def access_middleware(request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    check(request, request.app[ACCESS])
    if request.headers.get("Content-Encoding", "identity").lower() not in ("identity", ""):
        raise RendezvousError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, "compressed request bodies are not accepted "
                              f"(Content-Encoding {quote(request.headers['Content-Encoding'])})")
    response = await handler(request)
    if response.content_type == "text/html":
        response.headers.update(HTML_HEADERS)
    return response
