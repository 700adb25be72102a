"""`make demo`: a rendezvous server and two node agents on this machine run a real gloo DDP job.

Each agent runs 2 workers (world size 4). Rank 3 crashes once on purpose in step 10: both nodes restart
their workers (job-wide restart count 1), every rank resumes from its in-memory snapshot of step 10 (the one
call `protect(model, opt, every=5)` in train_ddp.py), and the job finishes. Prints what happened.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def pump(proc: subprocess.Popen, label: str) -> threading.Thread:
    def run() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"{label} | {line}", end="", flush=True)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main() -> int:
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs: list[subprocess.Popen] = []
    state_dir = tempfile.mkdtemp(prefix="rdzv-demo-state-")
    try:
        banner("starting rdzv-server on a free port")
        server = subprocess.Popen([PY, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0",
                                   "--state-dir", state_dir],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs.append(server)
        assert server.stdout is not None
        while True:                      # log lines may come first; the port is on the "listening" line
            line = server.stdout.readline()
            if not line:
                raise SystemExit("demo: rdzv-server exited before it listened")
            print(f"server | {line}", end="")
            found = re.search(r"listening on http://\S+:(\d+)\s*$", line)
            if found:
                port = int(found.group(1))
                break
        pump(server, "server")
        banner(f"starting 2 node agents x 2 workers (job 'demo', endpoint 127.0.0.1:{port})")
        agents = []
        for name in ("node-a", "node-b"):
            cmd = [PY, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{port}", "--nnodes", "2",
                   "--nproc", "2", "--job-id", "demo", "--max-restarts", "2", "--node-id", name,
                   os.path.join(ROOT, "examples", "train_ddp.py"), "--steps", "30", "--crash-rank", "3",
                   "--crash-step", "10", "--snapshot-every", "5"]
            agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            procs.append(agent)
            agents.append((name, agent, pump(agent, name)))
        codes = {}
        for name, agent, reader in agents:
            codes[name] = agent.wait(timeout=300)
            reader.join(timeout=5)
        banner("what happened")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/jobs/demo") as resp:
            job = json.load(resp)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/jobs/demo/events") as resp:
            events = json.load(resp)["events"]
        for e in events:
            print(f"  {e['time']}  {e['kind']:<16} {e['message']}")
        print(f"\njob state: {job['state']}; restarts used: {job['restart_count']}/{job['max_restarts']}; "
              f"final round {job['round_id']} with world size {job['world_size']}")
        for n in job["nodes"]:
            ranks = f"{n['rank_offset']}..{n['rank_offset'] + n['local_world_size'] - 1}"
            print(f"  {n['node_id']}: group rank {n['group_rank']}, global ranks {ranks}, addr {n['addr']}")
        print(f"agent exit codes: {codes}")
        for cost in job["progress"].get("costs", []):     # where the crash's restart took its time
            if cost.get("anatomy"):
                phases = ", ".join(f"{k.replace('_', ' ')} {v:.2f}s" for k, v in cost["anatomy"].items()
                                   if k != "rank" and v >= 0.005)
                print(f"restart of round {cost['round_id']}: {cost['cost_s']:.2f}s from the crash to stepping again "
                      f"({phases}; on {cost['anatomy_node']})")
        banner(f"rdzv-ctl status (the status page was at http://127.0.0.1:{port}/, metrics at /metrics)")
        subprocess.run([PY, "-m", "rdzv_ctl.cli", "--endpoint", f"127.0.0.1:{port}", "status"], env=env,
                       timeout=30)
        ok = job["state"] == "succeeded" and all(c == 0 for c in codes.values()) and job["restart_count"] == 1
        print("DEMO OK" if ok else "DEMO FAILED")
        return 0 if ok else 1
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
