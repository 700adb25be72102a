"""A long-poll: a subscriber that is answered once, when its node's view changes or its hold ends.

While held, the open poll is the node's lease. Woken by news, it is answered in the hub's pass through
`Reply`; its task then only catches up. The hold counts from the poll's arrival (`waited_s`): an agent
takes a late answer for a lost server (path_check.answer_due) and sends again, and its closed connection
would look like a dead node.
"""
from __future__ import annotations

import asyncio

from protocol.messages import NodeStatus, PollRequest, poll_ready
from rdzv_server.delivery.connection import Connection, HangUp, Reply
from rdzv_server.delivery.holds import hold_for
from rdzv_server.delivery.hub import Hub
from rdzv_server.delivery.subscriber import AckAge, Subscriber


class LongPoll(Subscriber):
    __slots__ = ("_hang_up", "_reply", "_woken", "ended", "sent")

    def __init__(self, job_id: str, req: PollRequest, ack_age: AckAge | None, reply: Reply | None,
                 hang_up: HangUp | None = None) -> None:
        super().__init__(job_id, req.node_id, req.known_round, ack_age, req.holding)
        self._reply = reply
        self._hang_up = hang_up
        self._woken: asyncio.Future[None] | None = None
        self.ended = False        # its hold ran out
        self.sent = False         # its reply went out during a pass

    def woken(self) -> asyncio.Future[None]:
        """Done when the hub next pushes to or closes this poll."""
        self._woken = asyncio.get_running_loop().create_future()
        return self._woken

    def push(self, view: NodeStatus) -> bool:
        if self._reply is None or not self._reply(view):
            return False
        self.sent = True
        self._wake()
        return True

    def close(self, *, ended: bool, hang_up: bool = False) -> None:
        self.ended = self.ended or ended
        if hang_up and self._hang_up is not None:
            self._hang_up()
        self._wake()

    def _wake(self) -> None:
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)


async def long_poll(hub: Hub, job_id: str, req: PollRequest, conn: Connection) -> NodeStatus:
    """The node's view once it is news (or the hold ended), saved; meanwhile the open poll is its lease."""
    d = hub.driver
    peer = conn.peer
    sub = LongPoll(job_id, req, conn.ack_age, conn.reply, conn.hang_up)
    sub.peer_closed = conn.peer_closed
    status = hub.attach(sub, req, peer)
    loop = asyncio.get_running_loop()
    sub.ends = loop.time() + max(0.0, hold_for(d.core.node_count, status, req.wait_s) - conn.waited_s)
    dropped = False
    try:
        while not poll_ready(status, req.known_round, req.holding) and d.gate.serving() and loop.time() < sub.ends:
            woken = sub.woken()
            hub.wait(sub)
            await woken
            if sub.sent or job_id not in d.core.jobs:
                break
            status = d.core.view(job_id, req.node_id, d.clock())
            if sub.ended:
                break
    except asyncio.CancelledError:
        dropped = not sub.sent        # the agent's connection closed mid-poll (after its answer: an ordinary end)
        raise
    finally:
        # The node's host closed the connection before its answer (its agent killed while the loop ran late, a
        # hold ending then): a drop, not an answer that renews its lease
        dropped = dropped or (sub.peer_closed is not None and sub.peer_closed())
        hub.detach(sub, peer, dropped=dropped)
    if sub.sent:
        return status                 # the view before the pass: its reply, the newer one, went out already
    if not d.gate.serving():
        raise d.gate.not_serving()
    await d.durable(job_id)
    return status
