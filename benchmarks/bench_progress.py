"""Issue 39's targets on this machine: 2 nodes x 2 gloo workers, a script with no change
(benchmarks/scripts/progress_train.py), a real rdzv-server and real node-agents with their defaults.

  --cases stop,exit0,deadlock --runs 20
                                 a rank is stopped / exits 0 / a deadlock (ranks 0-2 in a barrier, 3 in a recv):
                                 fault -> the hang decided, fault -> every rank stepping again in a new process,
                                 and whether the job's root cause names that rank
  --false-alarm-min 30           eval phases, checkpoint writes, DataLoader stalls, +-50 % jitter, ranks finishing
                                 apart: restarts and nodes named slow (both must be 0)
  --slow                         node b's workers do 3x the compute: the step at which it is named slow
  --ettr                         one crash: the ratio the server shows against the script's own step times
  --cost                         the probe's cost per optimizer step (in process, alternated with no probe)
  --agent-cpu 60 --old DIR       the agent's CPU with 8 workers stepping, alternated with an older checkout

Run: .venv/bin/python benchmarks/bench_progress.py [options] [--out FILE]   (make bench-progress)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._server import running_server  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "scripts", "progress_train.py")
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")
CULPRIT = 3                      # rank 3: local rank 1 of node b


def get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return json.load(resp)


@contextmanager
def pair(port: int, job: str, out: str, env: dict[str, str], *extra: str,
         nodes: tuple[str, ...] = ("a", "b")) -> Iterator[list[subprocess.Popen[str]]]:
    """Agents of two workers each (a: ranks 0-1, b: ranks 2-3, ...), killed at the end whatever happened."""
    agents = []
    try:
        for node in nodes:
            agent_env = dict(os.environ, PYTHONPATH=ROOT, OUT_DIR=out, **env)
            # Output to a file: a pipe nobody reads fills and blocks the agent (its leases then lapse).
            with open(os.path.join(out, f"agent-{node}.log"), "w") as log:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{port}", "--nnodes",
                     str(len(nodes)), "--nproc", "2", "--job-id", job, "--node-id", node, "--max-restarts", "2",
                     *FAST, *extra, SCRIPT], env=agent_env, cwd=out, stdout=log, stderr=subprocess.STDOUT))
            if node == nodes[0]:
                wait(lambda: _exists(port, job), 60)
        yield agents
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
            a.wait()
        keep = os.environ.get("BENCH_PROGRESS_LOGS")      # a directory: the agents' output is kept there
        if keep:
            for node in nodes:
                with contextlib.suppress(OSError):
                    shutil.copy(os.path.join(out, f"agent-{node}.log"), os.path.join(keep, f"{job}-{node}.log"))


def _exists(port: int, job: str) -> bool:
    try:
        get(port, f"/v1/jobs/{job}")
        return True
    except OSError:
        return False


def wait(check, timeout: float) -> bool:   # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.1)             # polling another process's files and server: nothing to wait on
    return False


def steps_of(out: str) -> dict[int, list[tuple[float, int, int]]]:
    """Each rank's own log: (unix time, step, restart count)."""
    found: dict[int, list[tuple[float, int, int]]] = {}
    for name in os.listdir(out):
        if name.startswith("steps-") and name.endswith(".txt"):
            with open(os.path.join(out, name)) as f:
                found[int(name[6:-4])] = [(float(t), int(s), int(r)) for t, s, r in
                                          (line.split() for line in f if line.count(" ") == 2)]
    return found


def hang_run(port: int, case: str, i: int, *extra: str) -> dict:
    job = f"{case}-{i}"
    with tempfile.TemporaryDirectory(prefix="bench-progress-") as out:
        env = {"FAULT": case, "FAULT_RANK": str(CULPRIT), "FAULT_STEP": "40", "STEPS": "80", "WORK": "6"}
        with pair(port, job, out, env, *extra) as agents:
            for a in agents:
                try:
                    a.wait(150)
                except subprocess.TimeoutExpired:
                    pass
            codes = [a.poll() for a in agents]
        faulted_at = float(open(os.path.join(out, f"faulted-{CULPRIT}")).read().split()[0]) \
            if os.path.exists(os.path.join(out, f"faulted-{CULPRIT}")) else None
        steps = steps_of(out)
    view, events = get(port, f"/v1/jobs/{job}"), get(port, f"/v1/jobs/{job}/events")["events"]
    hang = next((e for e in events if e["kind"] == "hang_detected"), None)
    failed = [e for e in events if e["kind"] == "worker_failed"]
    first = view.get("root_cause") or (failed[0]["data"] if failed else {})
    before = [t for r in steps.values() for t, _, restart in r if restart == 0]
    gaps = sorted(b - a for r in steps.values() for (a, _, x), (b, _, y) in zip(r, r[1:], strict=False) if x == y == 0)
    again = [min((t for t, _, restart in r if restart >= 1), default=None) for r in steps.values()]
    row = {"case": case, "run": i, "exit_codes": codes, "restarts": view["restart_count"], "state": view["state"],
           "named": first.get("rank") == CULPRIT, "root_cause": (first.get("rank"), first.get("reason")),
           "median_step_s": statistics.median(gaps) if gaps else None,
           "last_step_before_s": (faulted_at - max(before)) if faulted_at and before else None}
    if faulted_at is not None and hang is not None:
        row["decided_s"] = hang_time(hang) - faulted_at
    if faulted_at is not None and failed:
        row["failure_seen_s"] = hang_time(failed[0]) - faulted_at
    if faulted_at is not None and len(again) == 4 and all(t is not None for t in again):
        row["stepping_again_s"] = max(t for t in again if t is not None) - faulted_at
    return row


