"""`rdzv-ctl`'s side of HTTP: the server's address, its tokens, TLS, and one-line errors; standard library only,
so rdzv-ctl starts fast. The agent token (or the admin token) reads the views; the admin token goes with admin
actions. The token rule is the server's own (protocol/tokens.py): a file the server accepts rdzv-ctl accepts too."""
from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol.tokens import read_token_file

DEFAULT_SERVER = "http://127.0.0.1:29400"
TOKEN_ENV = "RDZV_TOKEN_FILE"
ADMIN_TOKEN_ENV = "RDZV_ADMIN_TOKEN_FILE"


class CtlError(Exception):
    """A failure to report in one line (no traceback) and exit 1."""


class UsageError(Exception):
    """Options that cannot work (an unreadable token or CA file): one line, exit 2."""


@dataclass(frozen=True)
class Token:
    value: str
    source: str          # where it came from, as the user would name it: "--token-file F" or "$RDZV_TOKEN_FILE (F)"


def read_token(flag: str, path: str | None, env: str) -> Token | None:
    """The token in the file `flag` names, else the one in the file $`env` names, else None."""
    source = f"{flag} {path}"
    if path is None:
        if not (path := os.environ.get(env)):
            return None
        source = f"${env} ({path})"
    try:
        return Token(read_token_file(path).decode("ascii"), source)
    except ValueError as exc:
        raise UsageError(f"{source}: {exc}") from None


def server_url(server: str | None, endpoint: str | None, tls_ca: str | None) -> str:
    """The server's base URL: --endpoint, --server, $RDZV_SERVER or the default; https when only --tls-ca says so.
    Replicas, comma-separated, are each checked and kept so (Client tries them in turn)."""
    text = endpoint or server or os.environ.get("RDZV_SERVER") or DEFAULT_SERVER
    return ",".join(_one_url(part.strip(), tls_ca) for part in text.split(","))


def _one_url(url: str, tls_ca: str | None) -> str:
    if "://" not in url:
        url = ("https://" if tls_ca else "http://") + url
    try:       # urlsplit, hostname and port raise ValueError on "[::1", "[zz]:1", ":abc", ":99999"
        parsed = urllib.parse.urlsplit(url)
        valid = parsed.scheme in ("http", "https") and bool(parsed.hostname) and (parsed.port or 1) > 0
    except ValueError:
        valid = False
    if not valid:
        raise UsageError(f"server address must look like http://HOST:PORT, https://HOST:PORT or HOST:PORT, "
                         f"got {url!r}")
    if tls_ca and parsed.scheme != "https":
        raise UsageError(f"--tls-ca needs an https:// server, got {url!r}")
    return url


def tls_context(ca_file: str | None) -> ssl.SSLContext | None:
    if ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--tls-ca {ca_file}: {getattr(exc, 'strerror', None) or exc}") from None


def client_for(args: argparse.Namespace) -> Client:
    """The client rdzv-ctl's options describe; UsageError when a file they name cannot be used."""
    tls_ca = getattr(args, "tls_ca", None)
    server = server_url(getattr(args, "server", None), getattr(args, "endpoint", None), tls_ca)
    return Client(server, getattr(args, "timeout", 10.0),
                  token=read_token("--token-file", getattr(args, "token_file", None), TOKEN_ENV),
                  admin_token=read_token("--admin-token-file", getattr(args, "admin_token_file", None),
                                         ADMIN_TOKEN_ENV),
                  tls=tls_context(tls_ca))


LEADER_HEADER = "Rdzv-Leader"     # a standby replica's not_leader reply names the leader here


