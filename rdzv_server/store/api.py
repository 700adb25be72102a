"""What the server needs from a durable store, whichever it is (SQLite or etcd); callers are typed against `Store`.
Every method blocks: the persister's worker thread calls `write` and `load_job`, the coordinator runs `load` off
the loop, so the loop never waits on a disk or a network.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from rdzv_server.core.records import JobRecord
from rdzv_server.store.snapshots import JobSnapshot


class StoreError(Exception):
    """The store cannot be used; the message says which store and why."""


@dataclass
class Loaded:
    jobs: dict[str, JobRecord]
    alive_at: float | None                   # None for a new store
    clean_shutdown: bool


class Store(Protocol):
    @property
    def where(self) -> str:
        """The store in words, for log lines ("state store /var/lib/rdzv/rdzv-state.sqlite3")."""

    def load(self) -> Loaded:
        """Every saved job, and when the last server to write was last known alive."""

    def load_job(self, job_id: str) -> JobRecord | None:
        """The job as last committed (None when it is not saved): read back after a failed commit."""

    def write(self, snapshots: list[JobSnapshot], alive_at: float, deleted: Collection[str] = ()) -> None:
        """Commit the snapshots, the deletion of `deleted` jobs and the liveness mark; raise on failure."""

    def close(self, now: float) -> None:
        """Mark a clean shutdown and release the store."""

    def release(self) -> None:
        """Let go of the store without marking a clean shutdown."""

    def describe_failure(self, exc: BaseException) -> str:
        """A failed commit in words an operator acts on."""
