"""TCP keepalive on every agent connection, at both ends: a peer whose host died or whose path was cut is noticed
in about IDLE_S + COUNT x INTERVAL_S (4 s), inside the default 5 s lease, even while a long-poll is held far
longer. The held connections' answers to these probes are also the server's evidence that its own link works.

Keepalive probes only an idle connection: one cut while its request (or a connect) is unacknowledged would
retransmit for minutes instead, and the agent could neither report the loss nor fence its workers. The same
bound on unacknowledged data (TCP_USER_TIMEOUT) ends that one as soon."""
from __future__ import annotations

import socket

IDLE_S = 2          # the first probe after this long without traffic
INTERVAL_S = 1      # then one every INTERVAL_S
COUNT = 2           # unanswered probes that end the connection
DEAD_AFTER_S = IDLE_S + COUNT * INTERVAL_S     # sent data (or a SYN) unacknowledged this long ends it too


def enable(sock: socket.socket) -> None:
    """Keepalive probes on `sock`, timed as above where the platform lets them be timed."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, COUNT)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_AFTER_S * 1000)
