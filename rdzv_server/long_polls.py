"""Long-polls held by the coordinator: how long each is held, the node's lease while it is open,
and its answer.

The open poll is the node's lease (the core's `hold_poll`, then `poll_ended`, or
`connection_dropped` when its connection closes under it: core/leases.py). Held polls wait on the
coordinator's `Waiters`; when their job changes, `answer_early` looks at each poll's view without
waking its task: nothing new, and the poll waits on; ready and saved, and its reply is written
during the wake itself through the web layer's `Reply` (web/direct_reply.py: at 10,000 held polls
each task's own answer came ~230 us after the one before), the task only catching up after (the
poll's end, its caps given back).
"""
from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.messages import NodeStatus, PollRequest, poll_ready
from protocol.quoting import quote
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.rounds import node_status
from rdzv_server.held_links import CLOSE_HEARD_S, AckAge
from rdzv_server.waiters import Waiter, Wake

if TYPE_CHECKING:
    from rdzv_server.coordinator import Coordinator

# Holds: together, the nodes of the server poll about this often per second ...
TARGET_POLL_RATE = 500.0
MAX_HOLD_S = 30.0           # ... but a poll is held no longer than this (the agent asks for up to 60 s)

# Sends a poll's reply straight to its connection; False: it could not (web/direct_reply.py).
Reply = Callable[[NodeStatus], bool]


def hold_base(node_count: int, status: NodeStatus) -> float:
    """The longest hold now (what replies tell agents: poll_hold_s)."""
    return min(max(node_count / TARGET_POLL_RATE, status.lease_timeout_s / 2), MAX_HOLD_S)


def hold_for(node_count: int, status: NodeStatus, wait_s: float) -> float:
    """How long to hold a poll: long enough that all nodes together poll about TARGET_POLL_RATE
    times a second (at least half a lease, at most MAX_HOLD_S), jittered so polls do not come in
    waves, and never longer than the agent asked."""
    return min(wait_s, hold_base(node_count, status) * random.uniform(0.8, 1.0))


async def long_poll(coord: Coordinator, job_id: str, req: PollRequest, peer: str = "",
                    silence: AckAge | None = None, reply: Reply | None = None, waited_s: float = 0.0) -> NodeStatus:
    """Answer when this node's view changes or its hold ends; meanwhile the open poll is its lease.
    With `reply`, a change is answered during the wake itself; the task then only catches up.
    The hold counts from the poll's arrival, `waited_s` before now: the agent expects its answer
    within the hold it was told of its sending (path_check.answer_due: the hold + 1 s), and a poll
    handled late by a busy server, held its full hold after, was given up by its agent and sent
    again, its closed connection taken for a dead node (tens of nodes in a 10,000-node run)."""
    node = (job_id, req.node_id)
    coord.polls_by_peer.take(peer, peer or "one peer")
    try:
        coord.polls_by_node.take(node, quote(req.node_id))
    except RendezvousError:
        coord.polls_by_peer.give_back(peer)
        raise
    try:
        status = coord.call(lambda now: coord.core.hold_poll(job_id, req, now))
    except BaseException:
        coord.polls_by_peer.give_back(peer)
        coord.polls_by_node.give_back(node)
        raise
    loop = asyncio.get_running_loop()
    ends = loop.time() + max(0.0, hold_for(coord.core.node_count, status, req.wait_s) - waited_s)
    coord.open_polls += 1
    if silence is not None:
        coord.held_links.add(silence)
    dropped, sent = False, False
    answer = functools.partial(answer_early, coord, job_id, req, reply)
    try:
        while not poll_ready(status, req.known_round) and coord.gate.serving() and loop.time() < ends:
            waiter = Waiter(job_id, ends, answer=answer)
            coord.waiters.add(waiter)
            try:
                await waiter.fut
            finally:
                coord.waiters.discard(waiter)
                sent = waiter.sent
            if sent or job_id not in coord.core.jobs:
                break
            status = coord.core.view(job_id, req.node_id, coord.clock())
            if waiter.ended:
                break
    except asyncio.CancelledError:
        # The agent's connection closed mid-poll: likely dead. Give it a short grace. Closed by
        # its host (a FIN or RST just in) rather than by a keepalive giving up: evidence (leases.py).
        # (Closed after its answer went out: an ordinary end, below.)
        dropped = not sent
        if dropped and not coord.gate.shutting_down:
            age = silence() if silence is not None else None
            coord.core.connection_dropped(job_id, req.node_id, coord.clock(),
                                         heard=age is not None and age < CLOSE_HEARD_S)
            coord._apply()
        raise
    finally:
        coord.open_polls -= 1
        if silence is not None:
            coord.held_links.discard(silence)
        coord.polls_by_peer.give_back(peer)
        coord.polls_by_node.give_back(node)
        if not dropped:
            now = coord.clock()
            age = silence() if silence is not None else None
            coord.core.poll_ended(job_id, req.node_id, now, now - (age or 0.0))
            coord._apply()
    if sent:
        return status       # the view before the wake: its reply, the newer one, went out already
    if not coord.gate.serving():
        raise coord.gate.not_serving()
    await coord._durable(job_id)
    return status


def answer_early(coord: Coordinator, job_id: str, req: PollRequest, reply: Reply | None) -> Wake:
    """What a change of its job means for a held poll, decided without its task: nothing new
    (UNCHANGED), or its reply sent now through `reply` (SENT: what the task would send, once
    saved), or its task must look again (LOOK: not serving, the job gone, a change not yet saved,
    or no `reply` to send through)."""
    job = coord.core.jobs.get(job_id)
    if job is None or not coord.gate.serving():
        return Wake.LOOK
    status = node_status(job, req.node_id, coord.clock())     # core.view's own, without its lookups
    if not poll_ready(status, req.known_round):
        return Wake.UNCHANGED
    if reply is None or coord.persister.pending(job_id) or not reply(coord.with_hold(status)):
        return Wake.LOOK
    return Wake.SENT
