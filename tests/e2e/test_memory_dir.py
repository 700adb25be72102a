"""End-to-end: the agent's in-memory checkpoint directories (node_agent/workers/memory.py) with real agents
and torch-free workers (tests/e2e/scripts/memory_worker.py) that use node_agent/snapshot.py."""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.e2e.harness import SCRIPTS, wait_until

pytestmark = pytest.mark.e2e
WORKER = os.path.join(SCRIPTS, "memory_worker.py")


def records(out) -> dict[tuple[int, int], dict]:
    found = {}
    for name in os.listdir(out):
        if name.startswith("rank") and name.endswith(".json"):
            rank, attempt = name[4:-5].split("-attempt")
            with open(os.path.join(out, name)) as f:
                found[int(rank), int(attempt)] = json.load(f)
    return found


def standalone(cluster, out, *flags, env=None, nproc="2", restarts="1"):
    return cluster.agent("--standalone", "--nproc", nproc, "--max-restarts", restarts, *flags, WORKER,
                         env={"OUT_DIR": str(out), **(env or {})})


def test_the_directory_is_there_before_workers_start_kept_across_a_restart_and_gone_at_the_end(cluster, tmp_path):
    agent = standalone(cluster, tmp_path, "--memory-dir-limit", "1M", env={"CRASH_RANK": "1"})
    assert agent.wait() == 0, agent.output
    r = records(tmp_path)
    assert set(r) == {(0, 0), (1, 0), (0, 1), (1, 1)}, agent.output
    for rank in (0, 1):
        first, second = r[rank, 0], r[rank, 1]
        assert first["exists"] and first["found"] is None and first["saved"] == 10
        assert second["dir"] == first["dir"]               # the same directory in the next round
        assert second["found"] == 10                      # what the crashed round saved
        assert second["saved"] == 20
        assert first["limit"] == str(2**20 // 2)            # the node's limit, shared by the 2 local ranks
    assert r[0, 0]["dir"] != r[1, 0]["dir"]                  # one per local rank
    assert not os.path.exists(r[0, 0]["dir"]) and not os.path.exists(os.path.dirname(r[0, 0]["dir"]))


def test_the_directory_is_gone_after_a_failed_job(cluster, tmp_path):
    agent = standalone(cluster, tmp_path, env={"CRASH_RANK": "0"}, restarts="0")
    assert agent.wait() != 0
    r = records(tmp_path)
    assert r[0, 0]["exists"] and not os.path.exists(os.path.dirname(r[0, 0]["dir"]))


def test_sigterm_to_the_agent_removes_the_directory(cluster, tmp_path):
    agent = standalone(cluster, tmp_path, env={"WAIT_FILE": str(tmp_path / "never")}, nproc="1")
    wait_until(lambda: records(tmp_path).get((0, 0)), 60, "the worker's record")
    where = records(tmp_path)[0, 0]["dir"]
    assert os.path.isdir(where)
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait() != 0
    assert not os.path.exists(os.path.dirname(where))


def test_a_killed_agents_directory_is_removed_by_the_next_agent_on_the_node(cluster, tmp_path):
    os.makedirs(tmp_path / "a")                             # its worker writes there
    first = standalone(cluster, tmp_path / "a", env={"WAIT_FILE": str(tmp_path / "never")}, nproc="1")
    wait_until(lambda: records(tmp_path / "a").get((0, 0)), 60, "the first worker's record")
    left = os.path.dirname(records(tmp_path / "a")[0, 0]["dir"])
    first.kill_all()                                        # SIGKILL: no clean-up
    # (not checked here that it is still there: an agent of a test running beside this one may sweep it
    # first; tests/unit/test_memory_dirs.py checks the sweep itself)
    os.makedirs(tmp_path / "b")
    second = standalone(cluster, tmp_path / "b", nproc="1")
    assert second.wait() == 0, second.output
    assert not os.path.exists(left)


def test_a_snapshot_past_the_limit_raises_in_the_worker_and_training_goes_on(cluster, tmp_path):
    agent = standalone(cluster, tmp_path, "--memory-dir-limit", "1K", nproc="1", env={"SAVE_BYTES": "2000"})
    assert agent.wait() == 0, agent.output                  # the agent did not stop the worker for it
    record = records(tmp_path)[0, 0]
    assert record["saved"] is None and record["found"] is None
    assert "does not fit the memory directory" in record["full"] and "limit 1024 bytes" in record["full"]


def test_no_memory_dir_means_an_empty_variable(cluster, tmp_path):
    """Empty, not unset: protect asks every rank of a node-agent job whether it has a directory (one node run with
    --no-memory-dir sends every rank to the fallback), and under torchrun, with the variable on no rank, it asks
    nothing."""
    agent = standalone(cluster, tmp_path, "--no-memory-dir", nproc="1")
    assert agent.wait() == 0, agent.output
    record = records(tmp_path)[0, 0]
    assert record["dir"] == "" and record["limit"] is None


def test_ranks_ahead_of_a_slower_ones_write_keep_a_step_every_rank_holds(cluster, tmp_path):
    """Rank 1's write of step 3 outlasts the snapshots' interval; rank 0 saves 3 and 4 meanwhile and then fails.
    Rank 0 keeps the newest snapshot its keep rule lets go, 2, as the server's held floor is no newer, so the
    restarted ranks still hold a step in common, 2, and resume from memory. (Before, rank 0 dropped 2 when it saved
    4: no step in common, and a job of shards went back to disk or step 0.)"""
    agent = cluster.agent("--standalone", "--nproc", "2", "--max-restarts", "1", "--memory-dir-limit", "1M",
                          os.path.join(SCRIPTS, "slow_writer.py"), env={"OUT_DIR": str(tmp_path)})
    assert agent.wait() == 0, agent.output
    held = {}
    for rank in (0, 1):
        with open(tmp_path / f"held{rank}.json") as f:
            held[rank] = json.load(f)
    with open(tmp_path / "kept_from.json") as f:
        kept_from = json.load(f)
    common = set(held[0]) & set(held[1])
    assert common and max(common) == 2 and 4 in held[0], (held, kept_from, agent.output)
    assert kept_from is not None and kept_from <= 2, (held, kept_from, agent.output)
