"""Crash -> every rank stepping again, warm workers against cold, on one node (node-agent --standalone).

    python benchmarks/bench_warm_restart.py [--runs 3] [--nproc 2]

Each run starts node-agent with benchmarks/scripts/warm_probe_ddp.py (real torch DDP on gloo); rank 1
crashes on attempt 0. From the workers' own time stamps it prints, per run, the parts of the recovery:
restart (crash -> the restarted worker's first line of code: the old workers' exit, the new round, the
spawn and, cold, the interpreter's start), import, process group (init_process_group), first step. For warm
runs it also prints the zygote's memory while the restarted workers run (RSS, PSS, USS). Figures only:
nothing is asserted. The load average is printed with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "benchmarks", "scripts", "warm_probe_ddp.py")
PARTS = ("restart", "import", "group", "step", "total")
RESTART = ("exit_seen", "stop_round", "spawn")


def one_run(mode: str, nproc: int) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix="warm_bench_")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-m", "node_agent.main", "--standalone", "--nproc", str(nproc), "--max-restarts", "1",
            "--warm-workers", mode, PROBE, out]
    agent = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said: dict[str, float] = {}   # when the agent said it: its lines, time-stamped as they come

    def listen() -> None:
        assert agent.stderr is not None
        for line in agent.stderr:
            for key, needle in (("seen", "failed with"), ("round2", "round 2:")):
                if needle in line and key not in said:
                    said[key] = time.time()

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    memory: dict[str, float] = {}
    try:
        first = os.path.join(out, "r0-a1.json")
        deadline = time.time() + 240
        while not os.path.exists(first) and time.time() < deadline and agent.poll() is None:
            time.sleep(0.05)
        if os.path.exists(first) and mode == "auto":
            with open(first) as f:
                parent = psutil.Process(json.load(f)["ppid"])
            if parent.pid != agent.pid:   # forked by the zygote
                info = parent.memory_full_info()
                memory = {"zygote_rss_mib": info.rss / 2**20, "zygote_pss_mib": info.pss / 2**20,
                          "zygote_uss_mib": info.uss / 2**20}
        open(os.path.join(out, "done"), "w").close()
        agent.wait(240)
    finally:
        if agent.poll() is None:
            agent.kill()
        reader.join(10)
    with open(os.path.join(out, "crash.json")) as f:
        crash = json.load(f)["crash"]
    ranks = []
    for rank in range(nproc):
        with open(os.path.join(out, f"r{rank}-a1.json")) as f:
            ranks.append(json.load(f))
    warm = all(r["ppid"] != agent.pid for r in ranks)
    return {"warm": float(warm), "restart": max(r["began"] for r in ranks) - crash,
            "import": max(r["imported"] - r["began"] for r in ranks),
            "group": max(r["grouped"] - r["imported"] for r in ranks),
            "step": max(r["stepped"] - r["grouped"] for r in ranks),
            "total": max(r["stepped"] for r in ranks) - crash, **memory,
            # the restart's own parts: the crashed worker's exit seen by the agent; the others stopped, the
            # failure reported and the next round formed; the next round's workers started and running code
            "exit_seen": said.get("seen", crash) - crash, "stop_round": said.get("round2", 0) - said.get("seen", 0),
            "spawn": max(r["began"] for r in ranks) - said.get("round2", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {"auto": [], "off": []}
    for _ in range(args.runs):
        for mode in ("auto", "off"):   # pairs, so that both see the same load
            r = one_run(mode, args.nproc)
            results[mode].append(r)
            print(f"{'warm' if mode == 'auto' else 'cold'} (forked: {bool(r['warm'])}): "
                  + "  ".join(f"{k} {r[k]:.2f}s" for k in PARTS)
                  + "  (" + "  ".join(f"{k} {r[k]:.2f}s" for k in RESTART) + ")"
                  + "".join(f"  {k} {v:.0f}" for k, v in r.items() if k.startswith("zygote")), flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for mode, rs in results.items():
        print(f"{'warm' if mode == 'auto' else 'cold'} median: "
              + "  ".join(f"{k} {statistics.median(r[k] for r in rs):.2f}s "
                          f"({min(r[k] for r in rs):.2f}-{max(r[k] for r in rs):.2f})" for k in (*PARTS, *RESTART)))
    medians = {mode: statistics.median(r["total"] for r in rs) for mode, rs in results.items()}
    ratio = medians["auto"] / medians["off"]
    print(f"warm/cold total: {ratio:.2f}")


if __name__ == "__main__":
    main()
