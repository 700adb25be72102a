"""Steady-state cost of long-polls: N simulated nodes sit in one round, each always holding one poll.

What a running job costs the server: every node re-issues its long-poll as soon as the last one
returns (the server holds each for min(wait_s, lease/2) = 2 s by default), as the real agent does.
The figure is the server process's CPU time (user + system, from psutil) divided by the polls
answered in the measured window. The clients run in separate processes (`--clients`), speaking
the wire with aiohttp + the plain msgpack package; their own CPU is printed so a client-bound run
can be told apart.

Run: .venv/bin/python benchmarks/bench_polls.py [--nodes 1000] [--seconds 20] [--server-root DIR]
(`--server-root` runs the server from another checkout, e.g. a `git worktree` of an older commit,
to compare two versions under the same load.)
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time

import aiohttp
import msgpack
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._server import ROOT, running_server  # noqa: E402

HEADERS = {"Content-Type": "application/msgpack"}


async def _node(session: aiohttp.ClientSession, base: str, i: int, n: int, start: float, stop: float,
                counts: list[int]) -> None:
    node = f"node-{i}"
    body = {"v": 1, "node_id": node, "addr": "127.0.0.1", "local_world_size": 8, "master_port": 20000 + i % 40000,
            "config": {"min_nodes": n, "max_nodes": n, "last_call_s": 30.0, "lease_timeout_s": 10.0}}
    async with session.post(f"{base}/join", data=msgpack.packb(body), headers=HEADERS) as r:
        reply = msgpack.unpackb(await r.read())
    cred = reply.get("credential", "")     # servers before node credentials issue none
    known = -1
    while time.time() < stop:
        if reply.get("assignment") is not None:
            known = reply["assignment"]["round_id"]
        poll = {"v": 1, "node_id": node, "credential": reply.get("credential") or cred, "known_round": known,
                "wait_s": 2.0}
        async with session.post(f"{base}/poll", data=msgpack.packb(poll), headers=HEADERS) as r:
            reply = msgpack.unpackb(await r.read())
        if start <= time.time() < stop and known != -1:
            counts[0] += 1


def _client(port: int, first: int, count: int, n: int, start: float, stop: float, out: mp.Queue[tuple]) -> None:
    async def run() -> int:
        counts = [0]
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as session:
            base = f"http://127.0.0.1:{port}/v1/jobs/steady"
            await asyncio.gather(*(_node(session, base, i, n, start, stop, counts)
                                   for i in range(first, first + count)))
        return counts[0]
    polls = asyncio.run(run())
    cpu = psutil.Process().cpu_times()
    out.put((polls, cpu.user + cpu.system))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--warmup", type=float, default=8.0, help="seconds for joins and the first round")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window")
    p.add_argument("--server-root", default=ROOT)
    p.add_argument("--server-arg", action="append", default=[], help="extra rdzv-server flag (repeatable)")
    args = p.parse_args()
    pids: list[int] = []
    with running_server("--state-dir", "none", *args.server_arg, root=args.server_root, pids=pids) as port:
        server = psutil.Process(pids[0])
        start = time.time() + args.warmup
        stop = start + args.seconds
        queue: mp.Queue[tuple] = mp.Queue()
        per = args.nodes // args.clients
        procs = [mp.Process(target=_client, args=(port, k * per, per, per * args.clients, start, stop, queue))
                 for k in range(args.clients)]
        for proc in procs:
            proc.start()
        time.sleep(max(0.0, start - time.time()))     # a benchmark's schedule, not a synchronisation
        before = server.cpu_times()
        time.sleep(max(0.0, stop - time.time()))
        after = server.cpu_times()
        results = [queue.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join()
    polls = sum(r[0] for r in results)
    cpu = (after.user + after.system) - (before.user + before.system)
    print(f"server from {args.server_root}")
    print(f"{args.nodes} nodes, {args.seconds:g} s: {polls} polls answered ({polls / args.seconds:.0f}/s); "
          f"server CPU {cpu:.2f} s ({100 * cpu / args.seconds:.0f}% of a core); clients' CPU "
          f"{sum(r[1] for r in results):.1f} s in all")
    print(f"RESULT nodes={args.nodes} server_cpu_us_per_poll={1e6 * cpu / max(polls, 1):.0f} "
          f"server_cpu_pct={100 * cpu / args.seconds:.0f}")


if __name__ == "__main__":
    main()
