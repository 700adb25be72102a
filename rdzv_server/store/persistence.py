"""Group commit between the event loop and the durable store.

Rule: a reply that depends on a change is sent only after it is committed (`note` the core's effects, then `await
durable(job_id)`). One writer task encodes dirty jobs on the loop (snapshots.py) and commits each batch in one
transaction on one worker thread, so the loop keeps serving and changes share an fsync (changes made during a
commit ride the next). A failed commit refuses its waiting replies with `StoreUnavailable` and puts each job back
as last committed (`on_rollback`); a job that cannot be encoded (a bug) likewise, alone. Lease renewals alone are
not written (re-armed at restart).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rdzv_server.core.outbox import Outbox
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, Event, JobRecord
from rdzv_server.store.api import Loaded, Store
from rdzv_server.store.snapshots import JobSnapshot, snapshot

log = logging.getLogger("rdzv_server")

ALIVE_EVERY_S = 2.0      # an idle server still marks itself alive this often (dates an outage)
RETRY_AFTER_S = 0.5      # pause before reading back jobs when the store failed even that

Rollback = Callable[[str, "JobRecord | None"], None]


class StoreUnavailable(Exception):
    """A commit failed: the change was refused and the job put back as last committed."""


@dataclass
class CommitStats:
    commits: int = 0
    jobs_written: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    failures: int = 0


class Persister:
    def __init__(self, store: Store, clock: Callable[[], float] = time.time,
                 on_rollback: Rollback | None = None) -> None:
        self.store = store
        self.clock = clock
        self.on_rollback = on_rollback
        self.stats = CommitStats()
        self._dirty: dict[str, JobRecord] = {}
        self._events: dict[str, list[Event]] = {}          # job -> events not yet committed
        self._nodes: dict[str, set[str]] = {}              # job -> nodes whose rows are not yet committed
        self._reset: set[str] = set()                      # jobs whose old rows go first (a new run)
        self._deleted: set[str] = set()                    # forgotten jobs to delete
        self._next: dict[str, asyncio.Future[None]] = {}   # job -> the commit that will carry its change
        self._inflight: dict[str, asyncio.Future[None]] = {}   # job -> the commit carrying it now
        self._writer: asyncio.Task[None] | None = None
        self._alive: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rdzv-store")

    def start(self) -> None:
        self._alive = asyncio.create_task(self._alive_loop(), name="rdzv-store-alive")

    async def load(self) -> Loaded:
        """Everything saved, read on the store's thread (at start-up or takeover)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.store.load)

    def note(self, effects: Outbox) -> None:
        """Schedule what the core changed (`effects`, drained from it) for the next commit."""
        if not (effects.changed or effects.pruned):
            return
        for job_id in effects.pruned:
            self._deleted.add(job_id)
            self._forget(job_id)
        for job_id in effects.new_runs:
            self._deleted.discard(job_id)
            self._reset.add(job_id)
            self._events.pop(job_id, None)
            self._nodes.pop(job_id, None)       # the old run's rows go; the new run marks its own
        for job, event in effects.events:
            pending = self._events.setdefault(job.job_id, [])
            pending.append(event)
            if len(pending) > MAX_EVENTS_PER_JOB:     # older ones would be pruned on disk anyway
                del pending[: len(pending) - MAX_EVENTS_PER_JOB]
        for job_id, node_ids in effects.nodes.items():
            self._nodes.setdefault(job_id, set()).update(node_ids)
        loop = asyncio.get_running_loop()
        for job_id, job in effects.changed.items():
            self._dirty[job_id] = job
            if job_id not in self._next:
                fut = self._next[job_id] = loop.create_future()
                fut.add_done_callback(_consume)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_loop(), name="rdzv-store-writer")

    def pending(self, job_id: str) -> bool:
        """Whether a change of `job_id` is noted but not yet committed."""
        return job_id in self._next or job_id in self._inflight

    async def durable(self, job_id: str) -> None:
        """Return once every change noted so far for `job_id` is committed (or raise StoreUnavailable)."""
        fut = self._next.get(job_id) or self._inflight.get(job_id)
        if fut is not None:
            await asyncio.shield(fut)

    def _forget(self, job_id: str) -> None:
        self._dirty.pop(job_id, None)
        self._events.pop(job_id, None)
        self._nodes.pop(job_id, None)
        self._reset.discard(job_id)

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._dirty or self._deleted:
            jobs, futs = self._dirty, self._next
            events, nodes, resets, deleted = self._events, self._nodes, self._reset, self._deleted
            self._dirty, self._next, self._events, self._nodes = {}, {}, {}, {}
            self._reset, self._deleted = set(), set()
            self._inflight.update(futs)
            snaps: list[JobSnapshot] = []
            broken: list[str] = []
            for job_id, job in jobs.items():
                try:
                    snaps.append(snapshot(job, nodes.get(job_id, ()), events.get(job_id, []), reset=job_id in resets))
                except Exception:    # a bug: this job's change is refused; the others are committed
                    log.exception("cannot encode job %r for the state store", job_id)
                    broken.append(job_id)
            started = time.perf_counter()
            try:
                await loop.run_in_executor(self._executor, self.store.write, snaps, self.clock(), deleted)
            except Exception as exc:
                self.stats.failures += 1
                why = self.store.describe_failure(exc)
                log.error("state store commit failed: %s; %d job(s) put back as last committed and their "
                          "requests refused", why, len(jobs))
                self._deleted |= deleted - set(self._dirty)
                await self._roll_back(list(jobs), futs, f"state store commit failed: {why}")
            else:
                took = time.perf_counter() - started
                self.stats.commits += 1
                self.stats.jobs_written += len(snaps)
                self.stats.total_s += took
                self.stats.max_s = max(self.stats.max_s, took)
                for job_id, fut in futs.items():
                    if job_id not in broken:
                        fut.set_result(None)
                if broken:
                    await self._roll_back(broken, futs, "the server could not save this change (a bug; see its log)")
            finally:
                for job_id, fut in futs.items():
                    if self._inflight.get(job_id) is fut:
                        del self._inflight[job_id]

    async def _roll_back(self, job_ids: list[str], futs: dict[str, asyncio.Future[None]], why: str) -> None:
        """Put `job_ids` back as last committed, then refuse the replies waiting on them (a refusal means the change
        is already gone), and those noted meanwhile: they were built on the refused ones."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                saved = await loop.run_in_executor(self._executor, lambda: {j: self.store.load_job(j) for j in job_ids})
                break
            except Exception as exc:     # the store cannot even be read: keep trying, the state is held
                log.error("state store cannot be read back (%s); retrying", exc)
                await asyncio.sleep(RETRY_AFTER_S)   # a retry pause, not a synchronisation wait
        error = StoreUnavailable(why)
        for job_id in job_ids:
            if self.on_rollback is not None:
                self.on_rollback(job_id, saved[job_id])
            for fut in (futs.get(job_id), self._next.pop(job_id, None)):
                if fut is not None and not fut.done():
                    fut.set_exception(error)
            self._forget(job_id)

    async def _alive_loop(self) -> None:
        loop = asyncio.get_running_loop()
        failing = ""          # the failure last said: a full disk is said once, not every ALIVE_EVERY_S
        while True:
            await asyncio.sleep(ALIVE_EVERY_S)     # a periodic mark, not a synchronisation wait
            if self._writer is None or self._writer.done():
                try:
                    await loop.run_in_executor(self._executor, self.store.write, [], self.clock())
                except Exception as exc:
                    why = self.store.describe_failure(exc)
                    if why != failing:
                        log.error("state store liveness mark failed: %s (said again only once it changes; "
                                  "the server keeps serving, changes are refused until it can write)", why)
                    failing = why
                else:
                    if failing:
                        log.info("state store written again: its liveness mark succeeded")
                    failing = ""

    async def close(self) -> None:
        """Flush what is pending, mark a clean shutdown, release the store."""
        if self._alive is not None:
            self._alive.cancel()
            await asyncio.gather(self._alive, return_exceptions=True)
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close_store, not self._dirty)
        self._executor.shutdown(wait=True)

    async def abandon(self) -> None:
        """This replica stopped leading: refuse every waiting reply, stop writing, and wait for the store's thread
        (its commit is fenced: refused for a deposed leader); the store stays open for a later term."""
        error = StoreUnavailable("this replica stopped leading before the change was committed")
        waiting = [*self._next.values(), *self._inflight.values()]     # the writer forgets its own on cancel
        for task in (self._alive, self._writer):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._alive, self._writer) if t is not None), return_exceptions=True)
        for fut in [*waiting, *self._next.values()]:
            if not fut.done():
                fut.set_exception(error)
        self._next.clear()
        self._inflight.clear()
        self._dirty.clear()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    def _close_store(self, clean: bool) -> None:
        if clean:
            self.store.close(self.clock())
        else:
            log.error("stopping with %d job(s) not written to the state store", len(self._dirty))
            self.store.release()


def _consume(fut: asyncio.Future[None]) -> None:
    """A commit nobody awaited may fail: its error is logged, not 'never retrieved'."""
    if not fut.cancelled():
        fut.exception()


class NotDurable:
    """State in memory only (`--state-dir none`, in-process): durable when made, so no reply waits on a commit."""

    def __init__(self) -> None:
        self.stats = CommitStats()

    def start(self) -> None:
        pass

    def note(self, effects: Outbox) -> None:
        pass

    def pending(self, job_id: str) -> bool:
        return False

    async def durable(self, job_id: str) -> None:
        pass

    async def close(self) -> None:
        pass

    async def abandon(self) -> None:
        pass


Durability = Persister | NotDurable
