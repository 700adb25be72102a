"""The etcd store against a real 3-member cluster: every job state round-trips as in SQLite, commits
are fenced on the election key, batches are split to fit etcd's limits without splitting a job."""
from __future__ import annotations

import dataclasses

import msgspec
import pytest

from protocol.messages import JobConfig, LeaveRequest
from rdzv_server.core.events import EventKind
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, Event, JobRecord
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.store.api import StoreError
from rdzv_server.store.etcd.client import EtcdClient, EtcdSettings, created_at, delete, prefix_end, put
from rdzv_server.store.etcd.store import MIN_TXN_OPS, NODE_BUCKETS, Deposed, EtcdStore
from rdzv_server.store.snapshots import snapshot
from tests.unit.test_store import _builtins, _join, every_state


def elected(settings: EtcdSettings) -> EtcdStore:
    """A store whose replica holds the election key (as store/etcd/election.py would leave it)."""
    store = EtcdStore(settings)
    client = EtcdClient(settings)
    ok, reply = client.txn([created_at(store.leader_key, 0)], [put(store.leader_key, b"http://me:1")])
    assert ok, "the election key of a fresh prefix exists"
    store.fence = int(reply["header"]["revision"])
    client.close()
    return store


def keys(settings: EtcdSettings, under: str = "") -> list[str]:
    client = EtcdClient(settings)
    kvs, _ = client.range(settings.prefix + under, prefix_end(settings.prefix + under))
    client.close()
    return [kv.key[len(settings.prefix):] for kv in kvs]


def test_every_job_state_round_trips(settings):
    rz = every_state()
    store = elected(settings)
    store.write([snapshot(job, job.nodes, job.events, reset=True) for job in rz.jobs.values()], 123.5)
    store.close(now=124.0)
    loaded = EtcdStore(settings).load()
    assert _builtins(loaded.jobs) == _builtins(rz.jobs)
    assert loaded.alive_at == 124.0 and loaded.clean_shutdown is True


def test_a_store_not_closed_cleanly_says_so(settings):
    store = elected(settings)
    store.write([snapshot(job, job.nodes, job.events, reset=True) for job in every_state().jobs.values()], 50.0)
    store.release()
    loaded = EtcdStore(settings).load()
    assert loaded.clean_shutdown is False and loaded.alive_at == 50.0


def test_a_replica_that_is_not_the_leader_commits_nothing(settings):
    rz = every_state()
    old = elected(settings)
    old.write([snapshot(rz.jobs["waiting"], rz.jobs["waiting"].nodes, rz.jobs["waiting"].events, reset=True)], 1.0)
    # another replica wins: the old leader's key is gone (its lease revoked) and a new one made
    client = EtcdClient(settings)
    client.txn([], [delete(old.leader_key)])
    new = elected(settings)
    assert new.fence != old.fence
    refused = []
    old.on_deposed = lambda: refused.append(True)
    before = keys(settings, "jobs/")
    _join(rz, "waiting", "b", 2.0, min_nodes=2, max_nodes=2)
    with pytest.raises(Deposed, match="another replica leads"):
        old.write([snapshot(rz.jobs["waiting"], ["b"], [], reset=False)], 2.0)
    assert refused == [True] and old.fence is None
    assert keys(settings, "jobs/") == before
    assert set(EtcdStore(settings).load().jobs["waiting"].nodes) == {"a"}
    with pytest.raises(Deposed):                   # and it stays refused: it is no longer elected at all
        old.write([], 3.0)
    client.close()


def test_a_commit_rewrites_only_the_buckets_of_changed_nodes_and_deletes_removed_ones(settings):
    rz = Rendezvous()
    for n in ("a", "b", "c"):
        _join(rz, "j", n, 1.0, min_nodes=1, max_nodes=5)
    first = rz.take_effects()
    store = elected(settings)
    store.write([snapshot(rz.jobs["j"], first.nodes["j"], rz.jobs["j"].events, reset=True)], 1.0)
    _join(rz, "j", "d", 2.0, min_nodes=1, max_nodes=5)
    rz.handle("j", LeaveRequest(v=1, node_id="a"), 2.0)
    second = rz.take_effects()
    snap = snapshot(rz.jobs["j"], second.nodes["j"], [], reset=False)
    store.write([snap], 2.0)
    loaded = EtcdStore(settings).load().jobs["j"]
    assert set(loaded.nodes) == {"b", "c", "d"}
    assert {n: loaded.nodes[n].state for n in loaded.nodes} == {n: rz.jobs["j"].nodes[n].state for n in "bcd"}
    assert len([k for k in keys(settings, "jobs/j/n/")]) <= 3


