"""A crash right after a snapshot, in a cold worker (Python's full exit): the snapshot being written is kept.

Python's shutdown refuses new futures (concurrent.futures' exit hook) before it waits for the write's thread,
so a write that had not yet handed its hashes to its threads lost the snapshot: on a GPU, where the write first
waits for the copies to the host, that was the usual case. The script here holds the write back until the
refusal is in force, then lets it go on."""
from __future__ import annotations

import os
import subprocess
import sys

from node_agent.training import snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CRASHING = """
import concurrent.futures.thread as futures, sys, time
import torch
from node_agent.training import layout
from node_agent.training.capture import Capture

hashes = layout.digests

def after_the_refusal(*args, **kwargs):
    deadline = time.monotonic() + 60
    while not futures._shutdown and time.monotonic() < deadline:     # Python's shutdown has begun
        time.sleep(0.01)
    return hashes(*args, **kwargs)

layout.digests = after_the_refusal
capture = Capture(sys.argv[1])
capture.take(7, {"a": torch.ones(12 << 20), "b": torch.full((12 << 20,), 2.0)})   # 96 MiB: hashed by threads
raise RuntimeError("the crash right after the snapshot")
"""


def test_a_snapshot_written_while_a_cold_worker_ends_is_kept(tmp_path) -> None:
    where = tmp_path / "memory"
    where.mkdir()
    done = subprocess.run([sys.executable, "-c", CRASHING, str(where)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert done.returncode == 1 and "the crash right after the snapshot" in done.stderr, done.stderr
    assert "not written" not in done.stderr, done.stderr
    assert snapshot.steps(str(where)) == [7], done.stderr
