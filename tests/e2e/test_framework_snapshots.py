"""End-to-end: the one-line snapshots of Lightning (examples/train_lightning.py) and transformers' Trainer
(examples/train_hf.py), 2 agents x 2 gloo workers. A rank crashes when 27 optimizer steps are done, with a
snapshot every 5: every rank resumes at step 25 from memory, and the final weights are those of the same job
resumed by Lightning itself from its own checkpoint of step 25, and for the Trainer those of a job that never
crashed."""
from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from tests.e2e.harness import ROOT, job_events, job_view, wait_until
from tests.e2e.test_memory_ddp import grown
from tests.e2e.test_peer_copies import remove_memory

pytestmark = pytest.mark.e2e
STARTED = re.compile(r"rank (\d): training from step (\d+)")
RESUMED = re.compile(r"rank \d: resumed from step \d+ \(memory\)")


def start_job(cluster, job: str, script: str, train_args: list[str], *agent_flags: str) -> list:
    """Job `job`'s two agents (nodes JOB-a and JOB-b), started; a second job may run beside it."""
    if cluster.server is None:
        cluster.start_server()
    return [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", "2", "--job-id", job,
                          "--max-restarts", "1", "--node-id", f"{job}-{name}", *agent_flags,
                          os.path.join(ROOT, "examples", script), *train_args, name=f"{job}-{name}")
            for name in ("a", "b")]


def output(agents: list) -> str:
    """Once every agent exited 0: their output."""
    for agent in agents:
        assert agent.wait(300) == 0, agent.output
    return "".join(a.output for a in agents)


def starts(output: str) -> list[int]:
    """The step each rank's attempts started training from, sorted."""
    return sorted(int(m.group(2)) for m in STARTED.finditer(output))


def same_weights(a, b) -> bool:
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("script, reference", [("train_lightning.py", "disk"), ("train_hf.py", "uninterrupted")])
def test_a_crash_resumes_from_the_snapshot_as_the_framework_would(cluster, tmp_path, script, reference):
    """Lightning's own resume (fit(ckpt_path=...)) is the reference for its snapshot: it replays a plain
    DataLoader's epoch from its start and restores no RNG state, so neither resume is an uninterrupted run's. The
    Trainer's resume skips the batches done and restores the RNG states: its snapshot resume is bit-identical to
    a run that never crashed."""
    crash = ["--steps", "32", "--crash-rank", "3", "--crash-step", "27"]
    other = [*crash, "--disk-every", "25", "--ckpt-dir", str(tmp_path / "ckpt")] if reference == "disk" \
        else ["--steps", "32", "--snapshot-every", "5"]
    both = [start_job(cluster, "mem", script, [*crash, "--snapshot-every", "5", "--final", str(tmp_path / "m.pt")]),
            start_job(cluster, reference, script, [*other, "--final", str(tmp_path / "r.pt")])]
    memory, other_out = (output(agents) for agents in both)      # the two jobs side by side
    assert starts(memory) == [0, 0, 0, 0, 25, 25, 25, 25], memory
    # no warning of the example's own making on every rank (GPT-2's token ids outside its small vocabulary)
    assert "within the vocabulary" not in memory, memory
    assert len(RESUMED.findall(memory)) == 4, memory
    # DDP's parameters compared at each snapshot: alike, bit for bit
    assert job_view(cluster, "mem")["progress"].get("alike_step", -1) >= 5
    assert not [e for e in job_events(cluster, "mem") if e["kind"] == "replicas_diverged"]
    assert starts(other_out) == ([0, 0, 0, 0, 25, 25, 25, 25] if reference == "disk" else [0, 0, 0, 0]), other_out
    assert same_weights(tmp_path / "m.pt", tmp_path / "r.pt"), f"the weights differ from the {reference} run's"


def test_fsdp2_shards_resume_as_if_never_stopped(cluster, tmp_path):
    """FSDP2 on 2 nodes x 2 ranks: each rank snapshots its shards; rank 2 crashes when 7 steps are done and every
    rank resumes at 6 from its own shard. The weights equal a run that never crashed, bit for bit."""
    script = os.path.join(ROOT, "tests", "e2e", "scripts", "fsdp_train.py")
    cluster.start_server()
    jobs = {}
    for job, crash in (("crash", "2"), ("whole", "-1")):      # the two jobs side by side
        env = {"CRASH_RANK": crash, "CRASH_STEP": "7", "FINAL": str(tmp_path / f"{job}.pt")}
        jobs[job] = [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", "2", "--job-id", job,
                                   "--max-restarts", "1", "--node-id", f"{job}-{n}", script, name=f"{job}-{n}",
                                   env=env) for n in ("a", "b")]
    outputs = {job: output(agents) for job, agents in jobs.items()}
    assert starts(outputs["crash"]) == [0, 0, 0, 0, 6, 6, 6, 6], outputs["crash"]
    assert starts(outputs["whole"]) == [0, 0, 0, 0], outputs["whole"]
    assert same_weights(tmp_path / "crash.pt", tmp_path / "whole.pt"), "the weights differ"


