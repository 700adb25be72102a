"""Tools that start torch's launcher for you (accelerate, TorchX, Lightning): `sys.argv` is theirs, not a
torchrun line. scripts/inprocess_launcher.py calls `torch.distributed.run.run()` from its own command line
the way `accelerate launch` does; the plugin reads the workers per node, the restart budget and the
command from torch's launch configuration (issue 37)."""
from __future__ import annotations

import os
import re
import sys

import pytest

from tests.e2e.harness import Proc, child_env, job_events, job_view
from tests.plugin.test_torchrun_e2e import LIMIT, STEPS, TORCHRUN, assert_clean_world, wait_world

pytestmark = pytest.mark.e2e
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "inprocess_launcher.py")
FAST = "lease_timeout=3,last_call_timeout=1"


def launcher(cluster, out, rank: int, *, max_restarts: int, conf: str = FAST, env=None) -> Proc:
    argv = [sys.executable, LAUNCHER, "--num_processes", "4", "--num_machines", "2", "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(cluster.port),
            "--rdzv_backend", "rdzv-server", "--max_restarts", str(max_restarts), "--rdzv_conf",
            f"{conf},node_id=n{rank}", STEPS]
    proc = Proc(argv, child_env(OUT_DIR=str(out), NODE=f"n{rank}", TMPDIR=cluster.temp_dir(), **(env or {})),
                f"launcher-{rank}")
    cluster.procs.append(proc)
    return proc


def test_an_inprocess_launch_gets_its_worker_count_budget_and_a_job_id(cluster, tmp_path):
    """No --rdzv-id, no --rdzv-conf sizes: 2 workers per node and the budget of 2 reach the server from
    torch's launch configuration, both nodes derive the same job id, a crash restarts the job once."""
    cluster.start_server("--state-dir", "none")
    out = tmp_path / "out"
    out.mkdir()
    crash = {"FAIL_RANK": "3", "FAIL_STEP": "2", "FAIL_ONCE": str(tmp_path / "crashed"), "STEPS": "8"}
    nodes = [launcher(cluster, out, rank, max_restarts=2, env=crash) for rank in (0, 1)]

    codes = [p.wait(LIMIT) for p in nodes]
    assert codes == [0, 0], "\n\n".join(p.output for p in nodes)
    ids = {re.search(r"job id (\S+) \(from your user name and the command's fingerprint; --rdzv-id or "
                     r"\$PET_RDZV_ID sets another\)", p.output).group(1) for p in nodes}
    assert len(ids) == 1, ids
    job_id = ids.pop()
    job = job_view(cluster, job_id)
    assert (job["state"], job["restart_count"], job["max_restarts"]) == ("succeeded", 1, 2), job
    assert [n["local_world_size"] for n in job["nodes"]] == [2, 2], job["nodes"]
    first, _ = wait_world(out, world=4, nodes={"n0", "n1"}, what="(before the crash)")
    _, recs = wait_world(out, world=4, nodes={"n0", "n1"}, exclude={first}, what="(after the crash)")
    assert_clean_world(recs, 4)


def test_a_report_the_server_refuses_for_good_ends_the_node_and_the_others_go_on(cluster, tmp_path):
    """A wrong `--rdzv-conf local_world_size` (1, where torch runs 2): the failure report names a local rank
    the server does not know of and is refused. The node says so and exits 1 at once, leaving the job;
    the other node is told as for a node that left (its job then fails: below its 2 nodes for the join
    timeout), and nobody waits until killed."""
    cluster.start_server("--state-dir", "none")
    out = tmp_path / "out"
    out.mkdir()
    crash = {"FAIL_RANK": "3", "FAIL_STEP": "1", "FAIL_ONCE": str(tmp_path / "crashed")}
    conf = f"{FAST},local_world_size=1,join_timeout=12"    # both join within it, however far apart their imports
    nodes = [launcher(cluster, out, rank, max_restarts=2, conf=conf, env=crash) for rank in (0, 1)]
    codes = [p.wait(LIMIT) for p in nodes]
    assert all(code != 0 for code in codes), "\n\n".join(p.output for p in nodes)
    refused = [p for p in nodes if "refused this node's request, and would again" in p.output]
    assert len(refused) == 1, "\n\n".join(p.output for p in nodes)
    assert "Traceback" not in refused[0].output.split("refused this node's request")[1].split("\n")[0]
    job_id = re.search(r"job id (\S+) \(from", nodes[0].output).group(1)
    left = [e["node_id"] for e in job_events(cluster, job_id) if e["kind"] == "node_left"]
    assert f"n{nodes.index(refused[0])}" in left, left


def test_torchrun_with_a_missing_script_is_one_line_before_joining(cluster, tmp_path):
    cluster.start_server("--state-dir", "none")
    argv = [*TORCHRUN, "--rdzv-backend", "rdzv-server", "--rdzv-endpoint", cluster.endpoint(), "--rdzv-id", "typo",
            "--nnodes", "2", "--nproc-per-node", "2", str(tmp_path / "trian.py")]
    proc = Proc(argv, child_env(TMPDIR=cluster.temp_dir()), "torchrun")
    cluster.procs.append(proc)
    assert proc.wait(LIMIT) == 2, proc.output
    assert f"the script '{tmp_path / 'trian.py'}' does not exist" in proc.output, proc.output
    assert "Traceback" not in proc.output, proc.output
    assert job_view(cluster, "typo", missing_ok=True) is None
