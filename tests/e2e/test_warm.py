"""Warm workers end to end: a real agent, its zygote, real workers (torch where it is the point)."""
from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.e2e.harness import ROOT, SCRIPTS, pid_gone

pytestmark = pytest.mark.e2e
PROBE = os.path.join(SCRIPTS, "warm_probe.py")
TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")


def test_warm_workers_die_with_a_sigkilled_agent(cluster):
    agent = cluster.agent("--standalone", "--nproc", "1", "--max-restarts", "20", "--warm-preload", "json", PROBE)
    found = agent.wait_for_line(r"warm worker pid (\d+) parent (\d+)")
    worker, zygote = int(found.group(1)), int(found.group(2))
    assert psutil.Process(zygote).ppid() == agent.pid          # the zygote is the agent's child
    assert "1 of 1 workers started warm" in agent.output
    os.kill(agent.pid, signal.SIGKILL)
    assert pid_gone(zygote, 30), "the zygote outlived its agent"
    assert pid_gone(worker, 30), "a warm worker outlived its agent"


def test_warm_workers_off_starts_every_worker_cold(cluster, tmp_path):
    agent = cluster.agent("--standalone", "--nproc", "1", "--max-restarts", "1", "--warm-workers", "off", PROBE)
    assert agent.wait() != 0, agent.output          # never warm: it fails every attempt
    assert "started warm" not in agent.output


def test_real_ddp_training_recovers_from_a_crash_on_warm_workers(cluster):
    pytest.importorskip("torch")
    agent = cluster.agent("--standalone", "--nproc", "2", "--max-restarts", "1", TRAIN, "--crash-rank", "1")
    assert agent.wait(300) == 0, agent.output
    out = agent.output
    assert "injected crash on rank 1" in out and "training done: 20 steps on 2 workers" in out
    assert "2 of 2 workers started warm" in out, out          # the restart forked both from the zygote
