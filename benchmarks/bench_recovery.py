"""Worker crash -> every worker on 2 nodes running again: node-agent vs torchrun, same scenario.

Two agents x 2 workers on this machine; global rank 3 crashes once. Recovery time is from the
crash to the last worker of the next attempt starting. Also measures the agent's resident memory
and a trivial `--standalone` job's wall time. Target (issue 3): recovery <= 1/4 of torchrun's,
agent RSS <= 40 MB, standalone trivial job <= 0.3 s.
Run: .venv/bin/python benchmarks/bench_recovery.py [--repeat 3] [--no-torchrun]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._server import running_server  # noqa: E402

WORKER = os.path.join(ROOT, "benchmarks", "scripts", "crash_worker.py")
ENV = dict(os.environ, PYTHONPATH=ROOT, CRASH_RANK="3")


def recovery_time(log: str) -> float:
    crash = None
    restarted = []
    with open(log) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "crash":
                crash = float(parts[2])
            elif parts[0] == "start" and parts[2] == "1":
                restarted.append(float(parts[3]))
    if crash is None or len(restarted) < 4:
        raise RuntimeError(f"incomplete run: crash={crash} restarted={len(restarted)}")
    return max(restarted) - crash


def run_pair(commands: list[list[str]], log: str, rss_of: int = -1) -> tuple[float, float]:
    env = dict(ENV, BENCH_LOG=log)
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
    peak_rss = 0.0
    try:
        while any(p.poll() is None for p in procs):
            if rss_of >= 0 and procs[rss_of].poll() is None:
                try:
                    peak_rss = max(peak_rss, psutil.Process(procs[rss_of].pid).memory_info().rss / 2**20)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"launchers exited {codes}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return recovery_time(log), peak_rss


def node_agent_once(port: int, job: str, log: str) -> tuple[float, float]:
    def cmd(n: str) -> list[str]:
        return [sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{port}", "--nnodes", "2",
                "--nproc", "2", "--job-id", job, "--max-restarts", "1", "--node-id", n, WORKER]
    return run_pair([cmd("a"), cmd("b")], log, rss_of=0)


def torchrun_once(log: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
           "--max-restarts", "1", "--monitor-interval", "0.1", WORKER]
    return run_pair([cmd, cmd], log)[0]


def standalone_wall(launcher: list[str], trivial: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([*launcher, trivial], env=ENV, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-torchrun", action="store_true")
    args = p.parse_args()
    have_torch = shutil.which("python") is not None and not args.no_torchrun
    try:
        import torch  # noqa: F401
    except ImportError:
        have_torch = False
    tmp = tempfile.mkdtemp(prefix="bench-recovery-")
    ours, rss, theirs = [], [], []
    with running_server("--log-level", "warning") as port:
        for k in range(args.repeat):
            t, m = node_agent_once(port, f"rec-{k}", os.path.join(tmp, f"ours-{k}.log"))
            ours.append(t)
            rss.append(m)
            print(f"node-agent run {k}: recovery {t * 1000:.0f} ms, agent peak RSS {m:.1f} MB", flush=True)
    if have_torch:
        for k in range(args.repeat):
            t = torchrun_once(os.path.join(tmp, f"torchrun-{k}.log"))
            theirs.append(t)
            print(f"torchrun   run {k}: recovery {t * 1000:.0f} ms", flush=True)
    trivial = os.path.join(tmp, "trivial.py")
    with open(trivial, "w") as f:
        f.write("pass\n")
    ours_standalone = standalone_wall([sys.executable, "-m", "node_agent.main", "--standalone", "--nproc", "1"],
                                      trivial, args.repeat)
    print(f"RESULT recovery_ms node_agent median={statistics.median(ours) * 1000:.0f}"
          + (f" torchrun median={statistics.median(theirs) * 1000:.0f}"
             f" ratio={statistics.median(ours) / statistics.median(theirs):.2f}" if theirs else ""))
    print(f"RESULT agent_peak_rss_mb median={statistics.median(rss):.1f}")
    line = f"RESULT standalone_trivial_s node_agent={ours_standalone:.3f}"
    if have_torch:
        torchrun = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '1']
        line += f" torchrun={standalone_wall(torchrun, trivial, args.repeat):.3f}"
    print(line)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
