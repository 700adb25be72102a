"""A job where one node has no memory directory (its agent runs with --no-memory-dir) and the others have: every rank
calls `protect`, and the ranks must make the same collectives (a review: the rank without one skipped the agreement,
met the others' with its training's all_reduce, and every rank aborted on a "collective mismatch" at every restart).
Two gloo processes on 127.0.0.1; rank 0 has a memory directory holding a snapshot, rank 1 none."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
from torch import nn
from node_agent.training import protect
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = protect(model, opt, every=1, fallback=lambda: 7) if sys.argv[3:] != ["skip"] else 7
t = torch.ones(1)
dist.all_reduce(t)                  # the training's first collective
print(f"rank {rank}: start {start}, sum {t.item():g}", flush=True)
dist.barrier()                      # both done before either leaves
os._exit(0)                         # gloo's teardown at exit aborts a rank now and then (not what is tested here)
"""


def both_ranks(script, port: int, envs: list[dict[str, str]], skip: int = -1) -> list[str]:
    """Ranks 0 and 1 run `script` with their own environments (rank `skip` does not call protect); their output,
    once both exited 0."""
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port), *(["skip"] if rank == skip else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=envs[rank])
             for rank in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung: " + "\n".join(q.communicate()[0] for q in procs)) from None
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs


def test_a_rank_without_a_memory_directory_agrees_with_the_others_on_the_fallback(tmp_path) -> None:
    """Rank 1's node runs --no-memory-dir: its agent gives it an empty $NODE_AGENT_MEMORY_DIR."""
    port = free_port()
    where = tmp_path / "mem"
    where.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("NODE_AGENT_MEMORY_DIR", None)
    # A snapshot of step 3 in rank 0's directory, written by protect itself (a run of one rank, no process group)
    seed = tmp_path / "seed.py"
    seed.write_text("import torch\nfrom torch import nn\nfrom node_agent.training import protect\n"
                    "model = nn.Linear(4, 4); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                    "protect(model, opt, every=3)\n"
                    "for _ in range(4):\n    model(torch.ones(4)).sum().backward(); opt.step()\n")
    subprocess.run([sys.executable, str(seed)], env={**env, "NODE_AGENT_MEMORY_DIR": str(where)}, check=True,
                   timeout=120)
    assert "step-3" in os.listdir(where)
    outs = both_ranks(script, port, [{**env, "NODE_AGENT_MEMORY_DIR": str(where)},
                                     {**env, "NODE_AGENT_MEMORY_DIR": ""}])     # rank 1's node: --no-memory-dir
    # Neither resumes a snapshot only rank 0 holds: both take the fallback, and their collectives line up
    assert "rank 0: start 7, sum 2" in outs[0] and "rank 1: start 7, sum 2" in outs[1], outs
    assert "a rank of the job has no memory directory" in outs[0], outs[0]
    # Its step 3 is not the job's future: left there, it would outlive the fallback's snapshots (the keep rule drops
    # those) and be resumed at the next restart where every rank has a memory directory
    assert "step-3" not in os.listdir(where), os.listdir(where)


def test_not_under_node_agent_protect_adds_no_collective(tmp_path) -> None:
    """Under torchrun (no $NODE_AGENT_MEMORY_DIR on any rank) the script runs as it would without us: protect asks
    the other ranks nothing, so a rank that does not call it (here rank 1) meets rank 0 at the training's own first
    collective."""
    port = free_port()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("NODE_AGENT_MEMORY_DIR", None)
    outs = both_ranks(script, port, [env, env], skip=1)
    assert "rank 0: start 7, sum 2" in outs[0] and "rank 1: start 7, sum 2" in outs[1], outs
