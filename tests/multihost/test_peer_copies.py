"""A host lost for real (its link cut: no FIN, found only by its lease) while a spare waits: the spare takes its
place and its ranks resume from the peer copies of the lost host's snapshots (issue 46), not from disk; a slow
host swapped for the spare is the source of its own snapshots (issue 55). Each
host is a network namespace with its own failure domain; the workers run benchmarks/scripts/shard_train.py
(each rank's shard tells its step; a snapshot every 5 steps; OUT_DIR/resumed.txt says how each rank resumed).
"""
from __future__ import annotations

import datetime
import glob
import os
import time

import pytest

from tests.e2e.harness import ROOT, shard_resumes, wait_until
from tests.multihost.scenarios import SETUP_LIMIT_S

pytestmark = pytest.mark.multihost
SHARDS = os.path.join(ROOT, "benchmarks", "scripts", "shard_train.py")
ENV = {"STATE_MB": "1", "STEP_S": "0.1", "SNAP_EVERY": "5", "DISK_EVERY": "0"}


def start(job, host: str):
    return job.start_agent(host, nnodes="2:3", nproc=2, script=SHARDS, env={"NODE": host, **ENV},
                           extra=("--failure-domain", f"rack-{host}", "--last-call", "1"))


def ranks_stepping(out) -> set[int]:
    ranks = set()
    for path in glob.glob(os.path.join(out, "steps-*.txt")):
        with open(path) as f:
            ranks |= {int(p[4]) for p in (ln.split() for ln in f) if len(p) == 5}
    return ranks


def member(job, node: str) -> dict:
    view = job.view() or {}
    return next((n for n in view.get("nodes", []) if n["node_id"] == node), {})


def test_a_spare_resumes_a_cut_off_hosts_ranks_from_their_peer_copies(multihost):
    job = multihost(["a", "b", "c", "s"])
    job.start_server()
    for host in ("a", "b", "c"):
        start(job, host)
    wait_until(lambda: ranks_stepping(job.out) == set(range(6)), SETUP_LIMIT_S,
               lambda: f"every rank stepping\n{job.diagnosis()}")
    start(job, "s").wait_for_line(r"ready after", SETUP_LIMIT_S)
    lost = next(n["node_id"] for n in (job.view() or {})["nodes"] if n["group_rank"] == 1)
    wait_until(lambda: member(job, lost).get("copies", {}).get("copied_step", -1) >= 10, SETUP_LIMIT_S,
               lambda: f"{lost}'s copies of step 10 or later on a peer\n{job.diagnosis()}")

    cut_at = time.time()
    job.net.cut(lost)
    back = wait_until(lambda: len(shard_resumes(job.out, cut_at)) == 6 and shard_resumes(job.out, cut_at),
                      SETUP_LIMIT_S,
                      lambda: f"every rank resumed: {shard_resumes(job.out, cut_at)}\n{job.diagnosis()}")

    assert {source for _, source, _ in back.values()} == {"memory"}, f"{back}\n{job.diagnosis()}"
    assert len({step for step, _, _ in back.values()}) == 1, back
    assert {ok for _, _, ok in back.values()} == {"ok"}, back            # each rank its own shard
    assert any(f"fetched node {lost}'s snapshots" in line for line in job.agents["s"].lines), job.diagnosis()
    assert [e for e in job.events_of("node_lost", since=cut_at) if e["node_id"] == lost], job.diagnosis()


def test_a_slow_host_swapped_for_the_spare_is_the_source_of_its_own_snapshots(multihost):
    """Hosts a and b train, b sleeping half a step more every step; spare s waits. All in one failure domain, so no
    peer copies are made: the spare takes b's place at the job's next snapshot and fetches b's snapshots from b's
    own agent, across the network (rounds.own_source, node_agent/copies/own.py); no step is redone."""
    job = multihost(["a", "b", "s"])
    job.start_server()
    env = {**ENV, "SLOW_AT": "b:0:0.5:sleep"}
    extra = ("--failure-domain", "one-rack", "--last-call", "1", "--replace-slow-nodes")
    for host in ("a", "b"):
        job.start_agent(host, nnodes="2", nproc=2, script=SHARDS, env={"NODE": host, **env}, extra=extra)
    wait_until(lambda: ranks_stepping(job.out) == set(range(4)), SETUP_LIMIT_S,
               lambda: f"every rank stepping\n{job.diagnosis()}")
    spare = job.start_agent("s", nnodes="2", nproc=2, script=SHARDS, env={"NODE": "s", **env}, extra=extra)
    swapped = wait_until(lambda: next((e for e in job.events_of("node_suspect") if "swapped for spare s at the "
                                       "snapshot of step " in e["message"]), None), SETUP_LIMIT_S,
                         lambda: f"b swapped at a snapshot\n{job.diagnosis()}")
    held = int(swapped["message"].split("at the snapshot of step ")[1].split()[0].rstrip(",;"))
    at = datetime.datetime.fromisoformat(swapped["time"].replace("Z", "+00:00")).timestamp()
    back = wait_until(lambda: len(shard_resumes(job.out, at)) == 4 and shard_resumes(job.out, at), SETUP_LIMIT_S,
                      lambda: f"every rank resumed: {shard_resumes(job.out, at)}\n{job.diagnosis()}")
    assert {step for step, _, _ in back.values()} == {held}, back
    assert {source for _, source, _ in back.values()} == {"memory"} and {ok for *_, ok in back.values()} == {"ok"}
    fetched = spare.wait_for_line(rf"fetched node b's snapshots of step {held} from {job.net.addr('b')}:",
                                  SETUP_LIMIT_S)
    assert fetched, job.diagnosis()
