"""The contract of a node waiting for news: its key, what it was last sent, push, its link's last ack, close.
A view is news when the protocol's one rule says so (`poll_ready`), given the round the node said it
runs (`known_round`, `holding`); the kind of connection (a long-poll, long_poll.py) says how a view is pushed.
"""
from __future__ import annotations

import abc
from collections.abc import Callable

from protocol.messages import NodeStatus, poll_ready

AckAge = Callable[[], "float | None"]   # seconds since the connection's last ACK (None: unknown)
PeerClosed = Callable[[], bool]        # whether the node's host closed the connection, its FIN not yet read


class Subscriber(abc.ABC):
    __slots__ = ("ack_age", "drop_told", "ends", "holding", "job_id", "known_round", "node_id", "peer_closed")

    def __init__(self, job_id: str, node_id: str, known_round: int, ack_age: AckAge | None,
                 holding: bool = False) -> None:
        self.job_id = job_id
        self.node_id = node_id
        self.known_round = known_round       # the round of the last view the node was sent
        self.holding = holding               # ... and whether its ranks hold at their next snapshot
        self.ack_age = ack_age               # its connection's kernel: when it last heard the node
        self.peer_closed: PeerClosed | None = None      # ... and whether the node's host closed it, unread yet
        self.drop_told = False               # its close told to the core before the loop read it (Hub.closed_unread)
        self.ends = float("inf")             # loop time at which its hold ends

    @property
    def key(self) -> tuple[str, str]:
        return self.job_id, self.node_id

    def wants(self, view: NodeStatus) -> bool:
        """Whether `view` is news to this node."""
        return poll_ready(view, self.known_round, self.holding)

    @abc.abstractmethod
    def push(self, view: NodeStatus) -> bool:
        """Send `view` now, from the hub's pass; False when it cannot (its owner then looks itself)."""

    @abc.abstractmethod
    def close(self, *, ended: bool, hang_up: bool = False) -> None:
        """Stop waiting: `ended`, the hold is over; else its owner must look again (not serving, gone, unsaved).
        `hang_up`: its connection is closed once answered (it gave way: give_way.py)."""
