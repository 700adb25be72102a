"""The asyncio machinery around the pure rendezvous core (no HTTP here).

Long-polls wait on a per-job asyncio.Event that is set (and replaced) whenever the job's epoch
moves, so agents learn of a new round the moment it is decided. One background task sleeps until
the core's next deadline and ticks it; any request that may bring a deadline closer re-arms it.
Both the aiohttp app and `node-agent --standalone` (in-process, no HTTP) drive this class.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from protocol.errors import ErrorCode
from protocol.messages import NodeState, NodeStatus, PollRequest
from rdzv_server.looplag import LoopLagProbe
from rdzv_server.persistence import Persister, StoreUnavailable
from rdzv_server.records import Event, JobRecord
from rdzv_server.rendezvous import Rendezvous, RendezvousError
from rdzv_server.store import SqliteStore

log = logging.getLogger("rdzv_server")


class Coordinator:
    """Owns the core and the asyncio machinery around it (waiters, the deadline timer)."""

    def __init__(self, core: Rendezvous | None = None, clock: Callable[[], float] = time.time,
                 store: SqliteStore | None = None) -> None:
        """`store`: the durable store (already opened); None keeps state in memory only."""
        self.core = core or Rendezvous()
        self.clock = clock
        self.store = store
        self.persister = Persister(store, clock)
        self.loop_lag = LoopLagProbe()
        self.shutting_down = False
        self.open_polls = 0
        self._job_events: dict[str, asyncio.Event] = {}
        self._epochs: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}   # job id -> (created_at, last event seq seen)
        self._rearm: asyncio.Event | None = None
        self._timer: asyncio.Task | None = None
        # Called once per new event, after the core recorded it (metrics hook here).
        self.event_listeners: list[Callable[[JobRecord, Event], None]] = []

    # -- lifecycle --
    async def start(self) -> None:
        if self.store is not None:
            loaded = self.store.load()
            self.core.jobs.update(loaded.jobs)
            self.persister.adopt(loaded.jobs)
            for job in loaded.jobs.values():
                self._logged[job.job_id] = (job.created_at, job.event_seq)   # logged by the previous run
            if loaded.alive_at is not None:
                now = self.clock()
                self.core.restored(now, max(0.0, now - loaded.alive_at), loaded.clean_shutdown)
            log.info("state store %s: %d job(s) restored", self.store.path, len(loaded.jobs))
        self.persister.start()
        self.loop_lag.start()
        self._rearm = asyncio.Event()
        self._timer = asyncio.create_task(self._deadline_loop(), name="rdzv-deadlines")
        for job_id in self.core.jobs:
            self._after(job_id)
        for job_id in self.core.jobs:
            await self._durable(job_id)

    def release_polls(self) -> None:
        """Answer every open long-poll now (with "going away"): the server is stopping."""
        self.shutting_down = True
        for ev in list(self._job_events.values()):
            ev.set()

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
        await self.loop_lag.stop()
        st = self.persister.stats
        if st.commits:
            log.info("state store: %d commits of %d job snapshots, mean %.1f ms, max %.1f ms; %s", st.commits,
                     st.jobs_written, st.total_s / st.commits * 1000, st.max_s * 1000, self.loop_lag.summary())
        else:
            log.info("%s", self.loop_lag.summary())

    # -- change propagation --
    def _after(self, job_id: str) -> None:
        """After any core call on `job_id`: log new decisions, wake long-polls, re-arm the timer."""
        job = self.core.jobs.get(job_id)
        if job is None:
            return
        created, last = self._logged.get(job_id, (job.created_at, 0))
        if created != job.created_at:       # the id started a new run: its events count from 1 again
            last = 0
        for ev in job.events_after(last):
            log.info("%s", ev.message, extra={"job_id": job_id, "event": ev.kind, "node_id": ev.node_id,
                                              "round_id": ev.round_id})
            for listener in self.event_listeners:
                listener(job, ev)
        self._logged[job_id] = (job.created_at, job.event_seq)
        self.persister.note(job)
        if self._epochs.get(job_id) != job.epoch:
            self._epochs[job_id] = job.epoch
            old = self._job_events.pop(job_id, None)
            if old is not None:
                old.set()
        if self._rearm is not None:
            self._rearm.set()

    def job_event(self, job_id: str) -> asyncio.Event:
        ev = self._job_events.get(job_id)
        if ev is None:
            ev = self._job_events[job_id] = asyncio.Event()
        return ev

    async def _deadline_loop(self) -> None:
        assert self._rearm is not None
        while not self.shutting_down:
            deadline = self.core.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            try:
                await asyncio.wait_for(self._rearm.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._rearm.clear()
            if self.shutting_down:
                break
            for job_id in self.core.tick(self.clock()):
                self._after(job_id)

    # -- requests --
    async def handle(self, action: str, job_id: str, req: object) -> NodeStatus:
        """One agent request, by its action name (the route's last part)."""
        if action == "poll":
            return await self.long_poll(job_id, req)  # type: ignore[arg-type]
        core = self.core
        fn = {"join": core.join, "failure": core.report_failure, "success": core.report_success,
              "leave": core.leave}[action]
        status = self.call(job_id, fn, req)
        await self._durable(job_id)
        return status

    async def operate(self, action: str, job_id: str, *args: object) -> JobRecord:
        """An operator action (see operator_rules.py): close, drain, clear_exclusion or resize."""
        core = self.core
        fn = {"close": core.close_job, "drain": core.drain_node, "clear_exclusion": core.clear_exclusion,
              "resize": core.resize}[action]
        try:
            job = fn(job_id, *args, self.clock())  # type: ignore[operator]
        finally:
            self._after(job_id)
        await self._durable(job_id)
        return job

    async def _durable(self, job_id: str) -> None:
        """Wait until the job's state, as any reply would show it, is in the store."""
        try:
            await self.persister.durable(job_id)
        except StoreUnavailable as exc:
            raise RendezvousError(ErrorCode.STORE_UNAVAILABLE, f"{exc}; retry shortly") from None

    def call(self, job_id: str, fn: Callable[..., NodeStatus], req: object) -> NodeStatus:
        try:
            return fn(job_id, req, self.clock())
        finally:
            self._after(job_id)

    async def long_poll(self, job_id: str, req: PollRequest) -> NodeStatus:
        status = self.call(job_id, self.core.poll, req)
        wait = min(req.wait_s, status.lease_timeout_s / 2)
        deadline = self.clock() + wait
        self.open_polls += 1
        try:
            while not _poll_ready(status, req.known_round) and not self.shutting_down:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self.job_event(job_id).wait(), remaining)
                except asyncio.TimeoutError:
                    pass
                if job_id not in self.core.jobs:
                    break
                status = self.core.view(job_id, req.node_id, self.clock())
        except asyncio.CancelledError:
            # The agent's connection closed mid-poll: likely dead. Give it a short grace.
            if not self.shutting_down:
                self.core.connection_dropped(job_id, req.node_id, self.clock())
                self._after(job_id)
            raise
        finally:
            self.open_polls -= 1
        if self.shutting_down:
            raise RendezvousError(ErrorCode.SHUTTING_DOWN, "server is shutting down; retry shortly")
        await self._durable(job_id)
        return status


def _poll_ready(status: NodeStatus, known_round: int) -> bool:
    if status.job_state.finished or status.node_state == NodeState.GONE:
        return True
    if status.node_state == NodeState.MEMBER:
        return status.round_id != known_round
    return known_round != -1
