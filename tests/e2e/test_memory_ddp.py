"""End-to-end: real torch DDP (gloo), 2 agents x 2 workers, one rank crashes once; the restarted ranks resume
from the in-memory snapshot taken by the one call `protect(model, opt, every=N)` (examples/train_ddp.py
--snapshot-every) without reading the disk checkpoint, and from disk when there is no memory directory; and the
weights trained after resuming from memory are those trained after resuming from a disk checkpoint of that step."""
from __future__ import annotations

import os
import re

import pytest
import torch

from protocol.restarts import PHASES
from tests.e2e.harness import ROOT, Gate, job_events, job_view, wait_until

pytestmark = pytest.mark.e2e
TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")
RESUMED = re.compile(r"rank \d: resumed from step -?\d+ \(\w+\)")


def start_job(cluster, job: str, train_args: list[str], *agent_flags: str, nproc: int = 2) -> list:
    """Job `job`'s two agents (nodes JOB-a and JOB-b), started; a second job may run beside it."""
    if cluster.server is None:
        cluster.start_server()
    return [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", str(nproc), "--job-id", job,
                          "--max-restarts", "1", "--node-id", f"{job}-{name}", *agent_flags, TRAIN, *train_args,
                          name=f"{job}-{name}")
            for name in ("a", "b")]


def resumes(agents: list) -> list[str]:
    """Once every agent exited 0: the lines `rank R: resumed from step S (SOURCE)` of every attempt."""
    for agent in agents:
        assert agent.wait(180) == 0, agent.output
    return [m.group(0) for a in agents for m in RESUMED.finditer(a.output)]


def run_job(cluster, tmp_path, job: str, train_args: list[str], *agent_flags: str, nproc: int = 2) -> list[str]:
    """The lines `rank R: resumed from step S (SOURCE)` of every attempt."""
    return resumes(start_job(cluster, job, train_args, *agent_flags, nproc=nproc))


def grown(cluster, script: list[str]) -> str:
    """The output of an elastic job (2:3 nodes, one worker each, job id "grow") that grows once a third node is
    ready, after the first two stepped past their second snapshot (one every 5 steps). The third starts with
    them, its warm interpreter held back at its last preload (a module that waits on a FIFO) until then: started
    late, its imports (a framework's: seconds on a loaded machine) could outlast the others' training."""
    cluster.start_server()
    gate = Gate(cluster.temp_dir())

    def agent(name: str, *extra: str, env: dict[str, str] | None = None):
        return cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2:3", "--nproc", "1", "--job-id", "grow",
                             "--max-restarts", "1", "--last-call", "1", "--node-id", f"grow-{name}", *extra, *script,
                             name=f"grow-{name}", env=env)
    agents = [agent("a"), agent("b"),
              agent("c", *gate.flags(script[0]), env=gate.env)]
    wait_until(lambda: (job_view(cluster, "grow", missing_ok=True) or {}).get("progress", {}).get("steps", 0) >= 12,
               180, "the first two nodes' steps past their second snapshot")
    wait_until(gate.opened, 180, "grow-c's warm interpreter at its gate")
    for a in agents:
        assert a.wait(300) == 0, a.output
    return "".join(a.output for a in agents)


def crash_at_10(tmp_path) -> list[str]:
    """Snapshots in memory every 3 steps, on disk every 8; rank 1 crashes at step 10."""
    return ["--steps", "12", "--crash-rank", "1", "--crash-step", "10", "--snapshot-every", "3",
            "--disk-every", "8", "--ckpt-dir", str(tmp_path / "ckpt"), "--width", "32", "--depth", "2"]


def test_restarted_ranks_resume_from_memory_not_disk(cluster, tmp_path):
    resumed = run_job(cluster, tmp_path, "ddp", crash_at_10(tmp_path))
    first = [line for line in resumed if "(scratch)" in line]
    again = [line for line in resumed if "(scratch)" not in line]
    assert len(first) == 4, resumed                       # the first attempt started from nothing
    # 9 steps done is the newest snapshot in memory (rank 1 crashed in its 11th); the disk held 8, which no rank read
    assert sorted(again) == [f"rank {r}: resumed from step 9 (memory)" for r in range(4)], resumed
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-8.pt"]
    # Where the restart's time went, on the node the job waited for: the phases these workers pass took time (no
    # CUDA here; the new round and the script's own set-up may take well under a millisecond), and the phases add
    # up to no more than the job's cost but for how far apart two nodes note the same synchronous step: each
    # worker notes it when the scheduler runs it again (14 ms apart once in CI on 2 cores), the job's cost spans
    # the nodes' newest last step to the first node's first step, the anatomy one node's own. That the phases
    # split a node's span exactly is tests/unit/test_anatomy.py's to show.
    progress = job_view(cluster, "ddp")["progress"]
    cost = progress["costs"][-1]
    anatomy = cost["anatomy"]
    assert cost["anatomy_node"] in ("ddp-a", "ddp-b") and anatomy["cuda"] == 0.0, cost
    assert all(anatomy[p] > 0 for p in ("stop", "start", "group", "restore", "first_step")), cost
    assert sum(anatomy[p] for p in PHASES) <= cost["cost_s"] + 0.05, cost


