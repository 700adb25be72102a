"""`rdzv-server`: parse flags into a ServerConfig, check what can be checked before serving, serve.
A bad flag or unusable file is one line on stderr and exit 2 (a flag) or 1 (a file, an address), never
a traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import math
import sqlite3
import ssl
import sys
from collections.abc import Coroutine
from typing import Any

from rdzv_server import logs
from rdzv_server.core.rendezvous import Limits
from rdzv_server.delivery.caps import MAX_POLLS_PER_NODE, MAX_POLLS_PER_PEER
from rdzv_server.serve import ListenError, Replication, ServerConfig, serve
from rdzv_server.store.etcd import options as etcd_options
from rdzv_server.store.etcd.store import EtcdStore
from rdzv_server.store.sqlite import SqliteStore, StoreError, describe_failure
from rdzv_server.web.access import Access, TokenError, read_token


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdzv-server", allow_abbrev=False,
                                description="Standalone rendezvous server for node-agent jobs.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29400, help="port to listen on; 0 picks a free one (default 29400)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="folder for the durable state store (created when missing; default ./rdzv-state). "
                        "'none' keeps state in memory only: it does not survive a restart")
    p.add_argument("--token-file", metavar="F",
                   help="file holding the token every agent (node-agent --token-file) and every status reader "
                        "must present as a bearer token")
    p.add_argument("--admin-token-file", metavar="F",
                   help="file holding the token for the /v1/admin/ actions (rdzv-ctl --admin-token-file); "
                        "without one, admin actions are accepted from loopback only")
    p.add_argument("--public-status", action="store_true",
                   help="serve the status views (JSON, page, /metrics) without a token")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a host name the status views and admin actions answer to when they need no token "
                        "(repeatable; IP addresses, localhost and this host's names always work)")
    p.add_argument("--allow-remote-admin", action="store_true",
                   help="accept /v1/admin/ actions from any address when there is no --admin-token-file")
    p.add_argument("--tls-cert", metavar="F", help="serve https with this certificate (PEM, with its chain)")
    p.add_argument("--tls-key", metavar="F", help="the private key of --tls-cert (PEM)")
    limits = Limits()
    p.add_argument("--retain-finished", type=float, default=limits.retain_finished_s, metavar="S",
                   help="forget a finished job (memory and store) this long after it ended "
                        f"(default {limits.retain_finished_s:g})")
    p.add_argument("--max-jobs", type=int, default=limits.max_jobs, metavar="N",
                   help=f"jobs held at most, finished ones included (default {limits.max_jobs})")
    p.add_argument("--max-nodes", type=int, default=limits.max_nodes, metavar="N",
                   help=f"node records held at most over all jobs (default {limits.max_nodes})")
    p.add_argument("--unhealthy-hold", type=float, default=limits.unhealthy_hold_s, metavar="S",
                   help="keep a host whose node left a job unhealthy (a broken GPU, a failed --health-check) out "
                        f"of every job this long; 0: never (default {limits.unhealthy_hold_s:g})")
    p.add_argument("--max-polls-per-peer", type=int, default=MAX_POLLS_PER_PEER, metavar="N",
                   help="long-polls held open for one client address; 0: no limit (the default: many agents may "
                        "share one address behind NAT)")
    p.add_argument("--max-polls-per-node", type=int, default=MAX_POLLS_PER_NODE, metavar="N",
                   help=f"long-polls held open for one node (its credential); 0: no limit "
                        f"(default {MAX_POLLS_PER_NODE}; an agent holds one)")
    p.add_argument("--max-connections", type=int, default=0, metavar="N",
                   help="open connections at most (the longest-idle one makes room); default: the open-file "
                        "limit less a reserve")
    p.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="event loop: uvloop when installed (auto), or the standard one")
    p.add_argument("--no-gc-tuning", action="store_true",
                   help="leave Python's garbage collector as it is (for comparisons; see docs/benchmarks.md)")
    etcd_options.add_arguments(p)
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


class UsageError(Exception):
    """A flag combination or file that cannot be used (exit 1 or 2 as `code` says)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def config_from(args: argparse.Namespace) -> ServerConfig:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}", 2)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together", 2)
    if not math.isfinite(args.unhealthy_hold) or not 0 <= args.unhealthy_hold <= 7 * 24 * 3600:
        raise UsageError(f"--unhealthy-hold must be 0..604800 seconds, got {args.unhealthy_hold}", 2)
    if not math.isfinite(args.retain_finished) or args.retain_finished < 0:
        raise UsageError(f"--retain-finished must be >= 0 seconds, got {args.retain_finished}", 2)
    for flag, value, least in (("--max-jobs", args.max_jobs, 1), ("--max-nodes", args.max_nodes, 1),
                               ("--max-polls-per-peer", args.max_polls_per_peer, 0),
                               ("--max-polls-per-node", args.max_polls_per_node, 0),
                               ("--max-connections", args.max_connections, 0)):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}", 2)
    try:
        access = Access(
            agent_token=read_token(args.token_file, "--token-file") if args.token_file else None,
            admin_token=read_token(args.admin_token_file, "--admin-token-file") if args.admin_token_file else None,
            public_status=args.public_status, allow_remote_admin=args.allow_remote_admin,
            allowed_hosts=frozenset(h.lower() for h in args.allowed_host))
    except TokenError as exc:
        raise UsageError(str(exc)) from None
    tls = None
    if args.tls_cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.options |= ssl.OP_NO_RENEGOTIATION   # a client's renegotiation loop costs a handshake each (tls.py)
        try:
            tls.load_cert_chain(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"cannot use --tls-cert {args.tls_cert} / --tls-key {args.tls_key}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    return ServerConfig(host=args.host, port=args.port, access=access, tls=tls, notes=tuple(_notes(args, access)),
                        limits=Limits(retain_finished_s=args.retain_finished, max_jobs=args.max_jobs,
                                      max_nodes=args.max_nodes, unhealthy_hold_s=args.unhealthy_hold),
                        max_polls_per_peer=args.max_polls_per_peer,
                        max_polls_per_node=args.max_polls_per_node, max_connections=args.max_connections,
                        gc_tuning=not args.no_gc_tuning)


