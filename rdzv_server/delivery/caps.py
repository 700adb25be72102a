"""Caps on long-polls held at once: per node, and optionally per client address. An agent holds one
poll (two for a moment), so a node holding more than `MAX_POLLS_PER_NODE` is misbehaving or hostile.
A cap by address would refuse honest agents behind one NAT address, so it is off unless set.
"""
from __future__ import annotations

from protocol.errors import ErrorCode
from rdzv_server.core.errors import RendezvousError

MAX_POLLS_PER_NODE = 4      # held polls for one node of one job (an agent holds one)
MAX_POLLS_PER_PEER = 0      # held polls from one client address (0: no limit; NAT puts many nodes behind one)


class HeldPolls:
    """How many polls each key holds open now; `take` refuses past `limit` (0: no limit)."""

    def __init__(self, limit: int, flag: str, what: str) -> None:
        self.limit = limit
        self._flag = flag
        self._what = what
        self._held: dict[object, int] = {}

    def take(self, key: object, shown: str) -> None:
        held = self._held.get(key, 0)
        if self.limit and held >= self.limit:
            raise RendezvousError(ErrorCode.LIMIT_REACHED, f"{held} long-polls are held open for {self._what} "
                                  f"{shown}, the server's limit ({self._flag} {self.limit})")
        self._held[key] = held + 1

    def give_back(self, key: object) -> None:
        left = self._held.pop(key, 1) - 1
        if left > 0:
            self._held[key] = left

    def held(self, key: object) -> int:
        return self._held.get(key, 0)