def test_new_events_are_appended_and_old_ones_pruned(settings):
    rz = Rendezvous()
    _join(rz, "j", "a", 1.0)
    job = rz.jobs["j"]
    store = elected(settings)
    store.write([snapshot(job, job.nodes, job.events, reset=True)], 1.0)
    for burst in range(3):                           # three commits of many events each
        saved = job.event_seq
        for i in range(MAX_EVENTS_PER_JOB // 2 + 7):
            job.record(Event(t=2.0 + i, seq=0, kind=EventKind.NODE_JOINED, message=f"event {burst}.{i}"))
        store.write([snapshot(job, (), job.events_after(saved), reset=False)], 3.0)
    events = EtcdStore(settings).load().jobs["j"].events
    assert [e.seq for e in events] == [e.seq for e in job.events] and len(events) == MAX_EVENTS_PER_JOB
    assert len(keys(settings, "jobs/j/e/")) <= 3     # the packs wholly older than the kept history are gone


def test_reused_job_id_drops_the_old_history_and_nodes(settings):
    rz = Rendezvous()
    for n in ("a", "b"):
        _join(rz, "j", n, 1.0, min_nodes=1, max_nodes=3)
    store = elected(settings)
    store.write([snapshot(rz.jobs["j"], rz.jobs["j"].nodes, rz.jobs["j"].events, reset=True)], 1.0)
    fresh = JobRecord(job_id="j", config=JobConfig(), state=rz.jobs["j"].state, created_at=5.0)
    fresh.record(Event(t=5.0, seq=0, kind=EventKind.JOB_CREATED, message="second run"))
    store.write([snapshot(fresh, fresh.nodes, fresh.events, reset=True)], 5.0)
    loaded = EtcdStore(settings).load().jobs["j"]
    assert [e.message for e in loaded.events] == ["second run"] and loaded.nodes == {}


def test_a_forgotten_job_is_deleted(settings):
    rz = every_state()
    store = elected(settings)
    store.write([snapshot(job, job.nodes, job.events, reset=True) for job in rz.jobs.values()], 1.0)
    store.write([], 2.0, deleted={"failed"})
    assert not [k for k in keys(settings, "jobs/") if k.startswith("jobs/failed/")]
    assert set(EtcdStore(settings).load().jobs) == set(rz.jobs) - {"failed"}


def test_a_batch_over_the_transaction_limit_is_split_between_jobs(settings):
    """40 jobs in one batch, over the operations one transaction may hold: several, every job whole."""
    small = dataclasses.replace(settings, max_txn_ops=MIN_TXN_OPS)
    rz = Rendezvous()
    for i in range(40):
        _join(rz, f"j{i}", "a", 1.0, min_nodes=2, max_nodes=2)
        _join(rz, f"j{i}", "b", 1.0, min_nodes=2, max_nodes=2)
    store = elected(small)
    sent = []
    commit = store._commit
    store._commit = lambda fence, ops: (sent.append(len(ops)), commit(fence, ops))[1]   # type: ignore[method-assign]
    store.write([snapshot(job, job.nodes, job.events, reset=True) for job in rz.jobs.values()], 1.0)
    assert len(sent) > 1 and max(sent) <= MIN_TXN_OPS
    assert _builtins(EtcdStore(settings).load().jobs) == _builtins(rz.jobs)


def test_a_job_with_many_nodes_changed_at_once_is_one_transaction(settings):
    """1,000 new nodes of one job in one commit: their rows fill the buckets, one transaction."""
    rz = Rendezvous()
    for i in range(1000):
        _join(rz, "big", f"node-{i}", 1.0, min_nodes=1000, max_nodes=1000)
    job = rz.jobs["big"]
    store = elected(settings)
    sent = []
    commit = store._commit
    store._commit = lambda fence, ops: (sent.append(len(ops)), commit(fence, ops))[1]   # type: ignore[method-assign]
    store.write([snapshot(job, job.nodes, job.events[-MAX_EVENTS_PER_JOB:], reset=True)], 1.0)
    assert len(sent) == 1 and sent[0] <= NODE_BUCKETS + 5
    loaded = EtcdStore(settings).load().jobs["big"]
    assert msgspec.to_builtins(loaded) == msgspec.to_builtins(job)


def test_load_job_reads_one_job_as_last_committed(settings):
    rz = every_state()
    store = elected(settings)
    store.write([snapshot(job, job.nodes, job.events, reset=True) for job in rz.jobs.values()], 1.0)
    _join(rz, "waiting", "b", 2.0, min_nodes=2, max_nodes=2)      # not committed
    saved = store.load_job("waiting")
    assert saved is not None and set(saved.nodes) == {"a"} and saved.round is None
    assert store.load_job("never") is None


def test_an_unreadable_key_is_refused_by_name(settings):
    store = elected(settings)
    client = EtcdClient(settings)
    client.txn([], [put(settings.prefix + "jobs/x/row", b"\xc1 not msgpack")])
    with pytest.raises(StoreError, match="jobs/x/row is unreadable"):
        EtcdStore(settings).load()
    client.close()
    store.release()


def test_no_member_answering_is_an_error_naming_etcd(settings):
    down = dataclasses.replace(settings, endpoints=("http://127.0.0.1:9",))
    with pytest.raises(StoreError, match="no etcd member answered"):
        EtcdStore(down).load()
