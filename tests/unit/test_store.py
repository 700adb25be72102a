"""The SQLite state store: every job state round-trips; bad files are refused, never reset."""
from __future__ import annotations

import os
import sqlite3

import msgspec
import pytest

from protocol.messages import FailureReport, JobConfig, JoinRequest, LeaveRequest, WorkerFailure
from rdzv_server.core.events import EventKind
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, Event, JobRecord
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.rounds import assignment
from rdzv_server.store.snapshots import snapshot
from rdzv_server.store.sqlite import DB_NAME, SCHEMA_VERSION, SqliteStore, StoreError


def _join(rz: Rendezvous, job: str, node: str, now: float, **cfg) -> None:
    config = JobConfig(**{"lease_timeout_s": 1e4, "last_call_s": 0.0, "max_restarts": 3, **cfg})
    rz.handle(job, JoinRequest(v=1, node_id=node, addr=f"10.0.0.{len(node)}", local_world_size=2,
                             master_port=29500, config=config, instance=f"{node}#1"), now)


def _fail(rz: Rendezvous, job: str, node: str, now: float) -> None:
    round_id = rz.jobs[job].round.round_id
    failure = WorkerFailure(local_rank=1, rank=3, exitcode=7, message="boom", timestamp=now - 0.5)
    rz.handle(job, FailureReport(v=1, node_id=node, round_id=round_id, failures=[failure]), now)


def every_state() -> Rendezvous:
    """One core holding a job in every state the server can keep."""
    rz = Rendezvous()
    _join(rz, "waiting", "a", 1.0, min_nodes=2, max_nodes=2)
    for n in ("a", "b", "c"):      # running with a spare
        _join(rz, "running", n, 2.0, min_nodes=2, max_nodes=2)
    _fail(rz, "running", "a", 3.0)
    for n in ("a", "b"):           # one node excluded after a failure
        _join(rz, "excluded", n, 4.0, min_nodes=1, max_nodes=2, exclude_after=1)
    _fail(rz, "excluded", "b", 5.0)
    _join(rz, "failed", "a", 6.0, max_restarts=0)
    _fail(rz, "failed", "a", 7.0)
    _join(rz, "closed", "a", 8.0)
    rz.close_job("closed", "maintenance", 9.0)
    for n in ("a", "b"):
        _join(rz, "operated", n, 10.0, min_nodes=1, max_nodes=2)
    rz.drain_node("operated", "b", "bad disk", 11.0)
    rz.resize("operated", 1, 3, 12.0)
    return rz


def _save(store: SqliteStore, rz: Rendezvous, now: float = 100.0) -> None:
    store.write([snapshot(job, job.nodes, job.events, reset=True) for job in rz.jobs.values()], now)


def _builtins(jobs: dict[str, JobRecord]) -> dict:
    return {k: msgspec.to_builtins(v) for k, v in jobs.items()}


def test_every_job_state_round_trips(tmp_path):
    rz = every_state()
    assert {j.state.value for j in rz.jobs.values()} == {"waiting", "running", "failed", "closed"}
    assert rz.jobs["running"].spares and rz.jobs["excluded"].excluded and rz.jobs["operated"].drained
    store = SqliteStore(str(tmp_path))
    _save(store, rz, now=123.5)
    store.close(now=124.0)

    loaded = SqliteStore(str(tmp_path)).load()
    assert _builtins(loaded.jobs) == _builtins(rz.jobs)
    assert loaded.alive_at == 124.0 and loaded.clean_shutdown is True


def test_a_store_not_closed_cleanly_says_so(tmp_path):
    store = SqliteStore(str(tmp_path))
    _save(store, every_state(), now=50.0)
    store.release()                        # as if killed: no clean-shutdown mark
    loaded = SqliteStore(str(tmp_path)).load()
    assert loaded.clean_shutdown is False and loaded.alive_at == 50.0


def test_new_events_are_appended_and_old_ones_pruned(tmp_path):
    rz = Rendezvous()
    _join(rz, "j", "a", 1.0)
    job = rz.jobs["j"]
    store = SqliteStore(str(tmp_path))
    store.write([snapshot(job, job.nodes, job.events, reset=True)], 1.0)
    saved = job.event_seq
    for i in range(MAX_EVENTS_PER_JOB + 20):
        job.record(Event(t=2.0 + i, seq=0, kind=EventKind.NODE_JOINED, message=f"event {i}"))
    store.write([snapshot(job, (), job.events_after(saved), reset=False)], 3.0)
    store.release()
    store = SqliteStore(str(tmp_path))
    events = store.load().jobs["j"].events
    assert [e.seq for e in events] == [e.seq for e in job.events]
    assert len(events) == MAX_EVENTS_PER_JOB
    rows = store._db.execute("SELECT count(*) FROM events").fetchone()[0]
    assert rows == MAX_EVENTS_PER_JOB          # pruned on disk too, not only on load


