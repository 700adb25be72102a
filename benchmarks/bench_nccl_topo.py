"""Does reusing NCCL's topology cut a restarted worker's process-group start (issue 54, part 6)?

A restarted worker makes its NCCL communicator afresh, and NCCL discovers the node's topology (PCI, NVLink, NICs)
each time. NCCL can write what it found (`NCCL_TOPO_DUMP_FILE`) and read it instead of discovering
(`NCCL_TOPO_FILE`). Each measure is a new process, as a restarted worker is: `init_process_group("nccl",
device_id=...)` (the communicator made at once), then one all-reduce, timed from before the call to the
all-reduce's completion; the CUDA context is made before the clock starts. Plain and reused runs alternate, after
one run that dumps the file. One rank per process (one GPU suffices: the figure is NCCL's own start; ranks of
one node discover in parallel). Without a GPU it says so and exits 0.

Run: python benchmarks/bench_nccl_topo.py [--runs 5]   (a Python with CUDA torch)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
import torch, torch.distributed as dist
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
torch.empty(1, device=device)
torch.cuda.synchronize()
t0 = time.perf_counter()
dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
x = torch.ones(1, device=device)
dist.all_reduce(x)
torch.cuda.synchronize()
took = time.perf_counter() - t0
dist.destroy_process_group()
print(json.dumps({"group_s": took}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one(env_extra: dict[str, str]) -> float:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **env_extra)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the measure failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["group_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="measures of each, alternated")
    args = p.parse_args()
    if not any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev")):
        print("no NVIDIA GPU here (/dev/nvidia*): nothing to measure")
        return
    with tempfile.TemporaryDirectory(prefix="nccl-topo-") as tmp:
        topo = os.path.join(tmp, "topo.xml")
        dumped = one({"NCCL_TOPO_DUMP_FILE": topo})
        if not os.path.exists(topo):
            print(f"NCCL wrote no topology file (NCCL_TOPO_DUMP_FILE); the dumping run took {dumped:.3f} s")
            return
        times: dict[str, list[float]] = {"discovered": [], "from the file": []}
        for _ in range(args.runs):
            times["discovered"].append(one({}))
            times["from the file"].append(one({"NCCL_TOPO_FILE": topo}))
    for kind, seconds in times.items():
        print(f"NCCL process group + first all-reduce, topology {kind}: median {statistics.median(seconds):.3f} s "
              f"({min(seconds):.3f}-{max(seconds):.3f}, {len(seconds)} runs)")
    saved = statistics.median(times["discovered"]) - statistics.median(times["from the file"])
    print(f"RESULT reusing the topology saves {saved:.3f} s of a restarted worker's process-group start")


if __name__ == "__main__":
    main()
