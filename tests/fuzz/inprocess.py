"""The real app (durable store included) served on 127.0.0.1 by an event loop in a thread.

The fuzz test sends raw bytes from its own thread and, between requests, reads the core on the
server's loop: exact snapshots of the jobs it controls, taken where nothing else runs at the time.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from rdzv_server.coordinator import Coordinator
from rdzv_server.core.records import JobRecord
from rdzv_server.store.sqlite import SqliteStore
from rdzv_server.web.app import create_app

T = TypeVar("T")


class Snapshot(msgspec.Struct, frozen=True):
    job_ids: tuple[str, ...]                 # every job the server holds
    records: dict[str, bytes]                # the watched jobs, encoded whole


class ServerThread:
    def __init__(self, state_dir: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-server", daemon=True)
        self.thread.start()
        self.coordinator = Coordinator(store=SqliteStore(state_dir))
        self.runner: web.AppRunner | None = None
        self.port = self.call(self._start())

    async def _start(self) -> int:
        # As serve.py runs it: a handler is cancelled when its client goes away.
        self.runner = web.AppRunner(create_app(self.coordinator), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(self.runner.addresses[0][1])

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            if self.runner is not None:
                self.call(self.runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    # -- reading the core (on its loop) --
    def snapshot(self, watched: Iterable[str]) -> Snapshot:
        async def take() -> Snapshot:
            jobs = self.coordinator.core.jobs
            return Snapshot(tuple(sorted(jobs)), {j: msgspec.msgpack.encode(jobs[j]) for j in watched if j in jobs})
        return self.call(take())

    def job(self, job_id: str) -> JobRecord | None:
        """A copy of one job's record."""
        async def read() -> bytes | None:
            job = self.coordinator.core.jobs.get(job_id)
            return None if job is None else msgspec.msgpack.encode(job)
        raw = self.call(read())
        return None if raw is None else msgspec.msgpack.decode(raw, type=JobRecord)


def differences(before: Snapshot, after: Snapshot) -> list[str]:
    """What changed between two snapshots, field by field, for a failure message."""
    out = []
    if before.job_ids != after.job_ids:
        out.append(f"jobs added {sorted(set(after.job_ids) - set(before.job_ids))}, "
                   f"removed {sorted(set(before.job_ids) - set(after.job_ids))}")
    for job_id in sorted(set(before.records) | set(after.records)):
        old = msgspec.msgpack.decode(before.records[job_id]) if job_id in before.records else None
        new = msgspec.msgpack.decode(after.records[job_id]) if job_id in after.records else None
        if old == new:
            continue
        if not isinstance(old, dict) or not isinstance(new, dict):
            out.append(f"job {job_id}: {old!r:.100} -> {new!r:.100}")
            continue
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                out.append(f"job {job_id}.{key}: {old.get(key)!r:.300} -> {new.get(key)!r:.300}")
    return out