def test_a_lost_nodes_replacement_resumes_lightning_from_the_peers_copy(cluster, tmp_path):
    """2 nodes (each its own failure domain) + a ready spare, Lightning with a snapshot every 5 steps. Group rank 1's
    agent is SIGKILLed once its snapshots are copied to its peer, and its memory removed: the spare takes its place
    and every rank resumes from the same step in memory (the spare's ranks from the fetched copy), not from 0."""
    cluster.start_server()
    script = os.path.join(ROOT, "examples", "train_lightning.py")
    fast = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")

    def start(node: str):
        return cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", "2", "--job-id", "lost",
                             "--max-restarts", "2", "--node-id", node, "--failure-domain", f"rack-{node}", *fast,
                             script, "--steps", "80", "--step-s", "0.1", "--snapshot-every", "5", name=node)

    # 80 steps: the loss comes at step 10-15 (every rank resumed from 10 in runs here), and each step after the
    # resume proves nothing more (150 spent 7 s more).
    # all three at once (started once training had, the spare's imports could outlast it on a loaded machine):
    # the two first ready train, the third waits as the spare
    agents = {n: start(n) for n in ("a", "b", "s")}
    wait_until(lambda: STARTED.findall("".join(a.output for a in agents.values())), 120, "training started")
    [spare] = set(agents) - {n["node_id"] for n in job_view(cluster, "lost")["nodes"]}
    agents[spare].wait_for_line(r"ready after", 120)
    lost = next(n["node_id"] for n in job_view(cluster, "lost")["nodes"] if n["group_rank"] == 1)
    wait_until(lambda: next(n for n in job_view(cluster, "lost")["nodes"] if n["node_id"] == lost)
               .get("copies", {}).get("copied_step", -1) >= 10, 120, f"node {lost}'s copies of step 10 or later")
    before = {n: len(a.output) for n, a in agents.items()}
    os.kill(agents[lost].pid, signal.SIGKILL)
    agents[lost].wait(60)
    remove_memory("lost", lost)                 # its host's memory is gone with it
    for node, agent in agents.items():
        if node != lost:
            assert agent.wait(300) == 0, agent.output
    after = "".join(a.output[before[n]:] for n, a in agents.items() if n != lost)
    resumed = sorted(int(m.group(1)) for m in re.finditer(r"rank \d: resumed from step (\d+) \(memory\)", after))
    assert len(resumed) == 4 and len(set(resumed)) == 1 and resumed[0] >= 10, after
    assert sorted(int(m.group(2)) for m in STARTED.finditer(after)) == resumed, after


@pytest.mark.parametrize("script", ["train_lightning.py", "train_hf.py"])
def test_a_node_that_joins_a_growing_job_resumes_with_the_others_from_a_replicas_snapshot(cluster, tmp_path, script):
    """An elastic job (2:3 nodes, one DDP worker each) grows once a third node joins: the newcomer holds no
    snapshot, and is lent a running rank's, as the framework's own single checkpoint file would be every rank's;
    every rank of the grown job trains on from that step, none from step 0."""
    # 150 steps: the third node joins 10-20 steps past the second snapshot (resumed from 25-30 in runs here, a
    # restart's set-up included); each step after that proves nothing more (300 spent 9-11 s more).
    out = grown(cluster, [os.path.join(ROOT, "examples", script), "--steps", "150", "--snapshot-every", "5",
                          "--step-s", "0.05"])
    again = starts(out)[2:]                  # the first two ranks' first attempt began at 0
    assert starts(out)[:2] == [0, 0] and len(again) == 3 and len(set(again)) == 1 and again[0] >= 10, out
    assert out.count("held no snapshot of step") == 1, out          # the newcomer only: rank 1 held it
    assert not [e for e in job_events(cluster, "grow") if e["kind"] == "replicas_diverged"]
