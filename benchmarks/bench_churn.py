"""Bounded state under churn: many one-shot jobs, then memory and the state dir back near their start.

Each job is one node that joins, runs its round and reports success (a one-shot job). The server runs
with a durable store and a short `--retain-finished`, so finished jobs are forgotten (in memory and
in the store) soon after they end. Printed: the server's RSS and the state dir's size at the start,
at the peak, and once the retention has passed.

Run: .venv/bin/python benchmarks/bench_churn.py [--jobs 50000] [--retain 10] [--concurrency 64]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import aiohttp
import msgpack
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._server import running_server  # noqa: E402

HEADERS = {"Content-Type": "application/msgpack"}


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


async def one_job(session: aiohttp.ClientSession, base: str, i: int) -> None:
    job = f"oneshot-{i}"
    body = {"v": 1, "node_id": "n", "addr": "127.0.0.1", "local_world_size": 1, "master_port": 1,
            "config": {"min_nodes": 1, "max_nodes": 1, "last_call_s": 0.0,
                       "lease_timeout_s": 60.0}}  # a one-shot client holds no poll: a starved client must not lapse
    async with session.post(f"{base}/{job}/join", data=msgpack.packb(body), headers=HEADERS) as r:
        reply = msgpack.unpackb(await r.read())
    done = {"v": 1, "node_id": "n", "credential": reply["credential"], "round_id": reply["round_id"]}
    async with session.post(f"{base}/{job}/success", data=msgpack.packb(done), headers=HEADERS) as r:
        ended = msgpack.unpackb(await r.read())
    if ended.get("job_state") != "succeeded":
        raise SystemExit(f"bench_churn: job {job}: the success report was answered {r.status} {ended!r}")


async def churn(port: int, jobs: range, concurrency: int, server: psutil.Process, peak: list[int]) -> None:
    base = f"http://127.0.0.1:{port}/v1/jobs"
    queue = iter(jobs)

    async def worker(session: aiohttp.ClientSession) -> None:
        for i in queue:
            await one_job(session, base, i)
            if i % 1000 == 0:
                peak[0] = max(peak[0], server.memory_info().rss)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=50_000)
    p.add_argument("--retain", type=float, default=10.0, help="the server's --retain-finished")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--server-arg", action="append", default=[], help="extra rdzv-server flag (repeatable)")
    p.add_argument("--rounds", type=int, default=1, help="churn this many times (new job ids each time)")
    args = p.parse_args()
    state = tempfile.mkdtemp(prefix="rdzv-churn-")
    pids: list[int] = []
    with running_server("--state-dir", state, "--retain-finished", str(args.retain), *args.server_arg,
                        "--max-jobs", str(args.jobs + 10), pids=pids) as port:
        server = psutil.Process(pids[0])
        time.sleep(1.0)                                     # start-up allocations settle (a measurement)
        rss0, disk0 = server.memory_info().rss, dir_size(state)
        for n in range(args.rounds):
            peak = [rss0]
            started = time.time()
            asyncio.run(churn(port, range(n * args.jobs, (n + 1) * args.jobs), args.concurrency, server, peak))
            took = time.time() - started
            rss_end, disk_peak = server.memory_info().rss, dir_size(state)
            time.sleep(args.retain + 8.0)  # the retention passes, the timer forgets them, the heap is trimmed (5 s)
            rss_after, disk_after = server.memory_info().rss, dir_size(state)
            report(n + 1, args.jobs, took, rss0, max(peak[0], rss_end), rss_after, disk0, disk_peak, disk_after)


def report(n: int, jobs: int, took: float, rss0: int, rss_peak: int, rss_after: int,
           disk0: int, disk_peak: int, disk_after: int) -> None:
    mib = 1 << 20
    print(f"round {n}: {jobs} one-shot jobs in {took:.1f} s ({2 * jobs / took:.0f} requests/s)")
    print(f"  server RSS: start {rss0 / mib:.0f} MiB, peak {rss_peak / mib:.0f} MiB, "
          f"after the retention {rss_after / mib:.0f} MiB")
    print(f"  state dir: start {disk0 / 1024:.0f} KiB, after the jobs {disk_peak / 1024:.0f} KiB, "
          f"after the retention {disk_after / 1024:.0f} KiB")
    print(f"RESULT round={n} jobs={jobs} rss_start_mib={rss0 / mib:.0f} rss_peak_mib={rss_peak / mib:.0f} "
          f"rss_after_mib={rss_after / mib:.0f} disk_start_kib={disk0 / 1024:.0f} "
          f"disk_after_kib={disk_after / 1024:.0f}", flush=True)


if __name__ == "__main__":
    main()
