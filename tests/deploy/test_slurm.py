"""deploy/slurm/rdzv-train.sbatch run for real: sbatch on a one-machine Slurm (slurmctld + two slurmd,
CPU binding by task/affinity), two node-agents started by srun, each with all its node's CPUs, a gloo
job, the agents' own exit status handed back, and an elastic run that loses a Slurm node and
finishes on the other.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile

import psutil
import pytest

from tests.deploy.slurm_cluster import SlurmCluster
from tests.deploy.tools import debian_tool, deploy_path
from tests.e2e.harness import SCRIPTS, read_jsonl, read_records, wait_until

pytestmark = pytest.mark.e2e
SBATCH = deploy_path("slurm", "rdzv-train.sbatch")
LIMIT = 90.0
FAST = "--lease-timeout 3 --last-call 1 --stop-timeout 2"
NODES = ["--nodes=2", "--gpus-per-node=0"]      # the script asks for GPUs; this Slurm has none


def test_shellcheck_finds_nothing():
    result = subprocess.run([debian_tool("shellcheck"), "--severity=style", "--shell=bash", SBATCH],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_script_refuses_to_run_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", SBATCH, "train.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode != 0 and "run this with sbatch" in result.stderr
    assert not list(tmp_path.iterdir())          # and started nothing


# One test Slurm at a time on this machine (pytest -n runs this module's tests in several workers, and
# other checkouts may run it too): two at once double the load of a 2-core machine for nothing.
LOCK = os.path.join(tempfile.gettempdir(), "elastic-launcher-test-slurm.lock")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    for tool in ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel"):
        debian_tool(tool)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # released when the file closes, or if this process dies
        cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.close()


def job_env(tmp_path, **extra: str) -> dict[str, str]:
    return {"RDZV_BIN": os.path.dirname(sys.executable), "NPROC": "1", "OUT_DIR": str(tmp_path),
            "TMPDIR": str(tmp_path), "AGENT_ARGS": FAST, **extra}


def output_of(tmp_path) -> str:
    with open(tmp_path / "job.out") as f:
        return f.read()


def test_sbatch_runs_a_gloo_job_with_one_agent_per_slurm_node(slurm, tmp_path):
    batch = slurm.sbatch([*NODES, "-o", str(tmp_path / "job.out"), SBATCH,
                          os.path.join(SCRIPTS, "allreduce.py")], job_env(tmp_path, MAX_RESTARTS="0"), str(tmp_path))
    code = batch.wait(LIMIT)
    out = output_of(tmp_path)
    assert code == 0, f"job output:\n{out}\n{slurm.logs()}"
    job = f"slurm-{batch.id}"
    records = sorted(read_records(tmp_path), key=lambda r: int(r["env"]["RANK"]))
    assert [int(r["env"]["RANK"]) for r in records] == [0, 1], out
    for r in records:
        assert r["sum"] == 3.0 and r["world"] == 2          # 1 + 2: both ranks took part
        assert r["env"]["TORCHELASTIC_RUN_ID"] == job
    assert sorted(r["env"]["GROUP_RANK"] for r in records) == ["0", "1"]
    # each node's agent and worker hold every CPU of their Slurm node (CPUs=the CPUs this test may use), not one
    for r in records:
        assert len(r["cpus"]) == len(os.sched_getaffinity(0)), f"worker {r['env']['RANK']} is bound to CPUs {r['cpus']}"
    # one agent per Slurm node, named after it
    assert "[node-agent n1]" in out and "[node-agent n2]" in out, out
    assert f"job {job} succeeded" in out
    # the job's own server stopped cleanly and its state dir went with it
    with open(tmp_path / f"rdzv-server-{batch.id}.log") as f:
        assert "rdzv-server stopped" in f.read()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("rdzv-state-")]


def test_sbatch_hands_back_the_exit_status_of_a_failed_job(slurm, tmp_path):
    env = job_env(tmp_path, MAX_RESTARTS="1", FAIL_RANK="1", FAIL_MODE="always")
    batch = slurm.sbatch([*NODES, "-o", str(tmp_path / "job.out"), SBATCH,
                          os.path.join(SCRIPTS, "allreduce.py")], env, str(tmp_path))
    code = batch.wait(LIMIT)
    out = output_of(tmp_path)
    # the agents' own status (1 for a failed job), not srun's 143 for the agent it stopped with SIGTERM
    assert code == 1, out
    assert "finished with exit status 1" in out
    job = f"slurm-{batch.id}"
    # rank 1 failed at the first attempt and at the one restart allowed, then the job failed
    assert f"job {job} failed: worker failures exceeded max_restarts=1" in out, out
    assert "planned failure of rank 1 at attempt 1" in out, out


def test_elastic_sbatch_carries_on_when_a_slurm_node_fails(slurm, tmp_path):
    env = job_env(tmp_path, MIN_NODES="1", STEP_SLEEP="0.1")
    batch = slurm.sbatch([*NODES, "--no-kill", "-o", str(tmp_path / "job.out"), SBATCH,
                          os.path.join(SCRIPTS, "elastic_loop.py")], env, str(tmp_path))
    try:
        def world_steps(size: int):
            return {r["rank"] for r in read_jsonl(tmp_path, "steps-") if r["kind"] == "step" and r["world"] == size}

        wait_until(lambda: world_steps(2) == {0, 1}, LIMIT, lambda: f"2-node world; out:\n{output_of(tmp_path)}")
        down = slurm.run("scontrol", "update", "nodename=n2", "state=down", "reason=test-node-failure")
        assert down.returncode == 0, down.stderr
        wait_until(lambda: world_steps(1) == {0}, LIMIT,
                   lambda: f"the 1-node world after n2 failed; out:\n{output_of(tmp_path)}")
        (tmp_path / "stop").touch()
        code = batch.wait(LIMIT)
    finally:
        if not batch.finished():
            batch.cancel()
        slurm.run("scontrol", "update", "nodename=n2", "state=resume")
    out = output_of(tmp_path)
    job = f"slurm-{batch.id}"
    assert code == 0, out
    assert f"but job {job} succeeded" in out        # srun reported the lost node; the job went on
    done = [r for r in read_jsonl(tmp_path, "steps-") if r["kind"] == "done"]
    assert [r["world"] for r in done] == [1], out
    wait_until(lambda: slurm.node_states().get("n2") == "idle", 30, "n2 back in service")


def agent_of(node: str, job_id: str):
    """The node-agent process srun started on this Slurm node for this job."""
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("SLURMD_NODENAME") == node and env.get("SLURM_JOB_ID") == job_id and \
                    any(part.endswith("node-agent") for part in proc.cmdline()[:2]):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return None


def test_fixed_size_job_ends_when_an_agent_dies_instead_of_waiting_for_its_node(slurm, tmp_path):
    # --join-timeout stays at 600 s: had srun not stopped the other agent, it would wait that long
    batch = slurm.sbatch([*NODES, "-o", str(tmp_path / "job.out"), SBATCH,
                          os.path.join(SCRIPTS, "elastic_loop.py")], job_env(tmp_path), str(tmp_path))
    try:
        wait_until(lambda: {r["rank"] for r in read_jsonl(tmp_path, "steps-") if r["kind"] == "step"} == {0, 1},
                   LIMIT, lambda: f"the 2-node world; out:\n{output_of(tmp_path)}")
        victim = wait_until(lambda: agent_of("n2", batch.id), LIMIT, "n2's node-agent")
        victim.kill()
        code = batch.wait(LIMIT)
    finally:
        if not batch.finished():
            batch.cancel()
    out = output_of(tmp_path)
    assert code != 0 and f"finished with exit status {code}" in out, out
    assert not [r for r in read_jsonl(tmp_path, "steps-") if r["kind"] == "done"]   # nobody finished training
