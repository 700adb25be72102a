"""An agent request's connection: what the core reads of it (`Arrival`: addresses, a join's secret, a held poll),
and what only the transport uses: how long ago the node's kernel last answered (a held poll's sign of life), how
to answer a poll during a wake, and how long the request waited for the server."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from protocol.messages import NodeStatus
from rdzv_server.core.requests import Arrival
from rdzv_server.delivery.subscriber import AckAge, PeerClosed

# Sends a poll's reply straight to its connection; False: it could not (web/direct_reply.py).
Reply = Callable[[NodeStatus], bool]
HangUp = Callable[[], None]      # closes the connection once its reply is out (web/app.py)


@dataclass(frozen=True)
class Connection(Arrival):
    ack_age: AckAge | None = None   # seconds since its kernel last heard the node (None: unknown)
    reply: Reply | None = None      # sends a poll's answer during a wake
    waited_s: float = 0.0           # how long it waited for the server (a poll's hold counts from its arrival)
    peer_closed: PeerClosed | None = None   # whether the node's host closed it, its FIN not yet read
    hang_up: HangUp | None = None   # have it closed after its reply (a held poll giving way: give_way.py)


IN_PROCESS = Connection()           # node-agent --standalone, tests: no socket
