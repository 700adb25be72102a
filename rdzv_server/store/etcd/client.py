"""etcd v3 through its HTTP/JSON gateway (`/v3/...`, every etcd since 3.4): base64 keys and values, 64-bit numbers
as strings. Not gRPC: the five calls needed are plain HTTP with `http.client` and `ssl`, so no gRPC runtime, and
the client itself tries the members in turn (one that refuses or times out passes the request to the next).
Calls block; the store's and the election's threads each have their own `EtcdClient` (a connection is not shared
between threads), one persistent connection per member. `EtcdUnavailable`: no member answered (retry later);
`EtcdRefused`: a member answered that the request itself is wrong (too large, bad auth, ...).
"""
from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_TXN_OPS = 128                 # etcd's --max-txn-ops default
DEFAULT_MAX_REQUEST_BYTES = 1536 * 1024   # etcd's --max-request-bytes default (1.5 MiB)
RANGE_PAGE = 1000                         # keys per range page (a load pages at one revision)


class EtcdUnavailable(Exception):
    """No etcd member answered the request (all down or cut off, no quorum, timed out)."""


class EtcdRefused(Exception):
    """An etcd member answered with an error that retrying will not fix."""


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: tuple[str, ...]              # "http://host:port" or "https://host:port"
    prefix: str = "/rdzv/"
    cacert: str | None = None               # etcdctl's --cacert, --cert, --key, --user, --password
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    timeout_s: float = 1.25                 # one request to one member: request_timeout_s(the leader TTL)
    max_txn_ops: int = DEFAULT_MAX_TXN_OPS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def describe(self) -> str:
        return f"etcd {','.join(self.endpoints)} (prefix {self.prefix})"


def request_timeout_s(leader_ttl_s: float) -> float:
    """How long one request waits for one member (store and election alike): a quarter of the leader's lease, at
    least 0.5 s, so a member that takes connections but never answers delays the next member's try that long, and
    a request tried at every member of three still ends inside the lease."""
    return max(0.5, leader_ttl_s / 4)