def _notes(args: argparse.Namespace, access: Access) -> list[str]:
    """What an operator should know about how exposed this server is (start-up line and status page)."""
    notes = []
    if not _loopback_only(args.host):
        if access.agent_token is None:
            notes.append(f"listening on {args.host} without --token-file: anyone who can reach this port can "
                         "join, report for and end jobs")
        if args.tls_cert is None and access.agent_token is not None:
            notes.append("tokens are sent without TLS (no --tls-cert): anyone on the network path can read them")
    return notes


def _loopback_only(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def replication(args: argparse.Namespace) -> Replication | None:
    """The etcd store and the election, with --store etcd://... (None: one server on --state-dir)."""
    if args.store is None:
        for flag in ("advertise_url", "etcd_cacert", "etcd_cert", "etcd_user"):
            if getattr(args, flag):
                raise UsageError(f"--{flag.replace('_', '-')} needs --store etcd://...", 2)
        return None
    if args.state_dir is not None:
        raise UsageError("--state-dir and --store are two places for the state: give one", 2)
    try:
        settings = etcd_options.settings_from(args)
    except ValueError as exc:
        raise UsageError(str(exc), 2) from None
    if args.advertise_url is not None and not args.advertise_url.startswith(("http://", "https://")):
        raise UsageError(f"--advertise-url must be an http:// or https:// URL, got {args.advertise_url!r}", 2)
    return Replication(EtcdStore(settings), args.advertise_url, args.leader_ttl)


def open_store(state_dir: str) -> SqliteStore | None:
    if state_dir.lower() in ("none", "memory", ""):
        print("rdzv-server: state in memory only (--state-dir none): jobs do not survive a restart",
              file=sys.stderr)
        return None
    return SqliteStore(state_dir)


def run_loop(main: Coroutine[Any, Any, None], choice: str) -> None:
    """Run `main` on uvloop when it is installed (or asked for), else on asyncio's own loop."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise UsageError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from(args)
        logs.setup(args.log_format, args.log_level)
        for note in config.notes:
            print(f"rdzv-server: warning: {note}", file=sys.stderr)
        replicas = replication(args)
        store = open_store(args.state_dir or "rdzv-state") if replicas is None else None
        run_loop(serve(config, store=store, replication=replicas), args.event_loop)
    except (UsageError, StoreError) as exc:
        print(f"rdzv-server: error: {exc}", file=sys.stderr)
        return exc.code if isinstance(exc, UsageError) else 1
    except sqlite3.Error as exc:     # e.g. a full disk at a clean stop: its mark could not be written
        state_dir = args.state_dir or "rdzv-state"     # (None when the default was taken)
        print(f"rdzv-server: error: the state store in {state_dir} failed: {describe_failure(exc, state_dir)}",
              file=sys.stderr)
        return 1
    except ListenError as exc:
        print(f"rdzv-server: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rdzv-server: error: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
