"""What the status views cost when the server holds a lot: 20,000 finished one-node jobs and one
running 10,000-node job, built with the rendezvous core directly (no agents).

For each view: the time to build the document and encode it (json.dumps, as the JSON routes do; the
HTML string for the page), median and max of --repeat runs, and the size of the answer; then the
same routes over HTTP (aiohttp's test server in this process, the server's real app), median; then
how long /healthz waits while two clients fetch `/` and `/v1/status` back to back.
Run: .venv/bin/python benchmarks/bench_views.py [--jobs 20000] [--nodes 10000] [--repeat 20] [--busy 5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

from aiohttp.test_utils import TestClient, TestServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from protocol.messages import JobConfig, JoinRequest, SuccessReport  # noqa: E402
from protocol.views import NODE_LIMIT_MAX  # noqa: E402
from rdzv_server.coordinator import Coordinator  # noqa: E402
from rdzv_server.core.rendezvous import Limits, Rendezvous  # noqa: E402
from rdzv_server.web import views  # noqa: E402
from rdzv_server.web.app import create_app  # noqa: E402
from rdzv_server.web.page import render as page  # noqa: E402

T = 1_700_000_000.0


def _join(node: str, config: JobConfig, workers: int = 1) -> JoinRequest:
    return JoinRequest(v=1, node_id=node, addr="10.0.0.1", host=f"host-{node}", local_world_size=workers,
                       master_port=29500, config=config, instance=f"{node}#1")


def build(jobs: int, nodes: int) -> tuple[Rendezvous, float]:
    """`jobs` finished one-node jobs and one running job of `nodes` nodes; returns the core and a `now`
    at which nothing has expired yet."""
    core = Rendezvous(limits=Limits(max_jobs=jobs + 10, max_nodes=jobs + 2 * nodes + 10))
    one = JobConfig(min_nodes=1, max_nodes=1)
    for i in range(jobs):
        job, t = f"done-{i:06d}", T + i * 0.01
        core.handle(job, _join("n", one), t)
        core.handle(job, SuccessReport(v=1, node_id="n", round_id=core.jobs[job].round.round_id), t)
    big = JobConfig(min_nodes=nodes, max_nodes=nodes, lease_timeout_s=600.0)
    start = T + jobs * 0.01
    for i in range(nodes):
        core.handle("big", _join(f"node-{i:06d}", big, 8), start + i * 0.0001)
    now = start + nodes * 0.0001 + 1
    assert core.jobs["big"].round is not None and len(core.jobs["big"].round.members) == nodes
    return core, now


def timed(make: Callable[[], str], repeat: int) -> tuple[float, float, int]:
    times, size = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        size = len(make().encode())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000, max(times) * 1000, size


async def over_http(core: Rendezvous, now: float, paths: list[str], repeat: int,
                    busy_s: float) -> tuple[dict[str, float], list[float], int]:
    """Median time of each path over HTTP; then /healthz latencies (ms) probed every 20 ms while two
    clients fetch `/` and `/v1/status` back to back for `busy_s` (how long the views hold the loop)."""
    client = TestClient(TestServer(create_app(Coordinator(core, clock=lambda: now)), host="127.0.0.1"))
    await client.start_server()
    out = {}

    async def fetch(path: str) -> None:
        async with client.get(path) as resp:
            await resp.read()
            assert resp.status == 200, (path, resp.status)

    try:
        for path in paths:
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                await fetch(path)
                times.append(time.perf_counter() - t0)
            out[path] = statistics.median(times) * 1000
        stop = time.perf_counter() + busy_s
        served = [0]

        async def hammer(path: str) -> None:
            while time.perf_counter() < stop:
                await fetch(path)
                served[0] += 1

        async def probe() -> list[float]:
            waits = []
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                await fetch("/healthz")
                waits.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(0.02)
            return waits

        *_, health = await asyncio.gather(hammer("/"), hammer("/v1/status"), probe())
    finally:
        await client.close()
    return out, health, served[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--busy", type=float, default=5.0, help="seconds of back-to-back views for the /healthz probe")
    args = ap.parse_args()
    t0 = time.perf_counter()
    core, now = build(args.jobs, args.nodes)
    print(f"built {args.jobs:,} finished jobs + one {args.nodes:,}-node job in {time.perf_counter() - t0:.1f}s")
    big = core.jobs["big"]
    far = (args.jobs // 2 // page.INDEX_JOBS) * page.INDEX_JOBS
    cases: list[tuple[str, str, Callable[[], str]]] = [
        ("GET /v1/status", "/v1/status", lambda: json.dumps(views.server_status(core, now))),
        (f"GET /v1/status?offset={far}&limit=200", f"/v1/status?offset={far}&limit=200",
         lambda: json.dumps(views.server_status(core, now, far, 200))),
        ("GET /v1/jobs/big", "/v1/jobs/big", lambda: json.dumps(views.job_detail(big, now))),
        ("GET /v1/jobs/big?node_limit=2000", "/v1/jobs/big?node_limit=2000",
         lambda: json.dumps(views.job_detail(big, now, 0, NODE_LIMIT_MAX))),
        ("GET /v1/jobs/big/events", "/v1/jobs/big/events", lambda: json.dumps(views.job_events(big))),
        ("GET /", "/", lambda: page.index_page(core, now)),
        (f"GET /?offset={far}", f"/?offset={far}", lambda: page.index_page(core, now, offset=far)),
        ("GET /jobs/big", "/jobs/big", lambda: page.job_page(core, "big", now) or ""),
        ("GET /jobs/big?node_offset=5000&node_limit=1000", "/jobs/big?node_offset=5000&node_limit=1000",
         lambda: page.job_page(core, "big", now, node_offset=5000, node_limit=1000) or ""),
        ("GET /jobs/done-000001", "/jobs/done-000001", lambda: page.job_page(core, "done-000001", now) or ""),
    ]
    print(f"{'view':48} {'median ms':>10} {'max ms':>8} {'bytes':>10} {'HTTP ms':>8}")
    rendered = [(name, path, *timed(make, args.repeat)) for name, path, make in cases]
    http, health, served = asyncio.run(over_http(core, now, [path for _, path, *_ in rendered], args.repeat,
                                                 args.busy))
    for name, path, median, worst, size in rendered:
        print(f"{name:48} {median:10.1f} {worst:8.1f} {size:10,} {http[path]:8.1f}")
    print(f"/healthz while / and /v1/status were fetched back to back for {args.busy:g}s ({served} views): "
          f"median {statistics.median(health):.1f} ms, max {max(health):.1f} ms over {len(health)} probes")


if __name__ == "__main__":
    main()
