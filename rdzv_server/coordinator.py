"""The asyncio machinery around the pure rendezvous core (no HTTP here), driven by the app and by
`node-agent --standalone`. After every core call the outbox is drained once (`apply`): events to the
log and listeners, changed jobs to the store, woken jobs, once saved, to the delivery hub, which
answers the waiting nodes at once. One task sleeps to the core's next deadline and ticks it.
The clock is wall time: deadlines are saved with the job and must mean the same after a restart,
possibly on another machine (a monotonic clock restarts at every boot); a clock step is like an outage.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from protocol.errors import ErrorCode
from protocol.messages import AgentRequest, FailureReport, JoinRequest, NodeStatus, PollRequest
from protocol.views import HostHold
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.leases import DOUBT_QUIET_S, QUIET_S
from rdzv_server.core.operator_rules import OperatorAction
from rdzv_server.core.outbox import Outbox
from rdzv_server.core.records import JobRecord
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.delivery.caps import MAX_POLLS_PER_NODE, MAX_POLLS_PER_PEER
from rdzv_server.delivery.connection import IN_PROCESS, Connection
from rdzv_server.delivery.holds import with_hold
from rdzv_server.delivery.hub import Hub
from rdzv_server.delivery.long_poll import long_poll
from rdzv_server.logs import EVENT_LINES, EVENT_WINDOW_S, EventLines
from rdzv_server.refused_joins import RefusedJoins
from rdzv_server.serving import Serving
from rdzv_server.store.api import Store, StoreError
from rdzv_server.store.persistence import Durability, NotDurable, Persister, StoreUnavailable

log = logging.getLogger("rdzv_server")

TICK_GAP_S = 0.05           # deadlines are handled at most this often (each tick walks every node)
# While polls are held, their connections are looked at least this often (links.check), so a quiet job's gaps
# between requests never read as a silence of the server's own (leases.doubted): keepalive ACKs fill them.
LINK_CHECK_S = 1.0
T = TypeVar("T")

class LagSource(Protocol):
    """How far behind the event loop runs (looplag.LoopLagMeter in the server; nothing in --standalone)."""

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
        """`store`: the durable store, opened (None: memory only); `loop_lag`: the lag meter (None: in-process)."""
        self.core = core or Rendezvous()
        self.clock = clock
        self.event_lines = EventLines()
        self.refused_joins = RefusedJoins()
        self.store = store
        self.persister: Durability = self._durability()
        self.loop_lag = loop_lag
        self.gate = Serving()
        self.hub = Hub(self, max_per_peer=max_polls_per_peer, max_per_node=max_polls_per_node)
        self._deliveries: set[asyncio.Task[None]] = set()
        self._armed: float | None = None          # the deadline the timer sleeps to (None: none)
        self._rearm: asyncio.Event | None = None
        self._outage: tuple[float, float] | None = None   # the server's own last outage (_outage_seen)
        self.timer_wakeups = 0                    # times the deadline task woke (re-armed or due): /metrics
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

    def serving(self) -> bool:
        return self.gate.serving()

    async def start(self, *, take_over: bool = True) -> None:
        """Start the machinery; `take_over`: serve the saved state now (a standby waits to be elected)."""
        if self.loop_lag is not None:
            self.loop_lag.start()
        self._rearm = asyncio.Event()
        self._timer = asyncio.create_task(self._deadline_loop(), name="rdzv-deadlines")
        if take_over:
            await self.take_over()

    async def take_over(self) -> None:
        """Load the saved state and serve it, exactly like a restart: leases re-armed, nobody blamed."""
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
            try:
                await self.persister.durable(job_id)
            except StoreUnavailable as exc:   # the restored jobs cannot be saved: say so, do not serve them
                raise StoreError(f"cannot save the restored jobs: {exc}; refusing to start") from None
        self.gate.start()

    async def step_down(self) -> None:
        """No longer the leader: held polls answer `not_leader`, commits in flight fail, the state is dropped."""
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

    def apply(self) -> None:
        """After any core call: drain its outbox once and hand each effect to its consumer."""
        effects = self.core.take_effects()
        for job, ev in effects.events:
            show, skipped = self.event_lines.admit(job.job_id, ev.kind.value, time.monotonic())
            if skipped:
                log.info("%d more %s events were not logged (past %d in %gs; the job's history has the latest)",
                         skipped, ev.kind.value, EVENT_LINES, EVENT_WINDOW_S, extra={"job_id": job.job_id})
            if show:
                log.info("%s", ev.message, extra={"job_id": job.job_id, "event": ev.kind.value,
                                                  "node_id": ev.node_id, "round_id": ev.round_id})
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
        self.hub.wake(job_id, saved=self.saved(job_id))
        log.warning("job's unsaved change refused: back to its last saved state", extra={"job_id": job_id})

    def clock_moved(self) -> None:
        """The clock jumped: the timer sleeps in loop time, so it measures again from the new reading."""
        self._armed = None
        if self._rearm is not None:
            self._rearm.set()

    def _deliver(self, job_id: str) -> None:
        """Wake the nodes waiting for news of `job_id`, once what they will see is saved (one wait for all)."""
        if self.saved(job_id):
            self.hub.wake(job_id, saved=True)
            return
        task = asyncio.get_running_loop().create_task(self._deliver_saved(job_id))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver_saved(self, job_id: str) -> None:
        with contextlib.suppress(StoreUnavailable):    # each poll then waits for the commit and answers the error
            await self.persister.durable(job_id)
        self.hub.wake(job_id, saved=self.saved(job_id))

    async def _deadline_loop(self) -> None:
        """Sleep to the core's next deadline and tick, at most every TICK_GAP_S (a decision that much late):
        each tick and each search for the next deadline walk every node, and deadlines can come thousands a
        second. `apply` puts an earlier deadline in `_armed`, so the nodes are walked again only after a tick."""
        assert self._rearm is not None
        loop = asyncio.get_running_loop()
        look_again, ticked = True, -TICK_GAP_S
        while not self.gate.shutting_down:
            if look_again or self._armed is None:
                self._armed = self.core.next_deadline()
            deadline = self._armed
            timeout = None if deadline is None else \
                max(0.0, deadline - self.clock(), ticked + TICK_GAP_S - loop.time())
            if self.hub.links:
                timeout = LINK_CHECK_S if timeout is None else min(timeout, LINK_CHECK_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._rearm.wait(), timeout)
            self._rearm.clear()
            self.timer_wakeups += 1
            look_again = False
            if not self.gate.shutting_down:
                self.hub.links.check(self.core, self.clock())    # what held connections say of the link
            if not self.gate.shutting_down and self._armed is not None and self._armed <= self.clock() \
                    and loop.time() >= ticked + TICK_GAP_S:
                ticked = loop.time()
                self.core.tick(self.clock(), self.lag_s())
                self.apply()
                look_again = True

    async def handle(self, job_id: str, req: AgentRequest, conn: Connection = IN_PROCESS) -> NodeStatus:
        """One agent request, of any kind, through the core's one entry (Rendezvous.handle); `conn`: what its
        connection tells (delivery/connection.py). A poll is held by the hub until news; the rest answer at once,
        once what the reply shows is saved."""
        if conn.waited_s > 0 and self.loop_lag is not None:
            self.loop_lag.note_waited(conn.waited_s)
        if isinstance(req, FailureReport):    # its peers may have died unheard in an outage just over
            conn = dataclasses.replace(conn, outage=self._outage_seen(self.clock()))
            # A member whose agent died closed its held poll: its FIN may be in, unread, as its peers' reports of
            # their broken collectives are read (a loop late by a stall, or the same wake-up): its loss first.
            closed = self.hub.closed_unread(job_id)
            if closed:
                self.call(lambda now: self._dropped(job_id, closed, now))
        if isinstance(req, PollRequest):
            return with_hold(self.core.node_count, await long_poll(self.hub, job_id, req, conn))
        if isinstance(req, JoinRequest):   # a fresh secret: the core keeps it only if the join makes a node record
            conn = dataclasses.replace(conn, secret=secrets.token_urlsafe(24))
        try:
            status = self.call(lambda now: self.core.handle(job_id, req, now, conn))
        except RendezvousError as exc:
            if isinstance(req, JoinRequest):
                self.refused_joins.note(job_id, req.node_id, conn.peer, exc.code, exc.message, self.clock())
            raise
        await self.durable(job_id)
        return with_hold(self.core.node_count, status)

    def saved(self, job_id: str) -> bool:
        return not self.persister.pending(job_id)

    async def operate(self, job_id: str, action: OperatorAction) -> JobRecord:
        """An operator action (core/operator_rules.py): close, drain, clear an exclusion, resize."""
        job = self.call(lambda now: self.core.operate(job_id, action, now))
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

    def _dropped(self, job_id: str, nodes: list[str], now: float) -> None:
        for node_id in nodes:
            self.core.connection_dropped(job_id, node_id, now, heard=True)

    def _outage_seen(self, now: float) -> tuple[float, float] | None:
        """The server's own last outage (Arrival.outage): its loop DOUBT_QUIET_S or more behind, or no agent heard
        for QUIET_S, requests and held connections' keepalive ACKs counted (looked at every LINK_CHECK_S)."""
        self.hub.links.check(self.core, now)
        self.core.heard(now)            # this request: a silence it ends is recorded (core.silence)
        lag, silence = self.lag_s(), self.core.silence
        if lag >= DOUBT_QUIET_S and (self._outage is None or now - lag > self._outage[1]):
            self._outage = (now - lag, now)      # a stall: the meter says so for RECENT_S, its end stays
        if silence is not None and silence[1] - silence[0] >= QUIET_S and \
                (self._outage is None or silence[1] > self._outage[1]):
            self._outage = silence
        return self._outage

    def lag_s(self) -> float:
        """How far behind the event loop has run lately (0.0 in-process: nothing measures it)."""
        return self.loop_lag.recent_s() if self.loop_lag is not None else 0.0

    def call(self, fn: Callable[[float], T]) -> T:
        """One core call, with `now`; its effects are applied whether it succeeds or raises."""
        try:
            return fn(self.clock())
        finally:
            self.apply()
