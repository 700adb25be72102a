"""Group commit between the event loop and the durable store.

Rule: a reply that depends on a change is sent only after that change is on disk. The shell hands
the core's effects to `note` (the jobs whose saved state changed, their new events, the ids that
started a new run) and then `await durable(job_id)`. One writer task takes every dirty job,
encodes a snapshot on the loop (fast, msgspec), and commits the whole batch in one SQLite
transaction on a single worker thread, so the loop keeps serving while the disk works and many
changes share one fsync. Changes made while a commit is in flight ride the next one.

Lease renewals alone are not written: after a restart all leases are re-armed. A failed commit
keeps the jobs dirty (retried after a pause) and fails the waiting replies with
`StoreUnavailable`; the state in memory is never rolled back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import Callable

from rdzv_server.outbox import Outbox
from rdzv_server.records import MAX_EVENTS_PER_JOB, Event, JobRecord
from rdzv_server.store import SqliteStore, snapshot

log = logging.getLogger("rdzv_server")

ALIVE_EVERY_S = 2.0      # an idle server still marks itself alive this often (dates an outage)
RETRY_AFTER_S = 0.5      # pause before retrying a failed commit


class StoreUnavailable(Exception):
    """A commit failed: the change is kept in memory and retried, but not yet durable."""


@dataclass
class CommitStats:
    commits: int = 0
    jobs_written: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    failures: int = 0


class Persister:
    def __init__(self, store: SqliteStore | None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self.stats = CommitStats()
        self._dirty: dict[str, JobRecord] = {}
        self._events: dict[str, list[Event]] = {}                  # job -> events not yet on disk
        self._reset: set[str] = set()                               # jobs whose old history goes first
        self._deleted: set[str] = set()                             # pruned jobs to delete
        self._next: asyncio.Future | None = None                 # the commit that will carry _dirty
        self._inflight: dict[str, asyncio.Future] = {}              # job -> commit now carrying it
        self._writer: asyncio.Task | None = None
        self._alive: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rdzv-store") if store else None
        self._closing = False

    def start(self) -> None:
        if self.store is not None:
            self._alive = asyncio.create_task(self._alive_loop(), name="rdzv-store-alive")

    def note(self, effects: Outbox) -> None:
        """Schedule what the core changed (`effects`, drained from it) for the next commit."""
        if self.store is None or not (effects.changed or effects.pruned):
            return
        for job_id in effects.pruned:
            self._deleted.add(job_id)
            self._dirty.pop(job_id, None)
            self._events.pop(job_id, None)
            self._reset.discard(job_id)
        for job_id in effects.new_runs:
            self._deleted.discard(job_id)
            self._reset.add(job_id)
            self._events.pop(job_id, None)
        for job, event in effects.events:
            pending = self._events.setdefault(job.job_id, [])
            pending.append(event)
            if len(pending) > MAX_EVENTS_PER_JOB:     # older ones would be pruned on disk anyway
                del pending[: len(pending) - MAX_EVENTS_PER_JOB]
        self._dirty.update(effects.changed)
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._next.add_done_callback(_consume)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_loop(), name="rdzv-store-writer")

    def pending(self, job_id: str) -> bool:
        """Whether a change of `job_id` is noted but not yet committed."""
        return job_id in self._dirty or job_id in self._inflight

    async def durable(self, job_id: str) -> None:
        """Return once every change noted so far for `job_id` is committed."""
        fut = self._next if job_id in self._dirty else self._inflight.get(job_id)
        if fut is not None:
            await asyncio.shield(fut)

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._dirty or self._deleted:
            fut, self._next = self._next, None
            assert fut is not None
            jobs, self._dirty = self._dirty, {}
            events, resets, deleted = self._events, self._reset, self._deleted
            self._events, self._reset, self._deleted = {}, set(), set()
            for job_id in jobs:
                self._inflight[job_id] = fut
            started = time.perf_counter()
            try:
                assert self.store is not None
                snaps = [snapshot(job, events.get(job_id, []), reset_events=job_id in resets)
                         for job_id, job in jobs.items()]
                await loop.run_in_executor(self._executor, self.store.write, snaps, self.clock(), deleted)
            except Exception as exc:   # disk full, I/O error: keep the changes, fail the replies
                self.stats.failures += 1
                log.error("state store commit failed (%s); %d job(s) kept in memory, retrying", exc, len(jobs))
                for job_id, job in jobs.items():
                    self._dirty.setdefault(job_id, job)
                    if job_id in self._reset:    # a newer run started meanwhile: these events are moot
                        continue
                    self._events[job_id] = events.get(job_id, []) + self._events.get(job_id, [])
                    if job_id in resets:
                        self._reset.add(job_id)
                self._deleted |= deleted - set(self._dirty)
                if self._next is None:
                    self._next = loop.create_future()
                    self._next.add_done_callback(_consume)
                fut.set_exception(StoreUnavailable(f"state store commit failed: {exc}"))
                if not self._closing:
                    await asyncio.sleep(RETRY_AFTER_S)
                else:
                    break
            else:
                took = time.perf_counter() - started
                self.stats.commits += 1
                self.stats.jobs_written += len(snaps)
                self.stats.total_s += took
                self.stats.max_s = max(self.stats.max_s, took)
                fut.set_result(None)
            finally:
                for job_id in jobs:
                    if self._inflight.get(job_id) is fut:
                        del self._inflight[job_id]

    async def _alive_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(ALIVE_EVERY_S)     # a periodic mark, not a synchronisation wait
            if self._writer is None or self._writer.done():
                try:
                    await loop.run_in_executor(self._executor, self.store.write, [], self.clock())  # type: ignore
                except Exception as exc:
                    log.error("state store liveness mark failed: %s", exc)

    async def close(self) -> None:
        """Flush what is pending, mark a clean shutdown, release the store."""
        if self.store is None:
            return
        self._closing = True
        if self._alive is not None:
            self._alive.cancel()
            await asyncio.gather(self._alive, return_exceptions=True)
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
        assert self._executor is not None
        clean = not self._dirty
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close_store, clean)
        self._executor.shutdown(wait=True)

    def _close_store(self, clean: bool) -> None:
        assert self.store is not None
        if clean:
            self.store.close(self.clock())
        else:
            log.error("stopping with %d job(s) not written to the state store", len(self._dirty))
            self.store.release()


def _consume(fut: asyncio.Future) -> None:
    """A commit nobody awaited may fail: its error is logged, not 'never retrieved'."""
    if not fut.cancelled():
        fut.exception()
