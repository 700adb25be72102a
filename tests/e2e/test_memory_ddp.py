"""End-to-end: real torch DDP (gloo), 2 agents x 2 workers, rank 1 crashes once; the restarted ranks resume
from the in-memory snapshot (examples/train_ddp.py --snapshot-every) without reading the disk checkpoint,
and from disk when there is no memory directory."""
from __future__ import annotations

import os
import re

import pytest

from tests.e2e.harness import ROOT

pytestmark = pytest.mark.e2e
TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")


def run_job(cluster, tmp_path, *agent_flags: str) -> list[str]:
    """Snapshots in memory every 3 steps, on disk every 8; rank 1 crashes at step 10. The lines
    `rank R: resumed from step S (SOURCE)` of every attempt."""
    cluster.start_server()
    args = ["--steps", "12", "--crash-rank", "1", "--crash-step", "10", "--snapshot-every", "3",
            "--disk-every", "8", "--ckpt-dir", str(tmp_path / "ckpt"), "--width", "32", "--depth", "2"]
    agents = [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", "2", "--job-id", "ddp",
                            "--max-restarts", "1", "--node-id", name, *agent_flags, TRAIN, *args, name=name)
              for name in ("node-a", "node-b")]
    for agent in agents:
        assert agent.wait(180) == 0, agent.output
    return [m.group(0) for a in agents for m in re.finditer(r"rank \d: resumed from step -?\d+ \(\w+\)", a.output)]


def test_restarted_ranks_resume_from_memory_not_disk(cluster, tmp_path):
    resumed = run_job(cluster, tmp_path)
    first = [line for line in resumed if "(scratch)" in line]
    again = [line for line in resumed if "(scratch)" not in line]
    assert len(first) == 4, resumed                       # the first attempt started from nothing
    # step 9 is the newest snapshot in memory; the disk held step 8, which no rank read
    assert sorted(again) == [f"rank {r}: resumed from step 9 (memory)" for r in range(4)], resumed
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-0.pt", "step-8.pt"]


def test_without_a_memory_directory_they_resume_from_disk(cluster, tmp_path):
    resumed = run_job(cluster, tmp_path, "--no-memory-dir")
    again = [line for line in resumed if "(scratch)" not in line]
    assert sorted(again) == [f"rank {r}: resumed from step 8 (disk)" for r in range(4)], resumed