def test_reused_job_id_drops_the_old_history(tmp_path):
    rz = Rendezvous()
    _join(rz, "j", "a", 1.0)
    store = SqliteStore(str(tmp_path))
    store.write([snapshot(rz.jobs["j"], rz.jobs["j"].nodes, rz.jobs["j"].events, reset=True)], 1.0)
    fresh = JobRecord(job_id="j", config=JobConfig(), state=rz.jobs["j"].state, created_at=5.0)
    fresh.record(Event(t=5.0, seq=0, kind=EventKind.JOB_CREATED, message="second run"))
    store.write([snapshot(fresh, fresh.nodes, fresh.events, reset=True)], 5.0)
    store.release()
    events = SqliteStore(str(tmp_path)).load().jobs["j"].events
    assert [e.message for e in events] == ["second run"]


def test_newer_schema_is_refused(tmp_path):
    SqliteStore(str(tmp_path)).release()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match=rf"schema version {SCHEMA_VERSION + 1}, newer"):
        SqliteStore(str(tmp_path))


def test_a_corrupt_file_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / DB_NAME
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    with pytest.raises(StoreError, match="corrupt"):
        SqliteStore(str(tmp_path))
    assert path.read_bytes() == garbage        # never silently reset


def test_an_unreadable_record_names_the_job(tmp_path):
    store = SqliteStore(str(tmp_path))
    _save(store, every_state())
    store._db.execute("UPDATE jobs SET record = ? WHERE job_id = 'running'", (b"\x93\x01\x02\x03",))
    store.release()
    with pytest.raises(StoreError, match="job 'running' has an unreadable record"):
        SqliteStore(str(tmp_path)).load()


def test_another_sqlite_database_is_not_ours(tmp_path):
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="not an rdzv-server state store"):
        SqliteStore(str(tmp_path))


def test_two_servers_cannot_share_a_state_dir(tmp_path):
    first = SqliteStore(str(tmp_path))
    with pytest.raises(StoreError, match="in use by another rdzv-server"):
        SqliteStore(str(tmp_path))
    first.release()
    SqliteStore(str(tmp_path)).release()       # free again once the first one is gone


def test_a_state_dir_that_cannot_be_created_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match=r"cannot use --state-dir .*file/state"):
        SqliteStore(str(blocker / "state"))


# ---- rows that scale with the change --------------------------------------------------------------

def test_a_commit_writes_only_the_node_rows_the_core_changed_and_deletes_removed_ones(tmp_path):
    rz = Rendezvous()
    for n in ("a", "b", "c"):
        _join(rz, "j", n, 1.0, min_nodes=1, max_nodes=5)
    first = rz.take_effects()
    assert first.nodes == {"j": {"a", "b", "c"}}
    store = SqliteStore(str(tmp_path))
    store.write([snapshot(rz.jobs["j"], first.nodes["j"], rz.jobs["j"].events, reset=True)], 1.0)
    _join(rz, "j", "d", 2.0, min_nodes=1, max_nodes=5)         # a newcomer: one row, whatever the job's size
    rz.handle("j", LeaveRequest(v=1, node_id="a"), 2.0)
    second = rz.take_effects()
    assert second.nodes == {"j": {"d", "a"}}
    snap = snapshot(rz.jobs["j"], second.nodes["j"], [], reset=False)
    assert set(snap.nodes) == {"a", "d"} and snap.nodes["a"] is None and snap.nodes["d"] is not None
    store.write([snap], 2.0)
    assert sorted(r[0] for r in store._db.execute("SELECT node_id FROM nodes")) == ["b", "c", "d"]
    store.release()
    loaded = SqliteStore(str(tmp_path)).load().jobs["j"]
    assert set(loaded.nodes) == {"b", "c", "d"}
    assert {n: loaded.nodes[n].state for n in loaded.nodes} == {n: rz.jobs["j"].nodes[n].state for n in "bcd"}


