"""The asyncio machinery around the pure rendezvous core (no HTTP here).

After every core call the shell drains the core's outbox once (`apply`) and hands each effect to
its consumer: new events to the log and the listeners (metrics), changed jobs to the store, woken
jobs, once saved, to the delivery hub (delivery/), which answers the nodes waiting for news, so
agents learn of a new round the moment it is decided. One background task sleeps until the core's
next deadline and ticks it; it is re-armed only when a call sets a deadline earlier than the one it
sleeps to.
Both the aiohttp app and `node-agent --standalone` (in-process, no HTTP) drive this class.

The clock is wall time (`time.time`), not monotonic: lease expiries and last-call/join deadlines
are saved with the job and must still mean the same after a restart, possibly on another machine
once the store is shared, while a monotonic clock starts again at every boot. A wall-clock step is
absorbed like an outage (leases are re-armed on restore). The agent, which saves nothing, uses
monotonic time.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from protocol.errors import ErrorCode
from protocol.messages import (
    AgentRequest,
    FailureReport,
    JoinRequest,
    LeaveRequest,
    NodeStatus,
    PollRequest,
    SuccessReport,
)
from protocol.views import HostHold
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.operator_rules import OperatorAction
from rdzv_server.core.outbox import Outbox
from rdzv_server.core.records import JobRecord
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.delivery.caps import MAX_POLLS_PER_NODE, MAX_POLLS_PER_PEER
from rdzv_server.delivery.holds import hold_base
from rdzv_server.delivery.hub import Hub
from rdzv_server.delivery.long_poll import Reply, long_poll
from rdzv_server.delivery.subscriber import AckAge
from rdzv_server.serving import Serving
from rdzv_server.store.api import Store
from rdzv_server.store.persistence import Durability, NotDurable, Persister, StoreUnavailable

log = logging.getLogger("rdzv_server")

TICK_GAP_S = 0.05           # deadlines are handled at most this often (each tick walks every node)

class LagSource(Protocol):
    """How far behind the event loop runs (looplag.LoopLagProbe in the server; nothing in --standalone)."""

    def start(self) -> None: ...
    async def stop(self) -> None: ...
    def recent_s(self) -> float: ...
    def note_waited(self, waited_s: float) -> None: ...
    def summary(self) -> str: ...

    @property
    def max_s(self) -> float: ...


class Coordinator:
    """Owns the core and drives it: the outbox fan-out, durability, the deadline timer; the delivery hub."""

    def __init__(self, core: Rendezvous | None = None, clock: Callable[[], float] = time.time,
                 store: Store | None = None, max_polls_per_peer: int = MAX_POLLS_PER_PEER,
                 loop_lag: LagSource | None = None, max_polls_per_node: int = MAX_POLLS_PER_NODE) -> None:
        """`store`: the durable store (already opened); None keeps state in memory only and builds no
        commit machinery. `loop_lag`: the server's event-loop lag probe (leases wait out the server's
        own stalls); None: no probe (an in-process coordinator)."""
        self.core = core or Rendezvous()
        self.clock = clock
        self.store = store
        self.persister: Durability = self._durability()
        self.loop_lag = loop_lag
        self.gate = Serving()
        self.hub = Hub(self, max_per_peer=max_polls_per_peer, max_per_node=max_polls_per_node)
        self._deliveries: set[asyncio.Task[None]] = set()
        self._armed: float | None = None          # the deadline the timer sleeps to (None: none)
        self._rearm: asyncio.Event | None = None
        self.timer_wakeups = 0                    # times the deadline task woke (re-armed or due)
        self._timer: asyncio.Task[None] | None = None
        # Each gets every drained outbox, after logging (metrics hook here). A listener must not raise.
        self.effect_listeners: list[Callable[[Outbox], None]] = []

    def _durability(self) -> Durability:
        if self.store is None:
            return NotDurable()
        return Persister(self.store, self.clock, on_rollback=self._put_back)

    @property
    def started(self) -> bool:
        return self.gate.started

    @property
    def shutting_down(self) -> bool:
        return self.gate.shutting_down

    def serving(self) -> bool:
        return self.gate.serving()

    # -- lifecycle --
    async def start(self, *, take_over: bool = True) -> None:
        """Start the machinery; `take_over`: load the saved state and serve it now (a replica
        standing by waits for the election to call `take_over`)."""
        if self.loop_lag is not None:
            self.loop_lag.start()
        self._rearm = asyncio.Event()
        self._timer = asyncio.create_task(self._deadline_loop(), name="rdzv-deadlines")
        if take_over:
            await self.take_over()

    async def take_over(self) -> None:
        """Load the saved state and serve it, at start-up or when elected: a takeover is handled
        exactly like a restart (every lease re-armed, nobody blamed for the time away)."""
        if isinstance(self.persister, Persister):
            started = time.perf_counter()
            loaded = await self.persister.load()
            held = self.core.unhealthy        # the hosts held out survive taking over (memory only)
            self.core = Rendezvous({**self.core.jobs, **loaded.jobs}, limits=self.core.limits)
            self.core.unhealthy = held
            if loaded.alive_at is not None:
                now = self.clock()
                self.core.restored(now, max(0.0, now - loaded.alive_at), loaded.clean_shutdown)
            log.info("%s: %d job(s) restored in %.0f ms", self.persister.store.where, len(loaded.jobs),
                     (time.perf_counter() - started) * 1000)
        self.persister.start()
        changed = list(self.core.outbox.changed)
        self.apply()
        for job_id in changed:
            await self.durable(job_id)
        self.gate.start()

    async def step_down(self) -> None:
        """This replica no longer leads: held polls answer `not_leader`, commits in flight are
        refused, the state is dropped (the next leader loads it from the store)."""
        if not self.gate.started:
            return
        self.gate.stop()
        self.hub.wake_all()
        old, self.persister = self.persister, self._durability()
        await old.abandon()
        self.core = Rendezvous(limits=self.core.limits)
        self.clock_moved()

    def release_polls(self) -> None:
        """Answer every open long-poll now (with "going away"): the server is stopping."""
        self.gate.shutting_down = True
        self.hub.wake_all()

    async def stop(self) -> None:
        # Wake the timer and let it see the flag: on Python 3.11, wait_for can swallow a cancel
        # that arrives as its event fires, so cancelling alone may leave the loop running.
        self.release_polls()
        if self._timer is not None:
            assert self._rearm is not None
            self._rearm.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._timer), 1.0)
            except asyncio.TimeoutError:
                self._timer.cancel()
                await asyncio.gather(self._timer, return_exceptions=True)
        await self.persister.close()
        lag = ""
        if self.loop_lag is not None:
            await self.loop_lag.stop()
            lag = self.loop_lag.summary()
        st = self.persister.stats
        if st.commits:
            log.info("state store: %d commits of %d job snapshots, mean %.1f ms, max %.1f ms; %s", st.commits,
                     st.jobs_written, st.total_s / st.commits * 1000, st.max_s * 1000, lag)
        elif lag:
            log.info("%s", lag)

    # -- change propagation --
    def apply(self) -> None:
        """After any core call: drain its outbox once and hand each effect to its consumer."""
        effects = self.core.take_effects()
        for job, ev in effects.events:
            log.info("%s", ev.message, extra={"job_id": job.job_id, "event": ev.kind.value, "node_id": ev.node_id,
                                              "round_id": ev.round_id})
        for listener in self.effect_listeners:
            listener(effects)
        self.persister.note(effects)
        for job_id in effects.woken:
            self._deliver(job_id)
        if effects.earliest is not None and (self._armed is None or effects.earliest < self._armed):
            self._armed = effects.earliest
            if self._rearm is not None:
                self._rearm.set()

    def _put_back(self, job_id: str, job: JobRecord | None) -> None:
        """A refused commit's job, as last committed (None: never saved), replaces the one in memory."""
        self.core.put_back(job_id, job, self.clock())
        self.apply()
        self.hub.wake(job_id)
        log.warning("job's unsaved change refused: back to its last saved state", extra={"job_id": job_id})

    def clock_moved(self) -> None:
        """The clock jumped (a test's manual clock, an operator setting the time): the deadline
        timer sleeps in loop time, so it measures again from the clock's new reading."""
        self._armed = None
        if self._rearm is not None:
            self._rearm.set()

    def _deliver(self, job_id: str) -> None:
        """Wake the nodes waiting for news of `job_id`, once what they will see is saved (one wait for all)."""
        if not self.persister.pending(job_id):
            self.hub.wake(job_id)
            return
        task = asyncio.get_running_loop().create_task(self._deliver_saved(job_id))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver_saved(self, job_id: str) -> None:
        try:
            await self.persister.durable(job_id)
        except StoreUnavailable:
            pass                    # each poll then waits for the commit itself and answers the error
        self.hub.wake(job_id)

    async def _deadline_loop(self) -> None:
        """Sleep to the core's next deadline and tick there: every deadline passed by then is handled
        by that tick, and ticks come at most every TICK_GAP_S (a decision up to that much late). A
        tick and the search for the next deadline each walk every node of every job, and deadlines
        can come thousands a second: after a blip, 10,000 nodes' leases, held back while the server
        ran behind, each ran out on its own (a tick per lease, a walk over 10,000 nodes each, a
        tenth of the server's time). Woken because an effect brought a deadline forward (`apply`),
        the timer already holds it in `_armed`: the nodes are walked again only after a tick."""
        assert self._rearm is not None
        loop = asyncio.get_running_loop()
        look_again, ticked = True, -TICK_GAP_S
        while True:
            if self.gate.shutting_down:
                break
            if look_again or self._armed is None:
                self._armed = self.core.next_deadline()
            deadline = self._armed
            timeout = None if deadline is None else \
                max(0.0, deadline - self.clock(), ticked + TICK_GAP_S - loop.time())
            try:
                await asyncio.wait_for(self._rearm.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._rearm.clear()
            self.timer_wakeups += 1
            look_again = False
            if not self.gate.shutting_down and self._armed is not None and self._armed <= self.clock() \
                    and loop.time() >= ticked + TICK_GAP_S:
                ticked = loop.time()
                self.hub.before_tick(self.clock())
                self.core.tick(self.clock(), self.loop_lag.recent_s() if self.loop_lag is not None else 0.0)
                self.apply()
                look_again = True

    # -- requests --
    async def handle(self, job_id: str, req: AgentRequest, peer: str = "", local: str = "",
                     silence: AckAge | None = None, reply: Reply | None = None,
                     waited_s: float = 0.0) -> NodeStatus:
        """One agent request, by its type; `peer` is the address it came from, `local` the server's
        address it reached, `silence()` how long ago its connection's kernel last heard the node
        (connections.ack_age_s; None: unknown); `reply`: a poll's answer may be sent through it
        during a wake, before its task resumes (web/direct_reply.py); `waited_s`: how long the
        request waited for the server since it arrived (the server is that far behind; a poll's
        hold counts from its arrival)."""
        if waited_s > 0 and self.loop_lag is not None:
            self.loop_lag.note_waited(waited_s)
        return self.with_hold(await self._handle(job_id, req, peer, local, silence, reply, waited_s))

    def with_hold(self, status: NodeStatus) -> NodeStatus:
        """`status` with the longest hold now (what replies tell agents: poll_hold_s)."""
        return msgspec.structs.replace(status, poll_hold_s=round(hold_base(self.core.node_count, status), 3))

    def saved(self, job_id: str) -> bool:
        return not self.persister.pending(job_id)

    async def _handle(self, job_id: str, req: AgentRequest, peer: str, local: str,
                      silence: AckAge | None, reply: Reply | None, waited_s: float) -> NodeStatus:
        core = self.core
        match req:
            case PollRequest():
                return await long_poll(self.hub, job_id, req, peer, silence, reply, waited_s)
            case JoinRequest():
                # A fresh secret per join: the core keeps it only if the join makes a new node record.
                secret = secrets.token_urlsafe(24)
                status = self.call(lambda now: core.join(job_id, req, now, secret, (peer, local)))
            case FailureReport():
                status = self.call(lambda now: core.report_failure(job_id, req, now))
            case SuccessReport():
                status = self.call(lambda now: core.report_success(job_id, req, now))
            case LeaveRequest():
                status = self.call(lambda now: core.leave(job_id, req, now))
        await self.durable(job_id)
        return status

    async def operate(self, job_id: str, action: OperatorAction) -> JobRecord:
        """An operator action (core/operator_rules.py): close, drain, clear an exclusion, resize."""
        try:
            job = self.core.operate(job_id, action, self.clock())
        finally:
            self.apply()
        await self.durable(job_id)
        return job

    def clear_unhealthy(self, host: str) -> HostHold:
        """An operator lets a host held as unhealthy join again (core/unhealthy.py); the hold it ended."""
        return self.core.unhealthy.clear(host, self.clock()).view(self.clock())

    async def durable(self, job_id: str) -> None:
        """Wait until the job's state, as any reply would show it, is in the store."""
        try:
            await self.persister.durable(job_id)
        except StoreUnavailable as exc:
            raise RendezvousError(ErrorCode.STORE_UNAVAILABLE, f"{exc}; retry shortly") from None

    def call(self, fn: Callable[[float], NodeStatus]) -> NodeStatus:
        """One core call, with `now`; its effects are applied whether it succeeds or raises."""
        try:
            return fn(self.clock())
        finally:
            self.apply()
