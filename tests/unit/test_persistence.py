"""Group commit: replies wait for their change to be on disk; many changes share a commit;
a failed commit fails the waiting replies, keeps the change, and is retried."""
from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from protocol.messages import JobConfig, JobState
from rdzv_server.core.events import EventKind
from rdzv_server.core.outbox import Outbox
from rdzv_server.core.records import Event, JobRecord
from rdzv_server.store.persistence import NotDurable, Persister, StoreUnavailable
from rdzv_server.store.snapshots import JobSnapshot
from rdzv_server.store.sqlite import SqliteStore, describe_failure


class GatedStore:
    """A store double whose commits wait on a gate, to see what a commit carries."""

    def __init__(self) -> None:
        self.batches: list[list[JobSnapshot]] = []
        self.gate = threading.Event()
        self.fail_next = 0
        self.state_dir = "/nowhere"
        self.saved: dict[str, JobRecord] = {}      # what load_job gives back: "as last committed"

    def write(self, snapshots: list[JobSnapshot], alive_at: float, deleted=()) -> None:
        self.gate.wait(10)
        if self.fail_next:
            self.fail_next -= 1
            raise OSError(28, "No space left on device")
        if snapshots:
            self.batches.append(snapshots)

    def load_job(self, job_id: str) -> JobRecord | None:
        return self.saved.get(job_id)

    def close(self, now: float) -> None:
        pass

    def release(self) -> None:
        pass

    def describe_failure(self, exc: BaseException) -> str:
        return describe_failure(exc, self.state_dir)


def job(job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, config=JobConfig(), state=JobState.WAITING, created_at=1.0)


def change(j: JobRecord, what: str) -> Outbox:
    """A decision of the core about `j`, as the core's outbox would hand it over."""
    event = Event(t=2.0, seq=0, kind=EventKind.NODE_JOINED, message=what)
    j.record(event)
    return Outbox(events=[(j, event)], changed={j.job_id: j})


async def test_changes_made_during_a_commit_ride_the_next_one_together():
    store = GatedStore()
    p = Persister(store)  # type: ignore[arg-type]
    a, b = job("a"), job("b")
    p.note(change(a, "first"))
    first = asyncio.ensure_future(p.durable("a"))
    await asyncio.sleep(0)                       # let the writer take the first batch
    p.note(change(a, "second"))
    p.note(change(b, "other job"))
    later = [asyncio.ensure_future(p.durable("a")), asyncio.ensure_future(p.durable("b"))]
    assert not first.done()
    store.gate.set()
    await asyncio.gather(first, *later)
    assert [[s.job_id for s in batch] for batch in store.batches] == [["a"], ["a", "b"]]
    # the second commit of "a" carries only the event the first did not
    assert len(store.batches[0][0].events) == 1 and len(store.batches[1][0].events) == 1
    await p.close()


async def test_unchanged_jobs_are_not_written():
    store = GatedStore()
    store.gate.set()
    p = Persister(store)  # type: ignore[arg-type]
    a = job("a")
    p.note(change(a, "x"))
    await p.durable("a")
    a.nodes = {}                                  # not a decision: the core reports no change
    p.note(Outbox())
    await p.durable("a")
    assert len(store.batches) == 1
    await p.close()


async def test_a_failed_commit_refuses_the_reply_names_a_full_disk_and_puts_the_job_back():
    store = GatedStore()
    store.fail_next = 1
    store.gate.set()
    put_back: list[tuple[str, JobRecord | None]] = []
    p = Persister(store, on_rollback=lambda job_id, saved: put_back.append((job_id, saved)))  # type: ignore[arg-type]
    a = job("a")
    p.note(change(a, "x"))
    with pytest.raises(StoreUnavailable, match="disk holding --state-dir /nowhere is full"):
        await p.durable("a")
    await asyncio.wait_for(p._writer, 5)           # the refusal is complete once the writer is idle
    assert put_back == [("a", None)]               # never saved: the change is not kept
    assert not p.pending("a") and store.batches == []
    p.note(change(a, "y"))                         # the next change goes through
    await p.durable("a")
    assert [s.job_id for s in store.batches[0]] == ["a"] and len(store.batches[0][0].events) == 1
    assert p.stats.failures == 1 and p.stats.commits == 1
    await p.close()


async def test_in_memory_mode_writes_nothing():
    p = NotDurable()
    a = job("a")
    p.note(change(a, "x"))
    assert not p.pending("a")
    await p.durable("a")
    await p.close()


async def test_round_trip_through_sqlite_with_the_persister(tmp_path):
    p = Persister(SqliteStore(str(tmp_path)))
    a = job("a")
    for i in range(5):
        p.note(change(a, f"event {i}"))
    await p.durable("a")
    await p.close()
    loaded = SqliteStore(str(tmp_path)).load()
    assert [e.message for e in loaded.jobs["a"].events] == [f"event {i}" for i in range(5)]
    assert loaded.clean_shutdown


class CountedStore(GatedStore):
    """Liveness marks that fail while `failing`, and a gate opened after `until` marks."""

    def __init__(self, until: int) -> None:
        super().__init__()
        self.gate.set()
        self.failing = True
        self.marks = 0
        self.until = until
        self.reached = threading.Event()

    def write(self, snapshots: list[JobSnapshot], alive_at: float, deleted=()) -> None:
        self.marks += 1
        if self.marks >= self.until:
            self.reached.set()
        if self.failing:
            raise OSError(28, "No space left on device")


async def test_a_full_disk_is_said_once_by_the_liveness_mark_and_its_end_too(monkeypatch, caplog):
    monkeypatch.setattr("rdzv_server.store.persistence.ALIVE_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="rdzv_server")
    store = CountedStore(until=5)
    p = Persister(store)  # type: ignore[arg-type]
    p.start()
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, store.reached.wait, 10)
    store.failing, store.reached, store.until = False, threading.Event(), store.marks + 3
    assert await loop.run_in_executor(None, store.reached.wait, 10)
    await p.close()
    said = [r.getMessage() for r in caplog.records if "liveness mark" in r.getMessage()]
    assert len(said) == 2, said
    assert "is full" in said[0] and "written again" in said[1]