def test_without_a_memory_directory_they_resume_from_disk(cluster, tmp_path):
    resumed = run_job(cluster, tmp_path, "ddp", crash_at_10(tmp_path), "--no-memory-dir")
    again = [line for line in resumed if "(scratch)" not in line]
    assert sorted(again) == [f"rank {r}: resumed from step 8 (disk)" for r in range(4)], resumed


def test_a_memory_resume_trains_the_weights_a_disk_resume_does(cluster, tmp_path):
    """The issue's case: rank 3 crashes in step 27 with a snapshot every 5 steps. Every rank resumes at step 25
    from memory; a second job, without memory, resumes from its disk checkpoint of step 25. The same final weights
    (AdamW: its moments and step count are restored too), to the last bits: the memory resume reduces its first
    step in the bucket layout DDP had rebuilt (an uninterrupted run's, bit for bit: the test below), the disk one
    in a new DDP's first layout, which with 4 ranks adds the gradients in another order (about 1e-8)."""
    common = ["--steps", "32", "--crash-rank", "3", "--crash-step", "27", "--width", "16", "--depth", "2",
              "--optimizer", "adamw"]
    both = [start_job(cluster, "mem", [*common, "--snapshot-every", "5", "--final", str(tmp_path / "m.pt")]),
            start_job(cluster, "disk", [*common, "--snapshot-every", "5", "--disk-every", "25", "--ckpt-dir",
                                        str(tmp_path / "ckpt"), "--final", str(tmp_path / "d.pt")], "--no-memory-dir")]
    memory, disk = (resumes(agents) for agents in both)        # the two jobs side by side
    assert sorted(x for x in memory if "scratch" not in x) == [f"rank {r}: resumed from step 25 (memory)"
                                                              for r in range(4)], memory
    assert sorted(x for x in disk if "scratch" not in x) == [f"rank {r}: resumed from step 25 (disk)"
                                                            for r in range(4)], disk
    from_memory, from_disk = torch.load(tmp_path / "m.pt"), torch.load(tmp_path / "d.pt")
    assert from_memory.keys() == from_disk.keys()
    assert all(torch.allclose(from_memory[k], from_disk[k], rtol=0, atol=1e-6) for k in from_memory), \
        "the weights differ"


@pytest.mark.parametrize("batches", ["generator", "global"])
def test_a_loop_that_draws_its_batches_resumes_bit_identical_to_an_uninterrupted_run(cluster, tmp_path, batches):
    """Each step's batch drawn before its forward, from a torch.Generator of the loop's own (in protect's `extra`)
    or the global RNG; rank 1 crashes in step 27, every rank resumes at 25 from memory and draws batch 25 again from
    the states the uninterrupted run drew it from, and the new DDP reduces in the bucket layout the uninterrupted one
    had rebuilt (with 4 ranks an all-reduce's sums depend on it): the final weights are that run's, bit for bit."""
    common = ["--steps", "32", "--width", "16", "--depth", "2", "--optimizer", "adamw", "--snapshot-every", "5",
              "--batches", batches]
    both = [start_job(cluster, f"crash-{batches}", [*common, "--crash-rank", "1", "--crash-step", "27", "--final",
                                                     str(tmp_path / "crashed.pt")]),
            start_job(cluster, f"whole-{batches}", [*common, "--final", str(tmp_path / "whole.pt")])]
    crashed, _ = (resumes(agents) for agents in both)          # the two jobs side by side
    assert sorted(x for x in crashed if "scratch" not in x) == [f"rank {r}: resumed from step 25 (memory)"
                                                               for r in range(4)], crashed
    resumed, whole = torch.load(tmp_path / "crashed.pt"), torch.load(tmp_path / "whole.pt")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole), "a resumed rank trained on another batch"