def test_a_schema_1_store_is_moved_to_per_node_rows_when_opened(tmp_path):
    rz = every_state()
    path = os.path.join(str(tmp_path), DB_NAME)
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE jobs (job_id TEXT PRIMARY KEY, record BLOB NOT NULL);"
                     "CREATE TABLE events (job_id TEXT NOT NULL, seq INTEGER NOT NULL, record BLOB NOT NULL, "
                     "PRIMARY KEY (job_id, seq)) WITHOUT ROWID;"
                     "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                     "PRAGMA application_id = 1380211286; PRAGMA user_version = 1;")
    enc = msgspec.msgpack.Encoder()
    for job in rz.jobs.values():              # schema 1: the nodes inside the job's row
        db.execute("INSERT INTO jobs VALUES (?, ?)", (job.job_id, enc.encode(msgspec.structs.replace(job, events=[]))))
    db.commit()
    db.close()
    store = SqliteStore(str(tmp_path))
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    loaded = store.load().jobs
    for job_id, job in rz.jobs.items():
        assert msgspec.to_builtins(msgspec.structs.replace(loaded[job_id], events=[])) == \
            msgspec.to_builtins(msgspec.structs.replace(job, events=[])), job_id


def test_load_job_reads_one_job_as_last_committed(tmp_path):
    rz = every_state()
    store = SqliteStore(str(tmp_path))
    store.write([snapshot(job, job.nodes, job.events, reset=True) for job in rz.jobs.values()], 1.0)
    _join(rz, "waiting", "b", 2.0, min_nodes=2, max_nodes=2)      # not committed
    saved = store.load_job("waiting")
    assert saved is not None and set(saved.nodes) == {"a"} and saved.round is None
    assert store.load_job("never") is None


def _big_running_job(members: int) -> Rendezvous:
    rz = Rendezvous()
    config = JobConfig(min_nodes=members, max_nodes=members, lease_timeout_s=1e4, last_call_s=0.0, max_restarts=3)
    for i in range(members):
        rz.handle("big", JoinRequest(v=1, node_id=f"n{i}", addr=f"10.3.{i // 200}.{i % 200 + 1}",
                                   local_world_size=1 + i % 3, master_port=29500, config=config, instance=f"n{i}",
                                   witness_port=29600 if i % 4 else 0, role="trainer" if i % 5 else "eval"), 1.0)
    return rz


def test_a_round_is_stored_without_its_assignments_and_loads_with_the_same_ones(tmp_path):
    rz = _big_running_job(300)
    job = rz.jobs["big"]
    before = {m: assignment(job.round, m) for m in job.round.members}
    assert len(set(before.values())) == 300 and before["n7"].witnesses
    stored = msgspec.msgpack.decode(snapshot(job, job.nodes, [], reset=True).record)
    assert "assignments" not in stored["round"]          # what they are computed from, not 300 of them
    job.nodes["n0"].addr = "10.9.9.9"                    # a record changed since: the round does not move
    store = SqliteStore(str(tmp_path))
    _save(store, rz)
    loaded = store.load().jobs["big"]
    assert {m: assignment(loaded.round, m) for m in loaded.round.members} == before
    assert assignment(loaded.round, "stranger") is None


def test_a_round_saved_with_its_assignments_by_an_older_server_loads_with_them(tmp_path):
    rz = _big_running_job(5)
    job = rz.jobs["big"]
    written = {m: assignment(job.round, m) for m in job.round.members}
    old_round = msgspec.to_builtins(job.round)
    for column in ("ranked", "local_sizes", "roles", "addrs", "probe_ports", "master_port", "max_restarts"):
        del old_round[column]
    old_round["assignments"] = msgspec.to_builtins(written)
    snap = snapshot(job, job.nodes, [], reset=True)
    record = msgspec.msgpack.decode(snap.record)
    record["round"] = old_round
    snap.record = msgspec.msgpack.encode(record)
    store = SqliteStore(str(tmp_path))
    store.write([snap], 1.0)
    loaded = store.load().jobs["big"]
    assert {m: assignment(loaded.round, m) for m in loaded.round.members} == written


def test_a_record_that_is_not_bytes_is_refused_by_name_not_a_traceback(tmp_path):
    store = SqliteStore(str(tmp_path))
    _save(store, every_state())
    store._db.execute("UPDATE jobs SET record = 'hand-edited' WHERE job_id = 'running'")
    store.release()
    with pytest.raises(StoreError, match="job 'running' has an unreadable record .*str"):
        SqliteStore(str(tmp_path)).load()