class Client:
    QUICK_S = 3.0      # among several replicas, how long a view is first asked of each (see _at_leader)

    def __init__(self, server: str, timeout: float, *, token: Token | None = None, admin_token: Token | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """`server`: a base URL, or several replicas' comma-separated: the leader among them answers."""
        self.replicas = [url.rstrip("/") for url in server.split(",")]
        self.server = self.replicas[0]
        self.timeout = timeout
        self.token = token
        self.admin_token = admin_token
        self.tls = tls
        self.slow: list[str] = []       # replicas that timed out on the last quick pass
        self.failed: dict[str, str] = {}  # replica -> why it gave no answer, for the request under way

    def get(self, path: str) -> Any:
        return self._at_leader(lambda: urllib.request.Request(self.server + path, headers={
            "Accept": "application/json"}), self.token or self.admin_token, admin=False)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        return self._at_leader(lambda: urllib.request.Request(self.server + path, data=data, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"}), self.admin_token, admin=True)

    def _at_leader(self, request: Callable[[], urllib.request.Request], token: Token | None, *, admin: bool) -> Any:
        """The request at each replica in turn until one answers; a standby's answer names the leader. Among
        several replicas a view is first asked of each for QUICK_S (a frozen replica accepts connections and never
        answers: the operator would wait the whole --timeout before the next one), then of those that did not
        answer in time for the whole --timeout. An admin action is sent once per replica: it may have acted."""
        quick = min(self.timeout, self.QUICK_S)
        self.failed = {}
        if admin or len(self.replicas) == 1 or quick >= self.timeout:
            return self._each_replica(self.replicas, request, token, admin=admin, timeout=self.timeout)
        self.slow = []
        try:
            return self._each_replica(self.replicas, request, token, admin=admin, timeout=quick)
        except CtlError:
            if not self.slow:
                raise
            self.server = self.slow[0]
            return self._each_replica(self.slow, request, token, admin=admin, timeout=self.timeout)

    def _each_replica(self, replicas: list[str], request: Callable[[], urllib.request.Request], token: Token | None,
                      *, admin: bool, timeout: float) -> Any:
        tried: list[str] = []
        while True:
            try:
                return self._call(request(), token, admin=admin, timeout=timeout)
            except _NotLeader as moved:
                tried.append(self.server)
                if moved.leader and moved.leader not in tried:
                    self.server = moved.leader
                    continue
                error = CtlError(str(moved))
            except CtlError as exc:
                tried.append(self.server)
                error = exc
            self.failed[tried[-1]] = str(error)
            untried = [r for r in replicas if r not in tried]
            if not untried:     # each replica's own line: a frozen one's timeout must not hide another's refusal
                raise CtlError("; ".join(dict.fromkeys(self.failed.values()))) if len(self.failed) > 1 else error
            self.server = untried[0]

    def _call(self, req: urllib.request.Request, token: Token | None, *, admin: bool, timeout: float) -> Any:
        if token is not None:
            req.add_header("Authorization", f"Bearer {token.value}")
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 503 and (exc.headers.get(LEADER_HEADER) is not None or len(self.replicas) > 1):
                raise _NotLeader(exc.headers.get(LEADER_HEADER, "").rstrip("/"),
                                 self._refusal(req, exc, token, admin)) from None
            raise CtlError(self._refusal(req, exc, token, admin)) from None
        except urllib.error.URLError as exc:
            self._timed_out(exc.reason)
            raise CtlError(self._unreachable(exc.reason)) from None
        except (OSError, ValueError, http.client.HTTPException) as exc:   # timeouts, resets, a malformed URL
            self._timed_out(exc)
            raise CtlError(self._unreachable(exc)) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise CtlError(f"server {self.server} answered {_shown(req.selector)} with something that is not JSON "
                           f"(is it an rdzv-server?)") from None

    def _timed_out(self, reason: object) -> None:
        if isinstance(reason, TimeoutError):
            self.slow.append(self.server)      # connected or not, no answer in time: asked again for longer

    def _refusal(self, req: urllib.request.Request, exc: urllib.error.HTTPError, token: Token | None,
                 admin: bool) -> str:
        what = f"server {self.server} refused {req.get_method()} {_shown(req.selector)}"
        if exc.code == 401:
            if admin:
                if token is None:
                    return (f"{what}: admin actions on this server need its admin token: pass --admin-token-file F "
                            f"(or set ${ADMIN_TOKEN_ENV}), F being the file of the server's --admin-token-file")
                return f"{what}: the admin token from {token.source} is not this server's admin token (401)"
            if token is None:
                return (f"{what}: this server's status needs its token: pass --token-file F (or set "
                        f"${TOKEN_ENV}), F being the file of the server's --token-file (or --admin-token-file)")
            return f"{what}: the token from {token.source} is not one of this server's tokens (401)"
        text = _error_text(exc)
        if text.startswith("HTTP ") and len(req.selector) > SHOWN_PATH:     # refused before the server read it
            text += f" (the path is {len(req.selector)} characters: is a job, node or host name that long?)"
        if exc.code == 403 and admin and "loopback" in text:
            text += " (with an admin token on the server: rdzv-ctl --admin-token-file F)"
        return f"{what}: {text}"

    def _unreachable(self, reason: object) -> str:
        if isinstance(reason, ssl.SSLCertVerificationError):
            return (f"cannot verify the TLS certificate of {self.server}: {reason.verify_message or reason}; "
                    f"pass --tls-ca F, F being the CA certificate that signed the server's certificate")
        if isinstance(reason, ssl.SSLError):
            return (f"TLS with {self.server} failed: {reason.reason or reason} (does the server serve https? "
                    f"without --tls-cert it serves http://)")
        if isinstance(reason, (http.client.RemoteDisconnected, http.client.BadStatusLine)) and \
                self.server.startswith("http://"):
            return (f"rdzv-server at {self.server} closed the connection without an answer (if it serves TLS, "
                    f"use https:// and --tls-ca)")
        text = getattr(reason, "strerror", None) or reason
        return f"cannot reach rdzv-server at {self.server}: {text}"


class _NotLeader(Exception):
    """A replica that does not lead (or is stopping) answered; `leader`: where it says the leader is."""

    def __init__(self, leader: str, text: str) -> None:
        super().__init__(text)
        self.leader = leader


SHOWN_PATH = 200    # a request path is echoed up to this long: a mistyped 20 kB name must not flood the terminal


def _shown(path: str) -> str:
    return path if len(path) <= SHOWN_PATH else f"{path[:SHOWN_PATH]}... ({len(path)} characters)"


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        doc = json.loads(exc.read())
        return f"{exc.code} {doc['code']}: {doc['message']}"
    except (ValueError, KeyError, TypeError, OSError):
        return f"HTTP {exc.code} {exc.reason}"
