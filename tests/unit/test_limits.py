"""Bounded state: finished jobs are forgotten after their retention (memory and store), and the
server's job and node limits refuse cleanly, changing nothing."""
from __future__ import annotations

import pytest

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JoinRequest, SuccessReport
from rdzv_server.core.records import JobRecord
from rdzv_server.core.rendezvous import Limits, Rendezvous, RendezvousError, node_room
from rdzv_server.store.snapshots import snapshot
from rdzv_server.store.sqlite import SqliteStore

ONE = JobConfig(min_nodes=1, max_nodes=1, last_call_s=0.0, lease_timeout_s=1e4)


def join(rz: Rendezvous, job: str, node: str, now: float, config: JobConfig = ONE) -> None:
    rz.handle(job, JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=1, master_port=1,
                             config=config, instance=node), now)


def finish(rz: Rendezvous, job: str, now: float) -> None:
    join(rz, job, "a", now)
    rz.handle(job, SuccessReport(v=1, node_id="a", round_id=1), now)
    assert rz.jobs[job].state.finished


def test_finished_jobs_are_forgotten_after_the_retention_and_the_store_deletes_them(tmp_path):
    rz = Rendezvous(limits=Limits(retain_finished_s=60.0))
    finish(rz, "old", 10.0)
    join(rz, "live", "a", 20.0, JobConfig(min_nodes=2, max_nodes=2, lease_timeout_s=1e4))
    store = SqliteStore(str(tmp_path))
    store.write([snapshot(j, j.nodes, j.events, reset=True) for j in rz.jobs.values()], 20.0)
    assert rz.next_deadline() == 70.0
    rz.tick(69.9)
    assert "old" in rz.jobs
    rz.tick(70.0)
    out = rz.take_effects()
    assert "old" not in rz.jobs and "live" in rz.jobs and out.pruned == {"old"}
    assert rz.node_count == 1
    store.write([], 70.0, deleted=out.pruned)
    store.release()
    loaded = SqliteStore(str(tmp_path)).load().jobs
    assert set(loaded) == {"live"}


def test_the_call_that_ends_a_job_asks_the_timer_for_its_retention_deadline():
    # A one-node job whose lease is long: without this the timer would sleep to the lease and keep
    # the finished job (and its store rows) past the retention.
    rz = Rendezvous(limits=Limits(retain_finished_s=5.0))
    join(rz, "one", "a", 10.0, JobConfig(min_nodes=1, max_nodes=1, lease_timeout_s=600.0))
    assert rz.take_effects().earliest == 610.0
    rz.handle("one", SuccessReport(v=1, node_id="a", round_id=1), 11.0)
    assert rz.take_effects().earliest == 16.0


def test_jobs_ending_within_one_second_are_forgotten_in_one_tick():
    rz = Rendezvous(limits=Limits(retain_finished_s=5.0))
    for i, t in enumerate((10.1, 10.5, 10.9)):
        finish(rz, f"j{i}", t)
    assert rz.take_effects().earliest == 16.0 and rz.next_deadline() == 16.0
    rz.tick(15.05)                     # before the first one's retention ends
    assert len(rz.jobs) == 3
    rz.tick(16.0)
    assert rz.jobs == {} and rz.take_effects().pruned == {"j0", "j1", "j2"}


def test_at_max_jobs_the_oldest_finished_go_first_and_then_new_jobs_are_refused():
    rz = Rendezvous(limits=Limits(max_jobs=3))
    finish(rz, "f1", 1.0)
    finish(rz, "f2", 2.0)
    join(rz, "u1", "a", 3.0, JobConfig(min_nodes=2, max_nodes=2))
    join(rz, "u2", "a", 4.0, JobConfig(min_nodes=2, max_nodes=2))     # f1 goes to make room
    assert set(rz.jobs) == {"f2", "u1", "u2"}
    join(rz, "u3", "a", 5.0, JobConfig(min_nodes=2, max_nodes=2))     # then f2
    with pytest.raises(RendezvousError) as err:
        join(rz, "u4", "a", 6.0)
    assert err.value.code == ErrorCode.LIMIT_REACHED and "--max-jobs 3" in err.value.message
    assert set(rz.jobs) == {"u1", "u2", "u3"}


