"""At the server's connection limit, with no idle connection to close, a held long-poll gives way: answered now, as
at its hold's end (the node's view; its lease runs again from its connection's last sign of life), and its
connection closed after, so the newcomer (a node's next poll or report) gets in. A holder of the agent token could
hold polls of made-up nodes up to the limit, and healthy nodes' requests were refused until their leases ran out
(a review: 75 made-up nodes, 4 polls each, the server at 512 descriptors). Which poll gives way, first to last: a
node's polls beyond its first (an agent holds one), then a node's in no running round (waiting, a spare: its loss
would cost no work), then a member's of a running round; within each, the poll that began waiting last.
"""
from __future__ import annotations

from protocol.messages import JobState
from rdzv_server.core.records import JobRecord
from rdzv_server.delivery.subscriber import Subscriber

EXTRA, OUTSIDE, MEMBER = 0, 1, 2     # the tiers, in the order they give way


def tier(job: JobRecord | None, node_id: str, polls_held: int) -> int:
    """The tier of a poll of `node_id`, which now holds `polls_held` polls (this one included)."""
    if polls_held > 1:
        return EXTRA
    running = job is not None and job.state is JobState.RUNNING and job.round is not None \
        and node_id in job.round.members
    return MEMBER if running else OUTSIDE


class WaitingOrder:
    """Held polls by tier, each in the order they began waiting: the one to give way is found in O(1)."""

    def __init__(self) -> None:
        self._tiers: tuple[dict[Subscriber, None], ...] = ({}, {}, {})

    def add(self, sub: Subscriber, tier_of: int) -> None:
        self.discard(sub)
        self._tiers[tier_of][sub] = None

    def discard(self, sub: Subscriber) -> None:
        for t in self._tiers:
            t.pop(sub, None)

    def first_to_give_way(self) -> Subscriber | None:
        for t in self._tiers:
            if t:
                return next(reversed(t))
        return None