def hang_time(event: dict) -> float:
    from datetime import datetime
    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


def hangs(cases: list[str], runs: int, *extra: str) -> list[dict]:
    rows = []
    with running_server() as port:
        for i in range(runs):
            for case in cases:
                row = hang_run(port, case, i, *extra)
                rows.append(row)
                print(json.dumps(row), flush=True)
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        ok = [r for r in mine if r["named"] and r["state"] == "succeeded" and "stepping_again_s" in r]
        again = sorted(r["stepping_again_s"] for r in ok)
        decided = sorted(r.get("decided_s", r.get("failure_seen_s", 0.0)) for r in ok)
        print(f"RESULT case={case} named_and_trained_again={len(ok)}/{len(mine)} "
              f"decided_s median={_med(decided)} max={max(decided, default=0):.2f} "
              f"stepping_again_s median={_med(again)} max={max(again, default=0):.2f}", flush=True)
    return rows


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def long_job(minutes: float, env: dict[str, str], job: str) -> dict:
    with running_server() as port, tempfile.TemporaryDirectory(prefix="bench-progress-") as out:
        with pair(port, job, out, {"DURATION_S": str(minutes * 60), **env}) as agents:
            for a in agents:
                a.wait(minutes * 60 + 600)
            codes = [a.returncode for a in agents]
        view, events = get(port, f"/v1/jobs/{job}"), get(port, f"/v1/jobs/{job}/events")["events"]
        steps = steps_of(out)
    kinds = [e["kind"] for e in events]
    row = {"job": job, "minutes": minutes, "exit_codes": codes, "state": view["state"],
           "restarts": view["restart_count"], "hangs": kinds.count("hang_detected"),
           "named_slow": [e["node_id"] for e in events if e["kind"] == "node_slow"],
           "steps": max((s for r in steps.values() for _, s, _ in r), default=0), "view_progress": view.get("progress")}
    slow = next((e for e in events if e["kind"] == "node_slow"), None)
    if slow is not None:
        at = hang_time(slow)
        row["named_after_steps"] = max((s for t, s, _ in steps.get(0, []) if t <= at), default=0)
    print(json.dumps(row), flush=True)
    return row


def ettr_run() -> dict:
    with running_server() as port, tempfile.TemporaryDirectory(prefix="bench-progress-") as out:
        env = {"FAULT": "crash", "FAULT_RANK": "1", "FAULT_STEP": "200", "STEPS": "400", "WORK": "40"}
        with pair(port, "ettr", out, env) as agents:
            for a in agents:
                a.wait(600)
        view = get(port, "/v1/jobs/ettr")
        steps = steps_of(out)
    times = sorted(t for r in steps.values() for t, _, _ in r)
    first, last = times[0], times[-1]
    before = max(t for r in steps.values() for t, _, restart in r if restart == 0)
    after = min(t for r in steps.values() for t, _, restart in r if restart >= 1)
    script = (last - first - (after - before)) / (last - first)
    shown = (view.get("progress") or {}).get("ettr")
    row = {"script_ettr": round(script, 4), "server_ettr": shown, "lost_s": round(after - before, 3),
           "server_lost_s": (view.get("progress") or {}).get("lost_s"), "span_s": round(last - first, 1)}
    print(json.dumps(row), flush=True)
    print(f"RESULT ettr script={script:.4f} server={shown} difference_pp="
          f"{abs(script - shown) * 100 if shown is not None else '-'}", flush=True)
    return row


COST = """
import time, torch, os, sys
{probe}
p = torch.nn.Parameter(torch.zeros(1))
opt = torch.optim.SGD([p], lr=0.1)
for _ in range(2000):
    opt.step()
t = time.perf_counter()
for _ in range({n}):
    opt.step()
print((time.perf_counter() - t) / {n} * 1e6)
"""


