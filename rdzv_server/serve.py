"""Serving the app: the listening socket, TLS, the process's limits, and a clean stop on a signal.

The listening socket is made here so that its options are ours: a large accept backlog (after a restart
every agent reconnects at once, and a SYN dropped from a full queue is retried only after a second),
and TCP keepalive, inherited by accepted connections, so a dead host's long-poll is noticed within
seconds. The soft open-file limit is raised to the hard one, so agents do not exhaust descriptors.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
from dataclasses import dataclass, field

from aiohttp import web

from protocol import keepalive
from protocol.descriptors import raise_open_file_limit
from rdzv_server import tcp_info
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.rendezvous import Limits, Rendezvous
from rdzv_server.delivery.caps import MAX_POLLS_PER_NODE, MAX_POLLS_PER_PEER
from rdzv_server.gc_tuning import Freezer, tune_gc
from rdzv_server.heap import HeapTrimmer
from rdzv_server.looplag import LoopLagMeter
from rdzv_server.store.api import Store
from rdzv_server.store.etcd.election import Leadership
from rdzv_server.store.etcd.store import EtcdStore
from rdzv_server.web.access import Access
from rdzv_server.web.app import NOTES, create_app
from rdzv_server.web.connections import FD_RESERVE, GUARD, ConnectionGuard
from rdzv_server.web.metrics import METRICS, ConnectionCollector
from rdzv_server.web.tls_port import TlsPort

log = logging.getLogger("rdzv_server")

# The kernel caps the backlog at net.core.somaxconn (4,096 by default): raise that too for more nodes.
LISTEN_BACKLOG = 65535
# asyncio's own loop accepts up to create_server's `backlog` connections before it runs anything else
# (a stall when a fleet comes back): it gets this many, then LISTEN_BACKLOG again. uvloop accepts one a turn.
ACCEPT_BATCH = 64
IDLE_TIMEOUT_S = 60.0


class ListenError(Exception):
    """The server cannot listen on the address it was given."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 29400
    access: Access = field(default_factory=Access)
    tls: ssl.SSLContext | None = None
    notes: tuple[str, ...] = ()          # warnings for operators (start-up and the status page)
    limits: Limits = field(default_factory=Limits)
    max_polls_per_peer: int = MAX_POLLS_PER_PEER
    max_polls_per_node: int = MAX_POLLS_PER_NODE
    max_connections: int = 0             # 0: as many as the open-file limit allows
    gc_tuning: bool = True


@dataclass(frozen=True)
class Replication:
    """One replica of several on etcd: the store, this replica's URL for agents, the leader's lease."""
    store: EtcdStore
    advertise_url: str | None = None      # None: http(s)://THIS-HOST:PORT
    leader_ttl_s: int = 5


def listening_socket(host: str, port: int) -> socket.socket:
    sock = None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        keepalive.enable(sock)          # accepted connections inherit it
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


async def serve(config: ServerConfig, store: Store | None = None,
                ready: asyncio.Future[int] | None = None, replication: Replication | None = None) -> None:
    """Serve until SIGTERM/SIGINT. With `replication`: listen at once, serve agents only while leading."""
    if replication is not None:
        store = replication.store
    limit = raise_open_file_limit()
    hard = max(64, limit - FD_RESERVE)
    guard = ConnectionGuard(min(config.max_connections or hard, hard), hard)
    lag = LoopLagMeter()
    coordinator = Coordinator(Rendezvous(limits=config.limits), store=store, loop_lag=lag,
                              max_polls_per_peer=config.max_polls_per_peer,
                              max_polls_per_node=config.max_polls_per_node)
    app = create_app(coordinator, access=config.access, standby=replication is not None)
    app.middlewares.insert(0, guard.middleware)
    app[GUARD] = guard
    hub = coordinator.hub
    guard.give_way = hub.give_way         # at the hard limit with none idle, a held poll makes room
    app[METRICS].registry.register(ConnectionCollector(lambda: (guard.refused, guard.evicted, hub.gave_way,
                                                                         guard.heads.closed)))
    app[NOTES] = config.notes
    trimmer = HeapTrimmer()
    coordinator.effect_listeners.append(trimmer.on_effects)
    # keepalive_timeout: aiohttp closes a connection idle this long (a new one too): idle ones do not pile up.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0,
                           keepalive_timeout=IDLE_TIMEOUT_S)
    # The port first: a second server on a port in use is refused in one line before it loads (and marks) a store.
    sock = listening_socket(config.host, config.port)
    try:
        await runner.setup()             # the state is loaded here (the coordinator's start)
    except BaseException:
        sock.close()
        raise
    if (problem := tcp_info.check()) is not None:
        log.warning("%s: the server reads no connection's state from the kernel", problem)
    freezer = Freezer() if config.gc_tuning else None
    if freezer is not None:
        tune_gc()
        freezer.start()
    loop = asyncio.get_running_loop()
    try:
        assert runner.server is not None        # made by setup()
        server: asyncio.AbstractServer | TlsPort
        if config.tls is not None:              # handshakes bounded before they cost more than a descriptor
            server = TlsPort(sock, guard.factory(runner.server, evict=False), config.tls, max(16, hard // 4),
                             guard.not_connected)
            guard.close_a_handshake = server.close_a_handshake
        else:
            batched = isinstance(loop, asyncio.BaseEventLoop)      # asyncio's own loop, not uvloop
            server = await loop.create_server(guard.factory(runner.server), sock=sock,
                                              backlog=ACCEPT_BATCH if batched else LISTEN_BACKLOG)
            if batched:
                sock.listen(LISTEN_BACKLOG)     # create_server listened with ACCEPT_BATCH: the queue as it was
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    lag.watch_listener(sock)     # a node's next poll may wait in its accept queue
    bound = sock.getsockname()
    scheme = "https" if config.tls else "http"
    host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(f"rdzv-server listening on {scheme}://{host}:{bound[1]}", flush=True)
    log.info("serving on %s://%s:%d (open-file limit %d)", scheme, host, bound[1], limit)
    leadership: Leadership | None = None
    if replication is not None:
        url = replication.advertise_url or f"{scheme}://{_advertised_host(config.host, host)}:{bound[1]}"
        leadership = Leadership(replication.store.settings, replication.store, url, replication.leader_ttl_s,
                                on_elected=coordinator.take_over, on_deposed=coordinator.step_down)
        coordinator.gate.follow(leadership.sure, lambda: None if leadership is None or leadership.leading
                                else leadership.leader_url, leadership.electing, replication.store.where)
        leadership.on_news = coordinator.gate.election_news
        leadership.start()
        log.info("replica %s on %s: standing by until elected", url, replication.store.where)
    if ready is not None:
        ready.set_result(bound[1])
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        trimmer.cancel()
        if freezer is not None:
            await freezer.stop()
        server.close()                  # no new connections; then aiohttp answers and closes the open ones
        if leadership is not None:
            leadership.stop_campaigning()
        await runner.cleanup()          # the last commits and the clean-shutdown mark, still fenced
        if leadership is not None:
            await leadership.resign()
        print("rdzv-server stopped", flush=True)


def _advertised_host(configured: str, bound: str) -> str:
    """Where agents are told to reach this replica: the listening address, or this host's name on 0.0.0.0/::."""
    if configured in ("0.0.0.0", "::", ""):
        name = socket.getfqdn()
        return f"[{name}]" if ":" in name else name
    return bound