def parse_store_url(url: str, tls: bool) -> tuple[str, ...]:
    """`etcd://HOST:PORT[,HOST:PORT...]` -> member URLs (https when `tls`). ValueError with the reason."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "etcd":
        raise ValueError(f"expected etcd://HOST:PORT[,HOST:PORT...], got {url!r}")
    members = []
    for part in rest.rstrip("/").split(","):
        part = part.strip()
        parsed = urllib.parse.urlsplit("//" + part)
        try:
            port = parsed.port or 2379
        except ValueError:
            raise ValueError(f"bad port in {part!r} of {url!r}") from None
        if not parsed.hostname or parsed.path:
            raise ValueError(f"expected HOST:PORT, got {part!r} in {url!r}")
        host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
        members.append(f"{'https' if tls else 'http'}://{host}:{port}")
    return tuple(members)


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def prefix_end(prefix: str) -> str:
    """The range_end that makes a range cover every key starting with `prefix` (ASCII keys)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def put(key: str, value: bytes, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def delete(key: str, range_end: str | None = None) -> dict[str, Any]:
    body = {"key": b64(key)}
    if range_end is not None:
        body["range_end"] = b64(range_end)
    return {"request_delete_range": body}


def created_at(key: str, revision: int) -> dict[str, Any]:
    """Compare: `key` was created at `revision` (0: it does not exist)."""
    return {"result": "EQUAL", "target": "CREATE", "key": b64(key), "create_revision": str(revision)}


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    lease: int


def explain(message: str) -> str:
    """etcd's message, with what to do where etcd's own words do not say it."""
    if "CommonName of client" in message:
        # With client-cert-auth and auth on, the gateway cannot pass a certificate's CN on as the user: refused.
        return (f"{message} (with etcd authentication on, etcd's HTTP gateway refuses a client certificate "
                "that has a Common Name: give --etcd-cert one without a CN; --etcd-user names the user)")
    return message


class EtcdClient:
    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._current = 0                   # the member that answered last: tried first
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._token: str | None = None
        self._tls: ssl.SSLContext | None = None
        if any(e.startswith("https://") for e in settings.endpoints):
            self._tls = ssl.create_default_context(cafile=settings.cacert)
            if settings.cert:
                self._tls.load_cert_chain(settings.cert, settings.key)

    # ---- the calls ----

    def range(self, key: str, range_end: str | None = None, revision: int = 0,
              keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """The keys in [key, range_end) (just `key` without one), at `revision` (0: now), and the
        revision read; pages through large ranges at one revision."""
        found: list[KeyValue] = []
        start = key
        while True:
            body: dict[str, Any] = {"key": b64(start)}
            if range_end is not None:
                body.update(range_end=b64(range_end), limit=str(RANGE_PAGE))
            if revision:
                body["revision"] = str(revision)
            if keys_only:
                body["keys_only"] = True
            reply = self.call("/v3/kv/range", body)
            revision = revision or int(reply["header"]["revision"])
            page = [KeyValue(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")),
                             int(kv.get("lease", 0))) for kv in reply.get("kvs", [])]
            found.extend(page)
            if range_end is None or not reply.get("more") or not page:
                return found, revision
            start = page[-1].key + "\0"

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]] | None = None) -> tuple[bool, dict[str, Any]]:
        reply = self.call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        return bool(reply.get("succeeded")), reply

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        reply = self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(reply["ID"]), int(reply["TTL"])

    def keep_alive(self, lease: int) -> int:
        """Renew `lease` once: its TTL now, 0 when etcd no longer has it."""
        reply = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End `lease` and delete its keys (a lease etcd no longer has is not an error)."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdRefused as exc:
            if "lease not found" not in str(exc):
                raise

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    # ---- one request, to the members in turn ----

    def call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        endpoints = self.settings.endpoints
        failures = []
        reauthenticated = False
        tried = 0
        while tried < len(endpoints):
            index = (self._current + tried) % len(endpoints)
            endpoint = endpoints[index]
            try:
                status, reply = self._post(endpoint, route, data)
            except (OSError, http.client.HTTPException) as exc:
                message = str(getattr(exc, "strerror", None) or exc or type(exc).__name__)
                if isinstance(exc, (ssl.SSLError, ConnectionResetError)) and self._tls and not self.settings.cert:
                    # a member that requires client certificates ends the handshake in several ways
                    message += " (no client certificate was offered: does etcd require one? --etcd-cert/--etcd-key)"
            else:
                if status == 200:
                    self._current = index
                    return reply
                message = explain(str(reply.get("message") or reply.get("error") or f"HTTP {status}"))
                if status == 401 and "auth token" in message and not reauthenticated and self.settings.user:
                    self._token, reauthenticated = None, True       # an expired token: once more, with a new one
                    continue
                if status < 500 and status != 429:
                    raise EtcdRefused(f"{endpoint} refused {route}: {message}")
            failures.append(f"{endpoint}: {message}")    # unreachable, no leader, timed out, overloaded: next member
            tried += 1
        raise EtcdUnavailable("no etcd member answered (" + "; ".join(failures) + ")")

    def _post(self, endpoint: str, route: str, data: bytes) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json"}
        if self.settings.user and route != "/v3/auth/authenticate":
            if self._token is None:
                self._token = self._authenticate(endpoint)
            headers["Authorization"] = self._token
        conn = self._conns.get(endpoint)
        if conn is None:
            parsed = urllib.parse.urlsplit(endpoint)
            assert parsed.hostname is not None
            if parsed.scheme == "https":
                conn = http.client.HTTPSConnection(parsed.hostname, parsed.port, timeout=self.settings.timeout_s,
                                                   context=self._tls)
            else:
                conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=self.settings.timeout_s)
            self._conns[endpoint] = conn
        try:
            conn.request("POST", route, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except BaseException:
            conn.close()
            del self._conns[endpoint]
            raise
        try:
            # A streamed route (keep-alive) answers one JSON document per line: the first is ours.
            reply = json.loads(raw.split(b"\n", 1)[0] or b"{}")
        except ValueError:
            if resp.status == 200:
                raise http.client.HTTPException("HTTP 200 with a body that is not JSON") from None
            # etcd's HTTP front answers some refusals in plain text (e.g. the gateway's CommonName check)
            text = raw.decode("utf-8", "replace").strip().splitlines()
            reply = {"message": (text[0][:300] if text else f"HTTP {resp.status}")}
        return resp.status, reply if isinstance(reply, dict) else {}

    def _authenticate(self, endpoint: str) -> str:
        body = json.dumps({"name": self.settings.user, "password": self.settings.password or ""}).encode()
        status, reply = self._post(endpoint, "/v3/auth/authenticate", body)
        if status != 200 or "token" not in reply:
            message = str(reply.get("message") or reply.get("error") or f"HTTP {status}")
            if status >= 500 or status == 429:
                raise http.client.HTTPException(message)         # this member cannot tell: the next one
            if "CommonName of client" in message:
                raise EtcdRefused(f"{endpoint}: {explain(message)}")
            raise EtcdRefused(f"{endpoint} refused the user {self.settings.user!r}: {message}")
        return str(reply["token"])

