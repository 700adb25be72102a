"""The durable store: every job's state in one SQLite file under `--state-dir`.

Layout (schema version in `PRAGMA user_version`, our mark in `PRAGMA application_id`):
- `jobs(job_id, record)`: the job's JobRecord without its events, MessagePack-encoded (msgspec);
- `events(job_id, seq, record)`: its event history, one row per event, the newest
  MAX_EVENTS_PER_JOB kept;
- `meta(key, value)`: `alive_at` (the last time this server was known up) and `clean_shutdown`.

This class does blocking I/O; the server calls `write` from one worker thread (see persistence.py)
so the event loop never waits on the disk. WAL mode with synchronous=FULL: a commit is on disk
(fsynced) before `write` returns. An exclusive lock file keeps a second server off the same dir.

A store that is not ours, is corrupt, or has a newer schema is an error at start-up, never reset.
"""
from __future__ import annotations

import fcntl
import os
import sqlite3
from dataclasses import dataclass, field
from collections.abc import Collection
from typing import TypeVar

import msgspec

from rdzv_server.records import MAX_EVENTS_PER_JOB, Event, JobRecord

SCHEMA_VERSION = 1
APPLICATION_ID = 0x52445A56          # "RDZV": tells our file from any other SQLite database
DB_NAME = "rdzv-state.sqlite3"
LOCK_NAME = "rdzv-state.lock"

_SCHEMA = """
CREATE TABLE jobs (job_id TEXT PRIMARY KEY, record BLOB NOT NULL);
CREATE TABLE events (job_id TEXT NOT NULL, seq INTEGER NOT NULL, record BLOB NOT NULL,
                     PRIMARY KEY (job_id, seq)) WITHOUT ROWID;
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_MOVE_AWAY = "refusing to start; move the file away to start with an empty state"


class StoreError(Exception):
    """The store cannot be used; the message says which file and why."""


@dataclass
class JobSnapshot:
    """What one commit writes for one job (encoded on the event loop, written on the thread)."""
    job_id: str
    record: bytes                               # JobRecord without events
    events: list[tuple[int, bytes]] = field(default_factory=list)   # new events: (seq, encoded)
    reset_events: bool = False                  # a new run reused the id: drop the old history first
    keep_after_seq: int = 0                     # older events may be deleted


@dataclass
class Loaded:
    jobs: dict[str, JobRecord]
    alive_at: float | None                   # None for a new store
    clean_shutdown: bool


T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_job_decoder = msgspec.msgpack.Decoder(JobRecord)
_event_decoder = msgspec.msgpack.Decoder(Event)


def snapshot(job: JobRecord, new_events: list[Event], reset_events: bool) -> JobSnapshot:
    """Encode a job as it is now: its record without its history, and the events not yet saved."""
    record = _encoder.encode(msgspec.structs.replace(job, events=[]))
    new = [(e.seq, _encoder.encode(e)) for e in new_events]
    return JobSnapshot(job.job_id, record, new, reset_events, job.event_seq - MAX_EVENTS_PER_JOB)


class SqliteStore:
    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, DB_NAME)
        try:
            os.makedirs(state_dir, exist_ok=True)
            self._lock = open(os.path.join(state_dir, LOCK_NAME), "a+")
        except OSError as exc:
            raise StoreError(f"cannot use --state-dir {state_dir}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise StoreError(f"--state-dir {state_dir} is in use by another rdzv-server (lock {LOCK_NAME} "
                             "is held); give each server its own state dir") from None
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._open_schema()
        except sqlite3.Error as exc:
            self.release()
            raise StoreError(f"cannot open state store {self.path}: {_sqlite_reason(exc)}; {_MOVE_AWAY}") from None
        except StoreError:
            self.release()
            raise

    def _open_schema(self) -> None:
        db = self._db
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if app_id == 0 and version == 0 and tables == 0:     # a new, empty file
            db.executescript("BEGIN;" + _SCHEMA + f"PRAGMA application_id = {APPLICATION_ID};"
                             f"PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
        elif app_id != APPLICATION_ID:
            raise StoreError(f"{self.path} is an SQLite database but not an rdzv-server state store; {_MOVE_AWAY}")
        elif version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} has schema version {version}, newer than this rdzv-server "
                             f"understands ({SCHEMA_VERSION}): it was written by a newer release; run that "
                             "release, or move the file away to start with an empty state")
        elif version < 1:
            raise StoreError(f"{self.path} has an unknown schema version {version}; {_MOVE_AWAY}")
        check = db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise StoreError(f"{self.path} failed its integrity check ({check}); {_MOVE_AWAY}")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")

    # ---- reading (once, at start-up) ----

    def load(self) -> Loaded:
        jobs: dict[str, JobRecord] = {}
        try:
            rows = self._db.execute("SELECT job_id, record FROM jobs").fetchall()
            for job_id, blob in rows:
                jobs[job_id] = self._decode(job_id, blob, _job_decoder, "record")
                events = self._db.execute(
                    "SELECT seq, record FROM events WHERE job_id = ? ORDER BY seq DESC LIMIT ?",
                    (job_id, MAX_EVENTS_PER_JOB)).fetchall()
                jobs[job_id].events = [self._decode(job_id, b, _event_decoder, f"event {s}")
                                       for s, b in reversed(events)]
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read state store {self.path}: {_sqlite_reason(exc)}; {_MOVE_AWAY}") from None
        alive = meta.get("alive_at")
        return Loaded(jobs, float(alive) if alive is not None else None, meta.get("clean_shutdown") == "1")

    def _decode(self, job_id: str, blob: bytes, decoder: msgspec.msgpack.Decoder[T], what: str) -> T:
        try:
            return decoder.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise StoreError(f"{self.path}: job {job_id!r} has an unreadable {what} ({exc}); {_MOVE_AWAY}") from None

    # ---- writing (from the store thread) ----

    def write(self, snapshots: list[JobSnapshot], alive_at: float, deleted: Collection[str] = ()) -> None:
        """Commit the snapshots, the deletion of `deleted` jobs and the liveness mark in one transaction."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for job_id in deleted:
                db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
                db.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
            for s in snapshots:
                db.execute("INSERT OR REPLACE INTO jobs (job_id, record) VALUES (?, ?)", (s.job_id, s.record))
                if s.reset_events:
                    db.execute("DELETE FROM events WHERE job_id = ?", (s.job_id,))
                db.executemany("INSERT OR REPLACE INTO events (job_id, seq, record) VALUES (?, ?, ?)",
                               [(s.job_id, seq, blob) for seq, blob in s.events])
                if s.keep_after_seq > 0 and s.events:
                    db.execute("DELETE FROM events WHERE job_id = ? AND seq <= ?", (s.job_id, s.keep_after_seq))
            db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           [("alive_at", repr(alive_at)), ("clean_shutdown", "0")])
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:       # a failed COMMIT has already rolled back: do not hide its error
                db.execute("ROLLBACK")
            raise

    def close(self, now: float) -> None:
        """Mark a clean shutdown and release the file and the lock."""
        try:
            self._db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                                 [("alive_at", repr(now)), ("clean_shutdown", "1")])
        finally:
            self.release()

    def release(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
        self._lock.close()


def _sqlite_reason(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "not a database" in text or "malformed" in text:
        return f"{text} (the file is corrupt or not a database)"
    return text
