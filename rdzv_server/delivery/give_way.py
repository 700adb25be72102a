"""At the server's connection limit, with no idle connection to close, a held long-poll gives way: answered now, as
at its hold's end (the node's view; its lease runs again from its connection's last sign of life), and its
connection closed after, so the newcomer (a node's next poll or report) gets in. A holder of the agent token could
hold polls of made-up nodes up to the limit, and healthy nodes' requests were refused until their leases ran out
(a review: 75 made-up nodes, 4 polls each, the server at 512 descriptors). Which poll gives way, first to last: a
node's polls beyond its first (an agent holds one), then a node's in no running round (waiting, a spare: its loss
would cost no work), then a member's of a running round; within each, one drawn at random: a poll's age is the
client's to choose (the one that began waiting last singled out real agents, who poll again at every hold's end,
half their lease, while made-up nodes asked for holds of 30 s: a review saw real members take half of 3,015
give-ways; the longest waiting singled them out as soon as made-up nodes polled again faster).
"""
from __future__ import annotations

import random
from collections.abc import Callable

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
    """Held polls by tier; the one to give way is drawn at random from the first tier that has any, in O(1)."""

    def __init__(self, draw: Callable[[int], int] = random.randrange) -> None:
        self._tiers: tuple[list[Subscriber], ...] = ([], [], [])
        self._where: dict[Subscriber, tuple[int, int]] = {}      # its tier, its index there
        self._draw = draw

    def add(self, sub: Subscriber, tier_of: int) -> None:
        if self._where.get(sub, (tier_of,))[0] != tier_of:
            self.discard(sub)
        if sub not in self._where:
            self._where[sub] = (tier_of, len(self._tiers[tier_of]))
            self._tiers[tier_of].append(sub)

    def discard(self, sub: Subscriber) -> None:
        found = self._where.pop(sub, None)
        if found is None:
            return
        tier_of, index = found
        subs = self._tiers[tier_of]
        last = subs.pop()
        if last is not sub:            # the last one takes its slot
            subs[index] = last
            self._where[last] = (tier_of, index)

    def first_to_give_way(self) -> Subscriber | None:
        for subs in self._tiers:
            if subs:
                return subs[self._draw(len(subs))]
        return None
