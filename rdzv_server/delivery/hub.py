"""The hub: every node waiting for news, and the one pass that tells them.
- A subscriber is attached once the core took its hold (`hold_poll`) and the caps let it in; it is
  detached once, telling the core how the hold ended: `poll_ended`, or `connection_dropped` (`heard`
  when a FIN or RST just came from the node's host, not a keepalive giving up).
- A woken job gets one pass: each view computed once, pushed only when it is news to that node and
  saved (a reply never shows what a restart would lose); one that cannot be answered in the pass (not
  serving, the job gone, unsaved) is closed so that its owner looks itself.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from protocol.messages import NodeStatus, PollRequest
from protocol.quoting import quote
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival
from rdzv_server.core.standing import node_status
from rdzv_server.delivery.caps import MAX_POLLS_PER_NODE, MAX_POLLS_PER_PEER, HeldPolls
from rdzv_server.delivery.give_way import WaitingOrder, tier
from rdzv_server.delivery.holds import HoldGrid, with_hold
from rdzv_server.delivery.links import CLOSE_HEARD_S, HeldLinks
from rdzv_server.delivery.subscriber import Subscriber
from rdzv_server.serving import Serving

log = logging.getLogger("rdzv_server")
T = TypeVar("T")


class Driver(Protocol):
    """What the hub needs of whoever drives the core (the coordinator)."""

    @property
    def core(self) -> Rendezvous: ...
    @property
    def gate(self) -> Serving: ...
    clock: Callable[[], float]

    def call(self, fn: Callable[[float], T]) -> T:
        """One core call, with `now`; its effects are handed on whether it succeeds or raises."""

    def lag_s(self) -> float:
        """How far behind the event loop has run lately, a stall still going on included."""

    async def durable(self, job_id: str) -> None:
        """Until the job, as any reply would show it now, is in the store (or a refusal: store unavailable)."""


GAVE_WAY_SAY_S = 60.0         # polls giving way are said at most this often
HELD = Arrival(hold=True)      # a poll the hub holds open: its connection is the lease meanwhile


class Hub:
    def __init__(self, driver: Driver, *, max_per_peer: int = MAX_POLLS_PER_PEER,
                 max_per_node: int = MAX_POLLS_PER_NODE) -> None:
        self.driver = driver
        self.per_peer = HeldPolls(max_per_peer, "--max-polls-per-peer", "the address")   # 0: no limit
        self.per_node = HeldPolls(max_per_node, "--max-polls-per-node", "node")
        self.links = HeldLinks()
        self.holds = HoldGrid(self._hold_ended, self._gone)
        self._by_job: dict[str, set[Subscriber]] = {}
        self._attached: set[Subscriber] = set()
        self._order = WaitingOrder()         # which waiting poll gives way first (give_way.py)
        self.gave_way = 0                    # polls answered early to let a newcomer in
        self._gave_way_said = -GAVE_WAY_SAY_S

    @property
    def open(self) -> int:
        """Subscribers attached now (held long-polls)."""
        return len(self._attached)

    def attach(self, sub: Subscriber, req: PollRequest, peer: str) -> NodeStatus:
        """Take the caps and the core's hold for `sub`; its view now. Raises with nothing held."""
        self.per_peer.take(peer, peer or "one peer")
        try:
            self.per_node.take(sub.key, quote(sub.node_id))
        except RendezvousError:
            self.per_peer.give_back(peer)
            raise
        d = self.driver
        try:
            status = d.call(lambda now: d.core.handle(sub.job_id, req, now, HELD))
        except BaseException:
            self.per_peer.give_back(peer)
            self.per_node.give_back(sub.key)
            raise
        self._attached.add(sub)
        if sub.ack_age is not None:
            self.links.add(sub.ack_age)
        return status

    def wait(self, sub: Subscriber) -> None:
        """`sub` waits for news until its hold ends (`sub.ends`)."""
        self._by_job.setdefault(sub.job_id, set()).add(sub)
        self.holds.add(sub.ends, sub)
        self._order.add(sub, tier(self.driver.core.jobs.get(sub.job_id), sub.node_id, self.per_node.held(sub.key)))

    def give_way(self) -> bool:
        """The server is at its connection limit with no idle connection to close: the waiting poll first in
        give_way.py's order is answered now, its connection closed after; False when none waits."""
        sub = self._order.first_to_give_way()
        if sub is None:
            return False
        self._unindex(sub)
        sub.close(ended=True, hang_up=True)
        self.gave_way += 1
        now = self.driver.clock()
        if now - self._gave_way_said >= GAVE_WAY_SAY_S:
            self._gave_way_said = now
            log.warning("at the connection limit with no idle connection: held long-polls are answered early to let "
                        "newcomers in (%d so far; %d held now); raise the server's open-file limit (LimitNOFILE), "
                        "or see which job holds polls of nodes that run nothing", self.gave_way, self.open)
        return True

    def detach(self, sub: Subscriber, peer: str, *, dropped: bool) -> None:
        """`sub` is done: answered or its hold over, or `dropped` (its connection closed under it)."""
        self._unindex(sub)
        self._attached.discard(sub)
        if sub.ack_age is not None:
            self.links.discard(sub.ack_age)
        self.per_peer.give_back(peer)
        self.per_node.give_back(sub.key)
        d = self.driver
        age = sub.ack_age() if sub.ack_age is not None else None
        if dropped and not d.gate.shutting_down and not sub.drop_told:
            # A FIN that came in while the loop stalled is as old as the stall: still the host's close.
            heard = age is not None and age < CLOSE_HEARD_S + d.lag_s()
            d.call(lambda now: d.core.connection_dropped(sub.job_id, sub.node_id, now, heard=heard))
        elif not dropped:
            d.call(lambda now: d.core.poll_ended(sub.job_id, sub.node_id, now, now - (age or 0.0)))

    def closed_unread(self, job_id: str) -> list[str]:
        """The job's nodes whose held poll's connection their host closed, its FIN not yet read by the loop (a
        member's agent killed as a stall or a burst of requests kept the loop from it)."""
        closed = [s for s in self._by_job.get(job_id, ()) if s.peer_closed is not None and s.peer_closed()]
        for sub in closed:
            sub.drop_told = True         # told once: its detach later must not touch a record made since
        return sorted({s.node_id for s in closed})

    def _unindex(self, sub: Subscriber) -> None:
        self._order.discard(sub)
        subs = self._by_job.get(sub.job_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._by_job[sub.job_id]

    def wake(self, job_id: str, *, saved: bool) -> None:
        """The job changed: one pass over its subscribers; `saved`: the job, as any reply would show it now, is in
        the store (else none is answered in the pass: a reply never shows what a restart would lose)."""
        subs = self._by_job.get(job_id)
        if not subs:
            return
        d = self.driver
        job = d.core.jobs.get(job_id)
        if job is None or not d.gate.serving():
            self._close_all(list(subs))
            return
        now = d.clock()
        for sub in list(subs):
            view = node_status(job, sub.node_id, now)       # core.view's own, without its lookups per node
            if not sub.wants(view):
                continue
            self._unindex(sub)
            if not (saved and self._push(sub, with_hold(d.core.node_count, view))):
                sub.close(ended=False)

    @staticmethod
    def _push(sub: Subscriber, view: NodeStatus) -> bool:
        try:
            return sub.push(view)
        except Exception:        # a bug in a writer: the subscriber's owner answers (or fails) on its own path
            log.exception("pushing a view to %s failed", quote(sub.node_id))
            return False

    def wake_all(self) -> None:
        """Every subscriber looks again (the server stops serving, or steps down)."""
        for subs in list(self._by_job.values()):
            self._close_all(list(subs))

    def _close_all(self, subs: list[Subscriber]) -> None:
        for sub in subs:
            self._unindex(sub)
            sub.close(ended=False)

    def _hold_ended(self, entry: object) -> None:
        assert isinstance(entry, Subscriber)
        self._unindex(entry)
        entry.close(ended=True)

    def _gone(self, entry: object) -> bool:
        assert isinstance(entry, Subscriber)
        subs = self._by_job.get(entry.job_id)
        return subs is None or entry not in subs