def test_eviction_at_max_jobs_looks_only_at_the_oldest_finished_job():
    """Forgetting to make room is O(log n): the finished jobs are not scanned or sorted at each new job.
    A reused id's old end, and a job restored finished from the store, are ordered by when they ended."""
    restored = Rendezvous(limits=Limits(max_jobs=9))
    finish(restored, "early", 1.0)
    jobs = _Scans(restored.jobs)
    rz = Rendezvous(jobs, limits=Limits(max_jobs=9))   # as restored from a store
    for i in range(2, 10):
        finish(rz, f"f{i}", float(i))
    finish(rz, "f2", 20.0)       # f2 reused after it ended: its old place in the order no longer counts
    jobs.scans = 0
    join(rz, "new", "a", 30.0, JobConfig(min_nodes=2, max_nodes=2))
    assert "early" not in rz.jobs and len(rz.jobs) == 9 and jobs.scans == 0
    join(rz, "new2", "a", 31.0, JobConfig(min_nodes=2, max_nodes=2))
    assert "f3" not in rz.jobs and "f2" in rz.jobs and jobs.scans == 0   # f3 ended at 3.0; f2's run at 20.0


class _Scans(dict[str, JobRecord]):
    """The registry's jobs, counting every walk over all of them."""

    scans = 0

    def values(self):  # type: ignore[override]
        self.scans += 1
        return super().values()


def test_a_job_holds_at_most_its_max_nodes_plus_as_many_spares_and_the_server_its_node_limit():
    config = JobConfig(min_nodes=1, max_nodes=2, lease_timeout_s=1e4)
    rz = Rendezvous()
    for i in range(node_room(config)):
        join(rz, "j", f"n{i}", 1.0, config)
    with pytest.raises(RendezvousError) as err:
        join(rz, "j", "one-more", 1.0, config)
    assert err.value.code == ErrorCode.LIMIT_REACHED and "one-more" not in rz.jobs["j"].nodes
    join(rz, "j", "n0", 2.0, config)                 # a known node may always come back
    small = Rendezvous(limits=Limits(max_nodes=2))
    join(small, "j", "a", 1.0, config)
    join(small, "k", "a", 1.0, config)
    with pytest.raises(RendezvousError) as err:
        join(small, "j", "b", 1.0, config)
    assert "--max-nodes 2" in err.value.message and small.node_count == 2


def test_a_failure_report_is_bounded_by_its_nodes_workers_and_floods_no_history():
    from protocol.messages import FailureReport, WorkerFailure
    many = JobConfig(min_nodes=1, max_nodes=1, max_restarts=5, last_call_s=0.0, lease_timeout_s=1e4)
    rz = Rendezvous()
    rz.handle("j", JoinRequest(v=1, node_id="a", addr="10.0.0.1", local_world_size=64, master_port=1,
                             config=many, instance="a"), 1.0)
    before = rz.jobs["j"].event_seq
    with pytest.raises(RendezvousError) as err:                 # a local rank the node does not have
        rz.handle("j", FailureReport(v=1, node_id="a", round_id=1, failures=[
            WorkerFailure(local_rank=64, rank=64, exitcode=1)]), 2.0)
    assert err.value.code == ErrorCode.BAD_REQUEST and "runs 64 workers" in err.value.message
    assert rz.jobs["j"].event_seq == before and rz.jobs["j"].restart_count == 0
    failures = [WorkerFailure(local_rank=r, rank=r, exitcode=1, message="x" * 4096) for r in range(64)]
    rz.handle("j", FailureReport(v=1, node_id="a", round_id=1, failures=failures), 3.0)
    failed = [e for e in rz.jobs["j"].events_after(before) if e.kind == "worker_failed"]
    assert len(failed) == 9 and failed[-1].data == {"count": 56, "reason": "exited"}
    assert rz.jobs["j"].restart_count == 1
