"""Crash -> every rank training again (issues 22, 54): node-agent cold and warm, node-agent with the script's own
disk checkpoint, torchrun with our plugin, and torchrun's c10d, side by side in one run, interleaved.

The scenario: examples/train_ddp.py (real torch DDP, 4x Linear(WIDTH, WIDTH), AdamW, a snapshot every
--snapshot-every steps in node-agent's memory directory (`protect`), and on disk every --disk-every steps),
NODES launchers x NPROC workers on this machine (+ an rdzv-server on 127.0.0.1), the last global rank crashing
once at --crash-step. "node-agent (own disk)" runs the script without `protect`: it resumes from its disk
checkpoint, as the torchrun rows do. Each run ends when the job does, or at --timeout (torchrun's c10d often
hangs after a failure: recorded as such). The workers' markers give the recovery's parts
(benchmarks/first_step_report.py). Node-agent runs cold with `--warm-workers off` and with its defaults.

On a GPU (`--device cuda`, NCCL: one worker per GPU, so `--nodes 1 --nproc <GPUs>`): `make bench-gpu-restart`
runs issue 54's case, 4x Linear(4096, 4096) + AdamW (805 MB of state), one worker, crash at step 25.

Also (--snapshot-mb, 0 to skip) the load of a snapshot from the memory directory: 4x Linear(D,D) + AdamW
state, memory-mapped (`torch.load(mmap=True)`) against a plain `torch.load`, each then `load_state_dict`.

Writes a table on stdout, OUT/NAME.json and OUT/NAME.png (OUT: docs/, NAME: bench-first-step).
Run: make bench-first-step, or .venv/bin/python benchmarks/bench_first_step.py [--pairs 3] [--snapshot-mb 768]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import first_step_report as report  # noqa: E402
from benchmarks._server import running_server  # noqa: E402

TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")
_console = os.path.join(os.path.dirname(sys.executable), "torchrun")
TORCHRUN = [_console] if os.path.exists(_console) else [sys.executable, "-m", "torch.distributed.run"]
LAUNCHERS = ("node-agent cold", "node-agent (defaults)", "node-agent (own disk)", "torchrun + rdzv-server plugin",
             "torchrun c10d")


def has_warm_flag() -> bool:
    """Whether this node-agent knows --warm-workers (the warm-worker change may not be merged yet)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "node_agent.main", "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    return "--warm-workers" in done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def commands(launcher: str, *, port: int, job: str, script: list[str], warm_flag: bool, nodes: int,
             nproc: int) -> list[list[str]]:
    """The launcher processes (one per node) of a run."""
    names = [f"node-{chr(ord('a') + k)}" for k in range(nodes)]
    size = ["--nnodes", str(nodes)]
    if launcher.startswith("node-agent"):
        warm = ["--warm-workers", "off"] if launcher == "node-agent cold" and warm_flag else []
        return [[sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{port}", *size,
                 "--nproc", str(nproc), "--job-id", job, "--max-restarts", "3", "--node-id", n, *warm, *script]
                for n in names]
    per_node = [*size, "--nproc-per-node", str(nproc), "--max-restarts", "3", "--monitor-interval", "0.1"]
    if launcher == "torchrun + rdzv-server plugin":
        return [[*TORCHRUN, "--rdzv-backend", "rdzv-server", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                 job, *per_node, "--rdzv-conf", f"node_id={n}", *script] for n in names]
    store = free_port()
    return [[*TORCHRUN, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store}", "--rdzv-id", job,
             *per_node, *script] for _ in names]


