"""The durable store: every job's state in one SQLite file under `--state-dir`.

Tables (schema in `user_version`, our mark in `application_id`), msgpack rows of snapshots.py: `jobs`, `nodes`,
`events` (the newest MAX_EVENTS_PER_JOB) and `meta` (`alive_at`, `clean_shutdown`). Schema 1 (nodes inside the
job row) is migrated on open; a file not ours, corrupt, or newer is an error at start-up, never reset. Blocking,
from one worker thread; WAL with synchronous=FULL: fsynced before `write` returns. A lock file keeps a second
server off the same dir.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sqlite3
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import TypeVar

import msgspec

from rdzv_server.core.records import MAX_EVENTS_PER_JOB, JobRecord
from rdzv_server.store.api import Loaded, StoreError
from rdzv_server.store.snapshots import JobSnapshot, assemble, event_decoder, job_decoder, node_decoder

__all__ = ["Loaded", "SqliteStore", "StoreError", "describe_failure"]

SCHEMA_VERSION = 2
APPLICATION_ID = 0x52445A56          # "RDZV": tells our file from any other SQLite database
DB_NAME = "rdzv-state.sqlite3"
LOCK_NAME = "rdzv-state.lock"

_NODES_TABLE = """
CREATE TABLE nodes (job_id TEXT NOT NULL, node_id TEXT NOT NULL, record BLOB NOT NULL,
                    PRIMARY KEY (job_id, node_id)) WITHOUT ROWID;
"""
_SCHEMA = """
CREATE TABLE jobs (job_id TEXT PRIMARY KEY, record BLOB NOT NULL);
""" + _NODES_TABLE + """
CREATE TABLE events (job_id TEXT NOT NULL, seq INTEGER NOT NULL, record BLOB NOT NULL,
                     PRIMARY KEY (job_id, seq)) WITHOUT ROWID;
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_FULL_BELOW = 1 << 20    # free bytes under which a disk that fails a write is said to be full
_MOVE_AWAY = "refusing to start; move the file away to start with an empty state"


T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


