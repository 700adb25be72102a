"""What one rdzv-server costs in memory and CPU per N nodes, for sizing a deployment (docs/deploy.md).

A real server (durable store) and N simulated agents (plain aiohttp + msgpack, in this process) that
join one job of N nodes and then long-poll the way node-agent does while its workers run (2 s
polls, each one renewing the lease). Reported: the server's resident memory before, at its peak
while the round forms, and in the steady state; its CPU use (user + system) over a steady window;
the state dir's size.
Run: .venv/bin/python benchmarks/bench_footprint.py [--nodes 1000] [--steady 20]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp
import msgpack
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADERS = {"Content-Type": "application/msgpack"}
POLL_WAIT_S = 2.0      # node-agent's long-poll while workers run


async def agent(session, base, i, n, state) -> None:
    body = {"v": 1, "node_id": f"node-{i}", "addr": "127.0.0.1", "local_world_size": 8, "master_port": 20000 + i,
            "config": {"min_nodes": n, "max_nodes": n, "last_call_s": 30.0, "lease_timeout_s": 5.0}}
    async with session.post(f"{base}/v1/jobs/size/join", data=msgpack.packb(body), headers=HEADERS) as r:
        reply = msgpack.unpackb(await r.read())
    known = -1
    while not state["done"]:
        if reply.get("assignment") and known < 0:
            known = reply["round_id"]
            state["assigned"] += 1
        poll = {"v": 1, "node_id": f"node-{i}", "known_round": known, "wait_s": POLL_WAIT_S}
        async with session.post(f"{base}/v1/jobs/size/poll", data=msgpack.packb(poll), headers=HEADERS) as r:
            reply = msgpack.unpackb(await r.read())


class Sampler:
    """Peak RSS of a process, sampled every 20 ms in a thread."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc, self.peak, self.stop = proc, 0, False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)


async def measure(port: int, proc: psutil.Process, nodes: int, steady: float) -> dict:
    base = f"http://127.0.0.1:{port}"
    state = {"done": False, "assigned": 0}
    result = {"idle_rss": proc.memory_info().rss}
    sampler = Sampler(proc)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        tasks = [asyncio.create_task(agent(session, base, i, nodes, state)) for i in range(nodes)]
        while state["assigned"] < nodes:   # noqa: ASYNC110 - a benchmark's progress check, not a sync
            await asyncio.sleep(0.05)
        result["formation_peak_rss"] = sampler.peak
        await asyncio.sleep(2 * POLL_WAIT_S)          # let the formation burst settle
        cpu0, t0 = proc.cpu_times(), time.perf_counter()
        await asyncio.sleep(steady)
        cpu1, t1 = proc.cpu_times(), time.perf_counter()
        result["steady_rss"] = proc.memory_info().rss
        result["steady_cpu"] = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / (t1 - t0)
        state["done"] = True
        await asyncio.wait(tasks, timeout=2 * POLL_WAIT_S + 5)
        for t in tasks:
            t.cancel()
    sampler.stop = True
    result["peak_rss"] = sampler.peak
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--steady", type=float, default=20.0, help="seconds of steady long-polling measured")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as state_dir:
        env = dict(os.environ, PYTHONPATH=ROOT)
        server = subprocess.Popen([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0",
                                   "--state-dir", state_dir, "--log-level", "warning"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            line = server.stdout.readline()
            m = re.search(r":(\d+)\s*$", line)
            if not m:
                raise RuntimeError(f"server did not start: {line!r}")
            r = asyncio.run(measure(int(m.group(1)), psutil.Process(server.pid), args.nodes, args.steady))
        finally:
            server.terminate()
            server.wait(30)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(state_dir) for f in fs)
    mib = 1024 * 1024
    print(f"{args.nodes} nodes in one job: server RSS idle {r['idle_rss'] / mib:.0f} MiB, "
          f"peak {r['peak_rss'] / mib:.0f} MiB (at formation {r['formation_peak_rss'] / mib:.0f} MiB), "
          f"steady {r['steady_rss'] / mib:.0f} MiB; CPU while every node long-polls "
          f"({POLL_WAIT_S:g} s polls): {r['steady_cpu'] * 100:.0f}% of one core; state dir {size / 1024:.0f} KiB")
    print(f"RESULT nodes={args.nodes} peak_rss_mib={r['peak_rss'] / mib:.0f} "
          f"steady_rss_mib={r['steady_rss'] / mib:.0f} steady_cpu_cores={r['steady_cpu']:.2f} "
          f"state_kib={size / 1024:.0f}")


if __name__ == "__main__":
    main()
