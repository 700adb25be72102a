"""N simulated nodes join one job over real HTTP on loopback; how fast does every node get its round?

Target (issue 2): with 1,000 nodes, every node has its assignment within 1 s of the last join.
The nodes speak the wire with the plain `msgpack` package, like any other client would.
Run: .venv/bin/python benchmarks/bench_rendezvous.py [--nodes 1000] [--repeat 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import aiohttp
import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._server import running_server  # noqa: E402

HEADERS = {"Content-Type": "application/msgpack"}


async def one_node(session, base, i, n, job, joined, assigned):
    body = {"v": 1, "node_id": f"node-{i}", "addr": "127.0.0.1", "local_world_size": 8, "master_port": 20000 + i,
            "config": {"min_nodes": n, "max_nodes": n, "last_call_s": 30.0, "lease_timeout_s": 30.0}}
    async with session.post(f"{base}/v1/jobs/{job}/join", data=msgpack.packb(body), headers=HEADERS) as r:
        reply = msgpack.unpackb(await r.read())
    cred = reply["credential"]            # every later request for the node carries it
    joined.append(time.perf_counter())
    while reply.get("assignment") is None:
        poll = {"v": 1, "node_id": f"node-{i}", "credential": cred, "known_round": -1, "wait_s": 10.0}
        async with session.post(f"{base}/v1/jobs/{job}/poll", data=msgpack.packb(poll), headers=HEADERS) as r:
            reply = msgpack.unpackb(await r.read())
    assigned.append(time.perf_counter())
    return reply["assignment"]


async def run_once(port: int, n: int, job: str) -> tuple[float, float]:
    base = f"http://127.0.0.1:{port}"
    joined: list[float] = []
    assigned: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_node(session, base, i, n, job, joined, assigned) for i in range(n)))
    ranks = sorted(a["group_rank"] for a in results)
    assert ranks == list(range(n)), "group ranks are not 0..n-1"
    assert len({a["round_id"] for a in results}) == 1, "nodes disagree on the round"
    return max(assigned) - max(joined), max(assigned) - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--server-arg", action="append", default=[], help="extra rdzv-server flag (repeatable)")
    args = p.parse_args()
    after_last, totals = [], []
    with running_server(*args.server_arg) as port:
        for k in range(args.repeat):
            a, t = asyncio.run(run_once(port, args.nodes, f"bench-{k}"))
            after_last.append(a)
            totals.append(t)
            print(f"run {k}: {args.nodes} nodes: last assignment {a * 1000:.0f} ms after the last join; "
                  f"all joined and assigned in {t:.2f} s")
    print(f"RESULT nodes={args.nodes} after_last_join_ms median={statistics.median(after_last) * 1000:.0f} "
          f"max={max(after_last) * 1000:.0f} total_s median={statistics.median(totals):.2f}")


if __name__ == "__main__":
    main()
