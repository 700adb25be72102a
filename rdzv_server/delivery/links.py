"""Held long-polls' connections as signs that the server's own link works. A held poll sends nothing
until answered, so to the quiet rule (core/leases.py) a small job's long holds would look like the
server cut off. Their kernels answer keepalive probes (serve.py: after 2 s idle), so once the server has
heard nothing else for DOUBT_QUIET_S, the freshest ACK on a held connection says when the link worked.
"""
from __future__ import annotations

import itertools

from rdzv_server.core.leases import DOUBT_QUIET_S, OUTAGE_LIMIT_S
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.delivery.subscriber import AckAge

CHECK_GAP_S = 0.5       # looked at no more often than this (an outage keeps the rule asking)
MAX_CHECKED = 256       # connections looked at per check: when the link works, any live one answers
# A held poll's connection that ended with its last ACK this fresh (plus how far the loop ran behind: a FIN
# that came in during a stall) was closed by the node's host (a FIN or RST just in), not by a keepalive giving
# up (that takes 4 s of silence): evidence (leases.closing_heard).
CLOSE_HEARD_S = 1.0


class HeldLinks:
    def __init__(self) -> None:
        self._ages: dict[AckAge, None] = {}
        self._checked = float("-inf")

    def __len__(self) -> int:
        return len(self._ages)

    def add(self, age: AckAge) -> None:
        self._ages[age] = None

    def discard(self, age: AckAge) -> None:
        self._ages.pop(age, None)

    def check(self, core: Rendezvous, now: float) -> None:
        """Before the rules about silences (core/leases.py) judge a lapsing lease, ask the held connections."""
        quiet = core.heard_at is not None and now - core.heard_at >= DOUBT_QUIET_S
        if not quiet or self._checked <= now < self._checked + CHECK_GAP_S:     # asked just now: not again
            return
        self._checked = now
        ages = (age() for age in itertools.islice(self._ages, MAX_CHECKED))
        freshest = min((a for a in ages if a is not None), default=None)
        if freshest is not None and 0.0 <= freshest < OUTAGE_LIMIT_S:
            core.heard(now - freshest)
