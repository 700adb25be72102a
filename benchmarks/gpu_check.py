"""`make gpu-check`: the GPU parts of node-agent on this node's real GPUs, with figures.

Without an NVIDIA GPU (no /dev/nvidia*) it says so in one line and exits 0. With one:
1. the built-in GPU check on the real NVML (what the agent runs before joining, before each restart and
   every 5 s): its time for every GPU, the median of 20 runs, and its verdict;
2. --numa-binding node: each local rank's CPU set from sysfs and NVML;
3. NCCL DDP under `node-agent --standalone --nproc-per-node gpu --numa-binding node`: the last rank
   crashes once; the time from the crash to the step running again, and each worker's CUDA context
   time and CPUs; then the same with --no-gpu-check (no NVML held by the agent), for the context time.
Record its output in docs/benchmarks.md. Run: make gpu-check [GPU_PYTHON=python with CUDA torch]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "scripts", "gpu_ddp.py")


def gpu_devices(dev: str) -> list[str]:
    """/dev/nvidia0, ... (read before importing anything: a node without a GPU needs no dependency)."""
    try:
        return [n for n in os.listdir(dev) if n.startswith("nvidia") and n[6:].isdigit()]
    except OSError:
        return []


def nvml_figures() -> Any:
    from node_agent.gpu.health import check_gpus
    from node_agent.gpu.nvml import NvmlReader, NvmlUnavailable
    reader = NvmlReader()
    try:
        reader.open()
        gpus = reader.devices()
    except NvmlUnavailable as exc:
        print(f"built-in GPU check: skipped: {exc}")
        return None
    indices = [g.index for g in gpus]
    times, verdict = [], None
    for _ in range(20):
        verdict = check_gpus(reader, indices)
        times.append(verdict.seconds)
    print(f"GPUs: {len(gpus)} ({', '.join(sorted({g.name for g in gpus}))})")
    print(f"built-in GPU check, {len(gpus)} GPU(s): median {statistics.median(times) * 1000:.1f} ms, "
          f"max {max(times) * 1000:.1f} ms over 20 runs (budget 100 ms for 8 GPUs); verdict: "
          f"{type(verdict).__name__}{': ' + getattr(verdict, 'reason', '') if getattr(verdict, 'reason', '') else ''}")
    return reader


def run_job(extra: list[str], label: str) -> bool:
    """One DDP job with a crash; True when it succeeded after its restart."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   GPU_CHECK_MARKER=os.path.join(tmp, "crashed"))
        argv = [sys.executable, "-m", "node_agent", "--standalone", "--nproc-per-node", "gpu", "--max-restarts",
                "1", *extra, WORKER]
        began = time.time()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        took = time.time() - began
    events = [json.loads(line.split("GPU-CHECK ", 1)[1]) for line in done.stdout.splitlines()
              if "GPU-CHECK " in line]
    crash = next((e for e in events if e["event"] == "crash"), None)
    again = [e for e in events if e["event"] == "first_step" and e["restart"] == 1]
    first = [e for e in events if e["event"] == "first_step" and e["restart"] == 0]
    print(f"{label}: exit {done.returncode} in {took:.1f} s")
    for e in first + again:
        print(f"  attempt {e['restart']} rank {e['rank']}: CUDA context {e['ctx_s']:.3f} s, CPUs {e['cpus']}")
    if crash is not None and again:
        print(f"  crash -> step again (every rank): {max(e['t'] for e in again) - crash['t']:.2f} s")
    if done.returncode != 0:
        print("  agent's last lines: " + " | ".join(done.stderr.strip().splitlines()[-5:]))
    return done.returncode == 0 and crash is not None and bool(again)


def main() -> int:
    dev = os.environ.get("GPU_CHECK_DEV", "/dev")
    devices = gpu_devices(dev)
    if not devices:
        print(f"gpu-check: no NVIDIA GPU on this node (no {dev}/nvidia*): nothing to check")
        return 0
    sys.path.insert(0, ROOT)
    from node_agent.gpu.node import survey
    reader = nvml_figures()
    gpus = survey(len(devices), os.environ, reader=reader, numa_binding="node")
    for line in (*gpus.lines, *gpus.warnings):
        print(line)
    if reader is not None:
        reader.close()
    ok = [run_job(["--numa-binding", "node"], "NCCL DDP, --numa-binding node, GPU check on (NVML held by the agent)"),
          run_job(["--no-gpu-check"], "NCCL DDP, --no-gpu-check (no NVML held)")]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
