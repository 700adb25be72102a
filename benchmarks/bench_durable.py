"""What the durable store costs, and how fast agents are back after a server restart.

Targets (issue 5):
- round formation of 1,000 simulated nodes with the store within 1.5x of the in-memory figure;
- writes must not stall the event loop (the server reports its loop lag and commit times on exit);
- after kill -9 and restart on the same state dir, every agent is reconnected within 2 s.

The simulated agents speak the wire with the plain `msgpack` package and retry with the real
agent's backoff (min(0.5 s, 50 ms * 2^attempt) * U(0.5, 1)).
Run: .venv/bin/python benchmarks/bench_durable.py [--nodes 1000] [--repeat 3] [--outage 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp
import msgpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.bench_rendezvous import run_once  # noqa: E402

HEADERS = {"Content-Type": "application/msgpack"}


class Server:
    """A real rdzv-server process; its stderr is kept to read the exit report."""

    def __init__(self, state_dir: str, port: int = 0) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port",
                                      str(port), "--state-dir", state_dir, "--log-level", "info"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        line = self.proc.stdout.readline()
        self.listening = time.perf_counter()
        m = re.search(r":(\d+)\s*$", line)
        if not m:
            raise RuntimeError(f"server did not start: {line!r}")
        self.port = int(m.group(1))

    def stop(self, sig: int = signal.SIGTERM) -> str:
        self.proc.send_signal(sig)
        self.proc.wait(30)
        time.sleep(0.2)   # let the reader thread drain the pipe (benchmark only)
        return "".join(line for line in self.stderr if "state store:" in line or "loop lag" in line).strip()


def formation(nodes: int, repeat: int, state_dir: str) -> tuple[float, str]:
    server = Server(state_dir)
    after_last = []
    try:
        for k in range(repeat):
            a, _ = asyncio.run(run_once(server.port, nodes, f"form-{k}"))
            after_last.append(a)
    finally:
        report = server.stop()
    return statistics.median(after_last), report


async def agent(session, base, i, n, job, state):
    """Join, then long-poll until the benchmark ends, retrying like the real agent."""
    body = {"v": 1, "node_id": f"node-{i}", "addr": "127.0.0.1", "local_world_size": 8, "master_port": 20000 + i,
            "config": {"min_nodes": n, "max_nodes": n, "last_call_s": 30.0, "lease_timeout_s": 5.0}}
    async with session.post(f"{base}/v1/jobs/{job}/join", data=msgpack.packb(body), headers=HEADERS) as r:
        reply = msgpack.unpackb(await r.read())
    cred = reply["credential"]            # every later request for the node carries it
    known = -1
    attempts = 0
    while not state["done"]:
        poll = {"v": 1, "node_id": f"node-{i}", "credential": cred, "known_round": known, "wait_s": 2.0}
        try:
            async with session.post(f"{base}/v1/jobs/{job}/poll", data=msgpack.packb(poll), headers=HEADERS,
                                    timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    raise aiohttp.ClientError(f"HTTP {r.status}")
                reply = msgpack.unpackb(await r.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            attempts += 1
            await asyncio.sleep(min(0.5, 0.05 * 2 ** attempts) * random.uniform(0.5, 1.0))
            continue
        attempts = 0
        if reply.get("assignment"):
            known = reply["round_id"]
            state["rounds"][i] = known


async def restart_run(nodes: int, outage: float, state_dir: str) -> dict:
    server = Server(state_dir)
    base = f"http://127.0.0.1:{server.port}"
    state = {"done": False, "restarted_at": None, "rounds": {}}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        tasks = [asyncio.create_task(agent(session, base, i, nodes, "restart", state)) for i in range(nodes)]
        while len(state["rounds"]) < nodes:   # noqa: ASYNC110 - a benchmark's progress check, not a sync
            await asyncio.sleep(0.05)
        round_before = set(state["rounds"].values())
        server.stop(signal.SIGKILL)
        await asyncio.sleep(outage)                       # the outage itself
        loop = asyncio.get_running_loop()
        t_start = time.perf_counter()
        restarted = await loop.run_in_executor(None, Server, state_dir, server.port)
        state["restarted_at"] = restarted.listening
        # Reconnected = the server renewed the node's lease (its poll arrived), seen in the JSON view;
        # a long-poll reply itself comes back only when the poll's wait ends.
        while True:
            since = time.perf_counter() - restarted.listening
            # node_limit: the view lists 500 nodes unless asked for more (2,000 at most)
            async with session.get(f"{base}/v1/jobs/restart?node_limit={nodes}") as r:
                view = await r.json()
            if len(view["nodes"]) == nodes and all(n["lease_age_s"] < since for n in view["nodes"]):
                seen_all = time.perf_counter()
                break
            await asyncio.sleep(0.05)
        state["done"] = True
        round_after = set(state["rounds"].values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    report = restarted.stop()
    last = seen_all
    return {"from_listening_s": last - restarted.listening, "from_process_start_s": last - t_start,
            "startup_s": restarted.listening - t_start, "rounds": (round_before, round_after), "report": report}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--outage", type=float, default=3.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mem, mem_report = formation(args.nodes, args.repeat, "none")
        dur, dur_report = formation(args.nodes, args.repeat, os.path.join(d, "form"))
        print(f"formation, {args.nodes} nodes, last assignment after the last join (median of {args.repeat}): "
              f"in-memory {mem * 1000:.0f} ms, durable {dur * 1000:.0f} ms, ratio {dur / mem:.2f} (target <= 1.5)")
        print(f"  in-memory server: {mem_report}")
        print(f"  durable server:   {dur_report}")
        r = asyncio.run(restart_run(args.nodes, args.outage, os.path.join(d, "restart")))
        print(f"restart: {args.nodes} agents in one round; server kill -9, {args.outage:g}s away, restarted: "
              f"all reconnected {r['from_listening_s']:.2f} s after it listened "
              f"({r['from_process_start_s']:.2f} s after the process started, start-up {r['startup_s']:.2f} s; "
              f"target <= 2 s); rounds before {sorted(r['rounds'][0])} after {sorted(r['rounds'][1])}")
        print(f"  restarted server: {r['report']}")
        print(f"RESULT nodes={args.nodes} formation_ratio={dur / mem:.2f} reconnect_s={r['from_process_start_s']:.2f}")


if __name__ == "__main__":
    main()
