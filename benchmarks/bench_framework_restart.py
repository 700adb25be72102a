"""Crash -> every rank stepping again in Lightning and transformers' Trainer (issue 54): a real server and 2 agents x
2 gloo workers run examples/train_lightning.py or examples/train_hf.py; global rank 3 crashes when 27 optimizer
steps are done. Each run resumes either from memory (`--snapshot-every 5`: Snapshots / protect_trainer) or from the
framework's own disk checkpoint (`--disk-every 5`, `fit(ckpt_path=...)` / `resume_from_checkpoint`), and from
memory with warm workers preloading torch only (as before they preloaded the script's imports), alternated.

The figures are the server's own (GET /v1/jobs/JOB, progress.costs): the restart's cost (the job's last step
before it to its first after it) and its anatomy on the node the job waited for: the time until that node's last
rank stepped again (every rank stepping), phase by phase. Printed per run and as medians; nothing is asserted.

Run: .venv/bin/python benchmarks/bench_framework_restart.py [--scripts lightning,hf] [--runs 3]
     (make bench-framework-restart). AGENT_ARGS="--warm-workers off" to compare cold workers.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _server import ROOT, running_server  # noqa: E402

SCRIPTS = {"lightning": "train_lightning.py", "hf": "train_hf.py"}
PHASES = ("stop", "rendezvous", "start", "setup", "cuda", "group", "restore", "first_step")


# How each run resumes, and the agents' own flags for it: "torch-only" preloads what warm workers preloaded
# before they preloaded the script's own imports (--warm-preload given: exactly that list).
VARIANTS = {"memory": ("memory", []), "disk": ("disk", []),
            "memory-torch-only": ("memory", ["--warm-preload", "torch,torch.distributed,torch.nn,torch.optim,"
                                                               "torch._dynamo"])}


def one_run(port: int, job: str, script: str, variant: str, extra: list[str]) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix="bench-fw-")
    resume, flags = VARIANTS[variant]
    extra = [*flags, *extra]
    args = ["--steps", "32", "--crash-rank", "3", "--crash-step", "27"]
    args += ["--snapshot-every", "5"] if resume == "memory" else ["--disk-every", "5", "--ckpt-dir", work]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    agents = [subprocess.Popen([sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{port}",
                                "--nnodes", "2", "--nproc", "2", "--job-id", job, "--max-restarts", "1",
                                "--node-id", f"{job}-{name}", *extra, os.path.join(ROOT, "examples", script), *args],
                               env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for name in ("a", "b")]
    outs = [a.communicate(timeout=600)[1] for a in agents]
    if any(a.returncode for a in agents):
        raise SystemExit(f"{job}: an agent failed: {outs[0][-1500:]}\n{outs[1][-1500:]}")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/jobs/{job}", timeout=10) as reply:
        costs = json.load(reply)["progress"]["costs"]
    if not costs or costs[-1]["cost_s"] is None or costs[-1]["anatomy"] is None:
        raise SystemExit(f"{job}: no measured restart: {costs}")
    cost, anatomy = costs[-1]["cost_s"], costs[-1]["anatomy"]
    return {"first_rank": cost, "every_rank": sum(anatomy[p] for p in PHASES),
            **{p: anatomy[p] for p in PHASES}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scripts", default="lightning,hf")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", default="memory,disk,memory-torch-only", help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args()
    extra = shlex.split(os.environ.get("AGENT_ARGS", ""))
    figures: dict[str, dict[str, dict[str, float]]] = {}
    with running_server() as port:
        for name in args.scripts.split(","):
            runs: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants.split(",")}
            for i in range(args.runs):
                for resume in runs:              # alternated: memory, disk, ..., memory, disk ...
                    got = one_run(port, f"{name}-{resume}-{i}", SCRIPTS[name], resume, extra)
                    runs[resume].append(got)
                    print(f"{name} {resume} run {i}: every rank stepping {got['every_rank']:.2f} s (first rank "
                          f"{got['first_rank']:.2f} s): " + ", ".join(f"{k} {got[k]:.2f}" for k in PHASES),
                          flush=True)
            figures[name] = {resume: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
                             for resume, rs in runs.items()}
            for resume, f in figures[name].items():
                print(f"{name} {resume} (median of {args.runs}): every rank stepping {f['every_rank']:.2f} s, "
                      f"first rank {f['first_rank']:.2f} s; " + ", ".join(f"{k} {f[k]:.2f}" for k in PHASES),
                      flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