def _kill_tree(procs: list[subprocess.Popen[bytes]]) -> None:
    """Every launcher, worker and orphan of a run: each launcher has a session of its own."""
    seen: set[int] = set()
    for p in procs:
        try:
            seen |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in seen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def run_once(launcher: str, *, port: int, job: str, work: str, args: argparse.Namespace,
             warm_flag: bool) -> dict[str, Any]:
    os.makedirs(work)
    markers = os.path.join(work, "markers")
    world = args.nodes * args.nproc
    snapshots = [] if launcher == "node-agent (own disk)" else ["--snapshot-every", str(args.snapshot_every)]
    script = [TRAIN, "--steps", str(args.steps), "--crash-rank", str(world - 1), "--crash-step", str(args.crash_step),
              *snapshots, "--disk-every", str(args.disk_every), "--ckpt-dir", os.path.join(work, "ckpt"),
              "--width", str(args.width), "--depth", "4", "--optimizer", "adamw", "--markers", markers,
              "--device", args.device, "--step-s", str(args.step_s)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=work,
               PYTHONUNBUFFERED="1")
    logs = [open(os.path.join(work, f"launcher-{k}.log"), "wb") for k in range(args.nodes)]  # noqa: SIM115
    load_before = os.getloadavg()
    started = time.monotonic()
    argvs = commands(launcher, port=port, job=job, script=script, warm_flag=warm_flag, nodes=args.nodes,
                     nproc=args.nproc)
    procs = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)
             for c, log in zip(argvs, logs, strict=True)]
    timed_out = False
    try:
        for p in procs:
            p.wait(max(0.1, args.timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_tree(procs)
        for log in logs:
            log.close()
    result = report.recovery(report.read_markers(markers), world=world)
    return {"launcher": launcher, "job": job, "result": result, "timed_out": timed_out, "timeout_s": args.timeout,
            "codes": [p.returncode for p in procs], "wall_s": time.monotonic() - started,
            "load": [load_before[0], os.getloadavg()[0]], "work": work}


def snapshot_load(mb: int, repeat: int) -> dict[str, Any]:
    """4x Linear(D,D) + AdamW state of about `mb` MiB in a memory directory: mmap load vs plain load."""
    import torch

    from node_agent.training import snapshot
    width = int((mb * 2**20 / 48) ** 0.5)   # 4 layers x D^2 floats x (weights + 2 AdamW moments) x 4 bytes
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    where = tempfile.mkdtemp(prefix="bench-snapshot-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        path = snapshot.save(lambda f: torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f), 1,
                             where=where)
        size = os.path.getsize(path)
        times: dict[str, list[float]] = {"mmap": [], "plain": []}
        for _ in range(repeat):
            for kind in times:
                t0 = time.perf_counter()
                state = torch.load(path, mmap=kind == "mmap")
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                times[kind].append(time.perf_counter() - t0)
                del state
        return {"mb": size / 2**20, "width": width, "seconds": times}
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="rounds of all launchers, interleaved")
    p.add_argument("--launchers", default=",".join(LAUNCHERS),
                   help="comma-separated subset of: " + ", ".join(LAUNCHERS))
    p.add_argument("--width", type=int, default=1024, help="4x Linear(WIDTH, WIDTH)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--crash-step", type=int, default=20)
    p.add_argument("--snapshot-every", type=int, default=5, help="steps between protect's snapshots")
    p.add_argument("--disk-every", type=int, default=10, help="steps between the script's disk checkpoints")
    p.add_argument("--step-s", type=float, default=0.0, help="seconds each step sleeps besides its work")
    p.add_argument("--nodes", type=int, default=2, help="launchers (nodes) on this machine")
    p.add_argument("--nproc", type=int, default=2, help="workers per node")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, a GPU per worker")
    p.add_argument("--name", default="bench-first-step", help="the JSON's and the chart's file name")
    p.add_argument("--timeout", type=float, default=100.0, help="a run's limit (s); past it: no rank stepped again")
    p.add_argument("--snapshot-mb", type=int, default=768, help="the snapshot-load benchmark's size (0: skip)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs"), help="where the JSON and the PNG go")
    p.add_argument("--keep", action="store_true", help="keep the runs' logs and markers")
    p.add_argument("--replot", metavar="JSON", help="only draw the chart again from an earlier run's JSON")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        report.plot(saved["runs"], saved["launchers"], os.path.join(args.out, f"{args.name}.png"), saved["note"])
        return
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    if unknown := [name for name in launchers if name not in LAUNCHERS]:
        p.error(f"unknown launcher {unknown[0]!r}; known: {', '.join(LAUNCHERS)}")
    warm_flag = has_warm_flag()
    tmp = tempfile.mkdtemp(prefix="bench-first-step-")
    runs = []
    with running_server() as port:
        for pair in range(args.pairs):
            for launcher in launchers:
                run = run_once(launcher, port=port, job=f"first-step-{pair}-{launchers.index(launcher)}",
                               work=os.path.join(tmp, f"{pair}-{launchers.index(launcher)}"), args=args,
                               warm_flag=warm_flag)
                runs.append(run)
                r = run["result"]
                print(f"pair {pair} {launcher:30s} " + (f"{r['total']:.2f} s" if r else "no rank stepped again")
                      + f" (exit {run['codes']}, load {run['load'][0]:.1f})", flush=True)
    loads = [x for r in runs for x in r["load"]]
    layout = f"{args.nodes} node{'s' * (args.nodes > 1)} x {args.nproc} worker{'s' * (args.nproc > 1)}, " \
        f"{'NCCL on GPUs' if args.device == 'cuda' else 'gloo on CPUs'}, 4x Linear({args.width}) + AdamW"
    note = f"{layout}; load average {min(loads):.1f}-{max(loads):.1f}, {os.cpu_count()} CPUs" + \
        ("" if warm_flag else "; no --warm-workers in this node-agent: both node-agent rows are cold")
    out: dict[str, Any] = {"runs": runs, "launchers": launchers, "note": note, "warm_flag": warm_flag,
                           "args": vars(args), "cpus": os.cpu_count()}
    print()
    print(report.table(runs, launchers))
    print(note)
    torchrun = next((name for name in launchers if name.startswith("torchrun") and report.medians(runs, name)), None)
    base = report.medians(runs, torchrun) if torchrun else None
    for launcher in launchers:
        mine = report.medians(runs, launcher)
        if base and mine and launcher.startswith("node-agent"):
            print(f"RESULT {launcher} / {torchrun} = {mine / base:.2f}x")
    if args.snapshot_mb > 0:
        load = snapshot_load(args.snapshot_mb, 3)
        out["snapshot_load"] = load
        print(f"snapshot load, {load['mb']:.0f} MiB from the memory directory (4x Linear({load['width']}) + AdamW): "
              + ", ".join(f"{kind} {report._spread(sec)} s" for kind, sec in load["seconds"].items()))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(out, f, indent=1)
    try:
        report.plot(runs, launchers, os.path.join(args.out, f"{args.name}.png"), note)
    except ImportError:
        print("no chart: matplotlib is missing (pip install -e '.[bench]')")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