class SqliteStore:
    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, DB_NAME)
        try:
            os.makedirs(state_dir, exist_ok=True)
            self._lock = open(os.path.join(state_dir, LOCK_NAME), "a+")
        except OSError as exc:      # makedirs on a file says "File exists": name what is wrong instead
            why = "it is a file, not a directory" if isinstance(exc, FileExistsError) else exc.strerror or exc
            raise StoreError(f"cannot use --state-dir {state_dir}: {why}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise StoreError(f"--state-dir {state_dir} is in use by another rdzv-server (lock {LOCK_NAME} "
                             "is held); give each server its own state dir") from None
        new = not os.path.exists(self.path)
        try:
            self._refuse_emptied()
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._open_schema()
        except sqlite3.Error as exc:
            self.release()
            self._drop_if_empty(new)
            raise StoreError(self._open_failure(exc)) from None
        except StoreError:
            self.release()
            self._drop_if_empty(new)
            raise

    def _drop_if_empty(self, new: bool) -> None:
        """A first start that failed before its schema was written (a full disk) leaves no empty file behind: the
        next start would take it for a truncated store and refuse."""
        if new and os.path.exists(self.path) and os.path.getsize(self.path) == 0:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.remove(self.path + suffix)

    def _refuse_emptied(self) -> None:
        """An empty state file (truncated, or `> file` by mistake) would open as a new store, and SQLite would then
        drop a write-ahead log left beside it, with the jobs it holds: refused, everything left as it is."""
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            size = -1
        wal = os.path.getsize(self.path + "-wal") if os.path.exists(self.path + "-wal") else 0
        if size == 0 or (size < 0 and wal > 0):
            state = "is empty (0 bytes)" if size == 0 else "is missing"
            log = f" while its write-ahead log {self.path}-wal holds {wal} bytes" if wal else ""
            raise StoreError(f"{self.path} {state}{log}: truncated or removed? refusing to start; restore it from "
                             "a backup, or move the state dir's files away to start with an empty state")

    def _open_failure(self, exc: sqlite3.Error) -> str:
        """Why the file could not be opened. A disk that fails or is full is no corrupt file: moving the file away
        would lose every job, so the operator is told to fix the disk instead."""
        text = str(exc)
        if "readonly" in text:      # e.g. switching a backup restored in rollback mode to WAL: not a corrupt file
            return (f"{self.path} cannot be written ({text}): check its owner and mode, or run the server as the "
                    "user that owns it")
        name = getattr(exc, "sqlite_errorname", "")    # Python 3.11+
        if not (name.startswith(("SQLITE_IOERR", "SQLITE_FULL")) or "disk I/O error" in text or "disk is full" in text):
            return f"cannot open state store {self.path}: {_sqlite_reason(exc)}; {_MOVE_AWAY}"
        try:
            free = shutil.disk_usage(self.state_dir).free
        except OSError:
            free = -1
        where = f"the disk holding --state-dir {self.state_dir} is full" if 0 <= free < _FULL_BELOW else "disk error"
        return (f"cannot open state store {self.path}: {text} ({where}); refusing to start; the file is kept as "
                "it is: free space on (or repair) its disk and start again")

    def _open_schema(self) -> None:
        db = self._db
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if app_id == 0 and version == 0 and tables == 0:     # a new, empty file
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")     # before the first table: freed pages can go back
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
        elif version == 1:
            self._migrate_from_1()
        check = db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise StoreError(f"{self.path} failed its integrity check ({check}); {_MOVE_AWAY}")
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:    # an older store: convert it once
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            db.execute("VACUUM")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        # A file we may read but not write (another user's, read-only) is refused now: else the server would
        # serve with every commit failing, or fail restoring its jobs after it started.
        try:
            with self._transaction() as txn:
                txn.execute("DELETE FROM meta WHERE key = 'write-probe'")
        except sqlite3.OperationalError as exc:
            if "readonly" not in str(exc):
                raise
            raise StoreError(f"{self.path} cannot be written ({exc}): check its owner and mode, or run the "
                             "server as the user that owns it") from None

    def _migrate_from_1(self) -> None:
        """Schema 1 kept a job's nodes inside its row: move them to rows of their own, in one transaction."""
        with self._transaction() as db:
            db.execute(_NODES_TABLE)          # not executescript: that would commit the transaction
            for job_id, blob in db.execute("SELECT job_id, record FROM jobs").fetchall():
                job = self._decode(job_id, blob, job_decoder, "record")
                db.executemany("INSERT INTO nodes (job_id, node_id, record) VALUES (?, ?, ?)",
                               [(job_id, nid, _encoder.encode(n)) for nid, n in job.nodes.items()])
                db.execute("UPDATE jobs SET record = ? WHERE job_id = ?",
                           (_encoder.encode(msgspec.structs.replace(job, nodes={})), job_id))
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed at the end of the block, rolled back if it raises."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:       # a failed COMMIT has already rolled back: do not hide its error
                db.execute("ROLLBACK")
            raise

    @property
    def where(self) -> str:
        return f"state store {self.path}"

    def describe_failure(self, exc: BaseException) -> str:
        return describe_failure(exc, self.state_dir)

    # ---- reading (at start-up; one job again after a failed commit) ----

    def load(self) -> Loaded:
        try:
            ids = [row[0] for row in self._db.execute("SELECT job_id FROM jobs").fetchall()]
            jobs = {job_id: job for job_id in ids if (job := self.load_job(job_id)) is not None}
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read state store {self.path}: {_sqlite_reason(exc)}; {_MOVE_AWAY}") from None
        alive = meta.get("alive_at")
        return Loaded(jobs, float(alive) if alive is not None else None, meta.get("clean_shutdown") == "1")

    def load_job(self, job_id: str) -> JobRecord | None:
        db = self._db
        row = db.execute("SELECT record FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        job = self._decode(job_id, row[0], job_decoder, "record")
        nodes = [self._decode(job_id, b, node_decoder, f"node {n}") for n, b in
                 db.execute("SELECT node_id, record FROM nodes WHERE job_id = ?", (job_id,)).fetchall()]
        events = db.execute("SELECT seq, record FROM events WHERE job_id = ? ORDER BY seq DESC LIMIT ?",
                            (job_id, MAX_EVENTS_PER_JOB)).fetchall()
        return assemble(job, nodes, [self._decode(job_id, b, event_decoder, f"event {s}")
                                     for s, b in reversed(events)])

    def _decode(self, job_id: str, blob: bytes, decoder: msgspec.msgpack.Decoder[T], what: str) -> T:
        try:
            if not isinstance(blob, bytes):     # edited by hand: a text or number column is no record of ours
                raise msgspec.DecodeError(f"a {type(blob).__name__} value, not msgpack bytes")
            return decoder.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise StoreError(f"{self.path}: job {job_id!r} has an unreadable {what} ({exc}); {_MOVE_AWAY}") from None

    # ---- writing (from the store thread) ----

    def write(self, snapshots: list[JobSnapshot], alive_at: float, deleted: Collection[str] = ()) -> None:
        """Commit the snapshots, the deletion of `deleted` jobs and the liveness mark in one transaction."""
        with self._transaction() as db:
            for job_id in deleted:
                for table in ("jobs", "nodes", "events"):
                    db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
            for s in snapshots:
                db.execute("INSERT OR REPLACE INTO jobs (job_id, record) VALUES (?, ?)", (s.job_id, s.record))
                if s.reset:
                    db.execute("DELETE FROM nodes WHERE job_id = ?", (s.job_id,))
                    db.execute("DELETE FROM events WHERE job_id = ?", (s.job_id,))
                db.executemany("INSERT OR REPLACE INTO nodes (job_id, node_id, record) VALUES (?, ?, ?)",
                               [(s.job_id, nid, blob) for nid, blob in s.nodes.items() if blob is not None])
                db.executemany("DELETE FROM nodes WHERE job_id = ? AND node_id = ?",
                               [(s.job_id, nid) for nid, blob in s.nodes.items() if blob is None])
                db.executemany("INSERT OR REPLACE INTO events (job_id, seq, record) VALUES (?, ?, ?)",
                               [(s.job_id, seq, blob) for seq, blob in s.events])
                if s.keep_after_seq > 0 and s.events:
                    db.execute("DELETE FROM events WHERE job_id = ? AND seq <= ?", (s.job_id, s.keep_after_seq))
            db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           [("alive_at", repr(alive_at)), ("clean_shutdown", "0")])
        if deleted:           # forgotten jobs: give their pages back, file and log both
            self._db.executescript("PRAGMA incremental_vacuum;")   # (execute() would step it once only)
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

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


def describe_failure(exc: BaseException, state_dir: str) -> str:
    """A failed commit in words an operator acts on: a full disk is named as such."""
    text = str(exc)
    if "disk is full" in text or getattr(exc, "errno", None) == errno.ENOSPC:
        return f"the disk holding --state-dir {state_dir} is full ({text})"
    return text