def test_a_store_file_it_cannot_write_is_refused_at_start(tmp_path, monkeypatch):
    SqliteStore(str(tmp_path)).release()
    real = sqlite3.connect

    def read_only(path, **kw):        # as a file of another user, or chmod 444, opens (root ignores modes)
        return real(f"file:{path}?mode=ro", uri=True, **kw)

    monkeypatch.setattr("rdzv_server.store.sqlite.sqlite3.connect", read_only)
    with pytest.raises(StoreError, match="cannot be written .*owner and mode"):
        SqliteStore(str(tmp_path))


def test_a_disk_error_at_start_does_not_say_to_move_the_file_away(tmp_path, monkeypatch):
    SqliteStore(str(tmp_path)).release()

    def io_error(self):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(SqliteStore, "_open_schema", io_error)
    monkeypatch.setattr("rdzv_server.store.sqlite.shutil.disk_usage", lambda _: type("U", (), {"free": 0})())
    with pytest.raises(StoreError) as caught:
        SqliteStore(str(tmp_path))
    assert "is full" in str(caught.value) and "move the file away" not in str(caught.value)


def test_an_emptied_state_file_is_refused_and_its_log_kept(tmp_path):
    # A review truncated the file of a killed server: it started with no jobs and SQLite dropped the -wal
    # holding them, so every agent's job was unknown and restarted from scratch.
    store = SqliteStore(str(tmp_path))
    _save(store, every_state())
    wal = (tmp_path / (DB_NAME + "-wal")).read_bytes()      # as a killed server leaves it
    store.release()
    assert wal
    (tmp_path / DB_NAME).write_bytes(b"")
    (tmp_path / (DB_NAME + "-wal")).write_bytes(wal)
    with pytest.raises(StoreError, match=r"is empty \(0 bytes\) while its write-ahead log .* holds"):
        SqliteStore(str(tmp_path))
    assert (tmp_path / (DB_NAME + "-wal")).read_bytes() == wal and (tmp_path / DB_NAME).read_bytes() == b""
    (tmp_path / (DB_NAME + "-wal")).unlink()
    with pytest.raises(StoreError, match=r"is empty \(0 bytes\): truncated"):
        SqliteStore(str(tmp_path))


def test_a_state_dir_that_is_a_file_is_named_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match=r"cannot use --state-dir .*file: it is a file, not a directory"):
        SqliteStore(str(blocker))


def test_a_first_start_that_fails_leaves_no_empty_file_to_be_refused_next(tmp_path, monkeypatch):
    real = SqliteStore._open_schema

    def full(self):
        self._db.execute("PRAGMA application_id")      # the file is made, as on a disk with no room for a page
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(SqliteStore, "_open_schema", full)
    with pytest.raises(StoreError, match="is full"):
        SqliteStore(str(tmp_path))
    monkeypatch.setattr(SqliteStore, "_open_schema", real)
    SqliteStore(str(tmp_path)).release()                # room again: it starts


def test_a_read_only_store_not_in_wal_mode_is_not_called_corrupt(tmp_path, monkeypatch):
    # A review restored a backup in rollback-journal mode, read-only: "move the file away" for a mode problem.
    SqliteStore(str(tmp_path)).release()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("PRAGMA journal_mode = DELETE")
    db.close()
    real = sqlite3.connect
    monkeypatch.setattr("rdzv_server.store.sqlite.sqlite3.connect",
                        lambda path, **kw: real(f"file:{path}?mode=ro", uri=True, **kw))
    with pytest.raises(StoreError) as caught:
        SqliteStore(str(tmp_path))
    assert "owner and mode" in str(caught.value) and "move the file away" not in str(caught.value)


def test_a_store_failure_at_stop_names_the_default_state_dir_and_a_full_disk(tmp_path, monkeypatch, capsys):
    # A review stopped a server on the default state dir of a full disk: "the state store in None failed".
    from rdzv_server import cli

    monkeypatch.chdir(tmp_path)

    async def stop_on_a_full_disk(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")     # as the clean-shutdown mark fails

    monkeypatch.setattr(cli, "serve", stop_on_a_full_disk)
    assert cli.main(["--host", "127.0.0.1", "--port", "0", "--event-loop", "asyncio"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "None" not in err and "state store in rdzv-state failed" in err and "--state-dir rdzv-state is full" in err
