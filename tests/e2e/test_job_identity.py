"""Job identity on a shared server, with real agents: unrelated runs never merge, the same command runs
twice in a row, and a node whose workers never ran never exits 0."""
from __future__ import annotations

import os
import re

import pytest

from tests.e2e.harness import SCRIPTS, job_view, read_records

pytestmark = pytest.mark.e2e
ECHO = os.path.join(SCRIPTS, "echo_env.py")
SERVER = ("--rdzv-backend", "c10d", "--lease-timeout", "3", "--last-call", "0")


def test_the_same_command_runs_twice_in_a_row_under_the_id_it_derives(cluster, tmp_path):
    cluster.start_server("--state-dir", "none")
    ids = []
    for run in range(2):
        out = tmp_path / f"run{run}"
        out.mkdir()
        agent = cluster.agent("--rdzv-endpoint", cluster.endpoint(), *SERVER, "--nproc-per-node", "2", ECHO,
                              "--lr", "0.1", env={"OUT_DIR": str(out), "USER": "alice", "LOGNAME": "alice"})
        assert agent.wait(60) == 0, agent.output
        ids.append(agent.wait_for_line(r"job id (\S+) \(from your user name and the command's fingerprint").group(1))
        assert sorted(r["env"]["TORCHELASTIC_RUN_ID"] for r in read_records(out)) == [ids[-1]] * 2
    assert ids[0] == ids[1] and ids[0].startswith("alice-")
    job = job_view(cluster, ids[0])
    assert job["state"] == "succeeded"


def test_two_commands_under_one_id_are_not_merged_and_a_spare_that_never_ran_exits_non_zero(cluster, tmp_path):
    cluster.start_server("--state-dir", "none")
    common = ("--rdzv-endpoint", cluster.endpoint(), *SERVER, "--rdzv-id", "shared", "--nnodes", "1")
    release = tmp_path / "release"
    env = {"OUT_DIR": str(tmp_path), "WAIT_FILE": str(release)}
    first = cluster.agent(*common, "--node-id", "first", ECHO, name="first", env=env)
    first.wait_for_line(r"rank 0 waiting for")
    # another script, which imports torch: its warm interpreter is still importing as the refusal comes
    other = cluster.agent(*common, "--node-id", "other", os.path.join(SCRIPTS, "stall_worker.py"), name="other",
                          env=env)
    assert other.wait(60) == 1
    refusal = other.wait_for_line(r"refused this node's join: (.*)").group(1)
    assert "runs another command" in refusal and "--rdzv-id" in refusal
    assert len(re.findall(r"\b[0-9a-f]{16}\b", refusal)) == 2        # both fingerprints, to compare
    assert not (tmp_path / "pid-0").exists()                           # its script never ran
    assert "ready after" not in other.output, other.output            # (a review: said as it ended)

    spare = cluster.agent(*common, "--node-id", "spare", ECHO, name="spare", env=env)
    spare.wait_for_line(r"waiting as spare #1")
    release.write_text("go")                                           # the member's worker ends: success
    assert first.wait(60) == 0, first.output
    assert spare.wait(60) == 1, spare.output                          # not a false success
    spare.wait_for_line(r"job shared succeeded without this node: its workers never ran")
    assert job_view(cluster, "shared")["state"] == "succeeded"