def test_a_flipped_bit_is_found_at_the_next_snapshot_and_every_replica_resumes_alike(cluster, tmp_path):
    """Silent data corruption: rank 2 of 3 (DDP, one worker per node) flips one bit of a weight after step 12.
    Its snapshot of step 15 digests other parameters than its replicas': the server names it, the round fails
    (restart 1, reason diverged), and every rank resumes from step 10, the newest all held alike. No spare: the
    job goes on with the same nodes and ends with every replica's parameters alike, bit for bit."""
    cluster.start_server()
    # KEEP 5: step 10's snapshot lives until step 35's begins (5 s), for step 15's digests to be compared, the
    # round failed and the workers stopped on a loaded machine
    args = ["--steps", "40", "--snapshot-every", "5", "--flip-rank", "2", "--flip-step", "12", "--width", "32",
            "--depth", "2", "--step-s", "0.25", "--keep", "5"]
    agents = [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "3", "--nproc", "1", "--job-id", "flip",
                            "--max-restarts", "2", "--node-id", f"flip-{name}", TRAIN, *args, name=f"flip-{name}")
              for name in ("a", "b", "c")]
    for agent in agents:
        assert agent.wait(180) == 0, agent.output
    out = "".join(a.output for a in agents)
    events = {e["kind"]: e["message"] for e in job_events(cluster, "flip")}
    assert "rank(s) 2 hold other parameters than the other 2 replicas at step 15" in events["replicas_diverged"], events
    assert "the job resumes from step 10" in events["replicas_diverged"]
    assert sorted(m.group(0) for m in RESUMED.finditer(out) if "scratch" not in m.group(0)) == \
        [f"rank {r}: resumed from step 10 (memory)" for r in range(3)], out
    assert "replicas alike at the end: yes" in out, out
    view = job_view(cluster, "flip")
    assert view["restart_count"] == 1 and view["progress"]["alike_step"] >= 10, view["progress"]


def test_an_hsdp_replica_that_diverges_is_named_within_its_shard_and_every_rank_resumes_alike(cluster, tmp_path):
    """HSDP (fully_shard on a replicate x shard mesh: 3 replicas of 2 shards, one per node; benchmarks/scripts/
    hsdp_flip.py): rank 2 flips one bit of its shard after step 12. Its shard's two other replicas agree, so it is
    named; the other shard's replicas are compared among themselves only; every rank resumes from step 10 and
    every shard's replicas end alike. (A root-only fully_shard model: protect's snapshot runs before FSDP2's
    unshard hook, else the first forward after a snapshot fails.)"""
    cluster.start_server()
    script = os.path.join(ROOT, "benchmarks", "scripts", "hsdp_flip.py")
    # KEEP 5: step 10's snapshot outlives step 30's, so a divergence found late on a loaded machine still has it
    env = {"REPLICAS": "3", "STEPS": "40", "STEP_S": "0.25", "FLIP": "2:12", "KEEP": "5"}
    agents = [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "3", "--nproc", "2", "--job-id", "hsdp",
                            "--max-restarts", "2", "--node-id", f"hsdp-{name}", script, name=f"hsdp-{name}", env=env)
              for name in ("a", "b", "c")]
    for agent in agents:
        assert agent.wait(180) == 0, agent.output
    out = "".join(a.output for a in agents)
    events = {e["kind"]: e["message"] for e in job_events(cluster, "hsdp")}
    assert "rank(s) 2 hold other parameters than the other replicas of their shard at step 15" in \
        events["replicas_diverged"], events
    # (said by protect, and by the script)
    assert sorted({m.group(0) for m in RESUMED.finditer(out) if "scratch" not in m.group(0)}) == \
        [f"rank {r}: resumed from step 10 (memory)" for r in range(6)], out
    assert "replicas alike at the end: yes" in out, out
    assert job_view(cluster, "hsdp")["restart_count"] == 1


def test_a_node_that_joins_a_growing_job_is_lent_a_replicas_snapshot_and_nobody_goes_back_to_scratch(cluster,
                                                                                                      tmp_path):
    """An elastic job (2:3 nodes, one DDP worker each) grows once a third node joins: the two running ranks hold
    snapshots, the newcomer none. Every rank resumes from the running ranks' newest snapshot, in memory (the
    newcomer lent it by the lowest holding rank, its RNG left as the script set it): not from step 0, as the
    minimum over all ranks was. The replicas train alike to the end."""
    # 100 steps: the third node joins some 15 steps past the second snapshot (resumed from 25 in runs here); each
    # step after that proves nothing more (160 spent 6 s more).
    out = grown(cluster, [TRAIN, "--steps", "100", "--snapshot-every", "5", "--width", "32", "--depth", "2",
                          "--step-s", "0.1", "--alike"])
    again = sorted(m.group(0) for m in RESUMED.finditer(out) if "scratch" not in m.group(0))
    steps = {int(line.split("step ")[1].split()[0]) for line in again}
    assert len(again) == 3 and len(steps) == 1 and steps.pop() >= 10, out       # one step, every rank, from memory
    assert all(line.endswith("(memory)") for line in again), out
    assert out.count("held no snapshot of step") == 1 and "resumes from rank 0's" in out, out   # the newcomer only
    assert "replicas alike at the end: yes" in out, out
    assert not [e for e in job_events(cluster, "grow") if e["kind"] == "replicas_diverged"]