def cost(rounds: int = 5, n: int = 200_000) -> dict:
    """Microseconds per optimizer step, with and without the probe, alternated in fresh interpreters."""
    results: dict[str, list[float]] = {"probe": [], "none": []}
    with tempfile.TemporaryDirectory() as tmp:
        from node_agent.workers.probes import ProbeFiles
        files = ProbeFiles.in_dir(tmp, 0)
        files.create()
        for _ in range(rounds):
            for kind in ("none", "probe"):
                probe = "" if kind == "none" else (
                    f"sys.path.insert(0, {ROOT!r})\nfrom node_agent.training import probe\n"
                    f"os.environ[probe.ENV] = {files.env()!r}\nassert probe.install()")
                done = subprocess.run([sys.executable, "-c", COST.format(probe=probe, n=n)], capture_output=True,
                                      text=True, check=True)
                results[kind].append(float(done.stdout.split()[-1]))
    none, with_probe = statistics.median(results["none"]), statistics.median(results["probe"])
    print(f"RESULT cost per optimizer step: {none:.2f} us without the probe, {with_probe:.2f} us with it: "
          f"+{with_probe - none:.2f} us (medians of {rounds} alternated runs of {n} steps)", flush=True)
    return {"none_us": results["none"], "probe_us": results["probe"]}


STEPPER = """
import time, torch
p = torch.nn.Parameter(torch.zeros(1))
opt = torch.optim.SGD([p], lr=0.1)
end = time.time() + {seconds}
while time.time() < end:
    opt.step()
    time.sleep(0.05)
"""


def agent_cpu(seconds: float, old: str, rounds: int = 3) -> dict:
    """The agent's own CPU (not its workers') with 8 workers stepping 20 times a second, this code against
    `old` (a checkout without the probe), alternated: CPU seconds per wall second over the middle of each run."""
    results: dict[str, list[float]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "stepper.py")
        with open(script, "w") as f:
            f.write(STEPPER.format(seconds=seconds + 20))
        for _ in range(rounds):
            for kind, root in (("old", old), ("new", ROOT)):
                agent = subprocess.Popen([sys.executable, "-m", "node_agent.main", "--standalone", "--nproc", "8",
                                          script], env=dict(os.environ, PYTHONPATH=root), cwd=root,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    time.sleep(10)            # the workers start and step: measured after that
                    t0, c0 = time.monotonic(), _cpu_s(agent.pid)
                    time.sleep(seconds)
                    results[kind].append((_cpu_s(agent.pid) - c0) / (time.monotonic() - t0))
                finally:
                    agent.kill()
                    agent.wait()
                    subprocess.run(["pkill", "-9", "-f", script], check=False)
                print(f"{kind}: agent CPU {results[kind][-1] * 100:.2f} % of a core", flush=True)
    old_cpu, new_cpu = statistics.median(results["old"]), statistics.median(results["new"])
    print(f"RESULT agent CPU with 8 workers: {old_cpu * 100:.2f} % without the probe's reader, {new_cpu * 100:.2f} % "
          f"with it: {(new_cpu - old_cpu) * 100:+.2f} points (medians of {rounds} alternated runs of {seconds:g} s)",
          flush=True)
    return results


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="stop,exit0,deadlock",
                   help="certain hangs (sleep and spin are decided at --hang-alone-timeout: bench_hangs.py)")
    p.add_argument("--runs", type=int, default=0, help="runs of each hang case (issue 39: 20)")
    p.add_argument("--false-alarm-min", type=float, default=0.0)
    p.add_argument("--slow", action="store_true")
    p.add_argument("--slow-min", type=float, default=3.0, help="how long the slow-node job runs")
    p.add_argument("--slow-work", type=int, default=40, help="compute per step (40: about 20 ms, 60 ms slow)")
    p.add_argument("--ettr", action="store_true")
    p.add_argument("--cost", action="store_true")
    p.add_argument("--agent-cpu", type=float, default=0.0, metavar="S",
                   help="the agent's CPU with 8 workers for S seconds, alternated with --old's")
    p.add_argument("--old", help="a checkout without the probe (e.g. a git worktree of 8cb6196)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench-progress.json"))
    args = p.parse_args()
    report: dict = {}
    if args.cost:
        report["cost"] = cost()
    if args.agent_cpu:
        if not args.old:
            p.error("--agent-cpu needs --old")
        report["agent_cpu"] = agent_cpu(args.agent_cpu, args.old)
    if args.runs:
        report["hangs"] = hangs([c for c in args.cases.split(",") if c], args.runs)
    if args.slow:
        # Steps of about 0.1 s (0.3 s on the slow node): a note rides on a poll every lease / 3, so with much
        # shorter steps one note alone spans more than 30.
        report["slow"] = long_job(args.slow_min, {"SLOW_RANKS": "2,3", "WORK": str(args.slow_work)}, "slow")
    if args.ettr:
        report["ettr"] = ettr_run()
    if args.false_alarm_min:
        report["false_alarm"] = long_job(args.false_alarm_min, {
            "WORK": "6", "JITTER": "0.5", "EVAL_EVERY": "50", "EVAL_STEPS": "20", "CKPT_EVERY": "200",
            "CKPT_S": "30", "DATA_STALL_EVERY": "20", "STEP_S_GUESS": "0.1", "FINISH_SPREAD_S": "5"}, "calm")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
