"""Replicas on etcd: how fast agents are served again when the leader is killed, whether anything the
servers acknowledged is lost across failovers, and what the etcd store costs a formation.

Everything runs on this machine: a 3-member etcd cluster (Debian's etcd, `make etcd`) on loopback
ports, rdzv-server replicas on it, and simulated agents (_fleet.py: aiohttp + plain msgpack, the
credential of their join on every request, one long-poll held with wait_s 60).

1. Formation: N nodes join one job (min = max = N); the time from the first join until every node
   has its assignment, on the SQLite store and on the etcd store (one replica), same run.
2. Failovers: two replicas, AGENTS agents in JOBS jobs, under load (a worker failure reported every
   0.2 s on average, which restarts that job's round; a new node joining as a spare every second).
   FAILOVERS times: the load is paused (writes in flight answered), the leader SIGKILLed, and
   - renewal: the time from the kill until every agent has sent the poll that the new leader
     answered (the send time of each agent's first answered poll since the kill, the latest one);
   - lost: every acknowledged change checked against the new leader: each job's restart count at
     least the highest one acknowledged, each acknowledged joiner still a node of its job;
   - restarted: jobs whose round id or restart count differ between the killed leader before the
     kill and the new leader once every agent is renewed (a new round = workers restarted);
   then the killed replica is started again (as the standby) and the load resumes.
Targets (issue 15): renewal <= 2 s with 1,000 agents; 0 acknowledged changes lost over 50
failovers; formation of 1,000 nodes on etcd <= 1.5x the SQLite figure.
Run: .venv/bin/python benchmarks/bench_failover.py [--agents 1000] [--failovers 50] (make bench-failover)
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import aiohttp
import msgpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._fleet import HEADERS, Fleet  # noqa: E402
from benchmarks._server import running_server  # noqa: E402
from tests.etcd_cluster import EtcdCluster  # noqa: E402


def start_replica(store: str, prefix: str, port: int = 0, log: str = os.devnull) -> tuple[subprocess.Popen[str], int]:
    """A replica; its JSON log lines are appended to `log`."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port",
                                 str(port), "--store", store, "--etcd-prefix", prefix, "--log-format", "json"],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    match = re.search(r":(\d+)\s*$", proc.stdout.readline())
    if not match:
        raise RuntimeError("replica did not start")
    return proc, int(match.group(1))


def served_at(log: str, after: float) -> float | None:
    """When the replica logging to `log` last finished a takeover (its 'job(s) restored' line) after `after`."""
    found = None
    with open(log) as f:
        for line in f:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if "job(s) restored" in doc.get("message", ""):
                t = datetime.datetime.fromisoformat(doc["time"].replace("Z", "+00:00")).timestamp()
                if t >= after:
                    found = t
    return found


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


async def wait_leader(urls: list[str], timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, url in enumerate(urls):
            if await asyncio.to_thread(ready, url):
                return i
        await asyncio.sleep(0.02)      # polling readiness: no event to wait on across processes
    raise RuntimeError("no replica became the leader")


# ---- 1. formation ----

async def formation(base: str, n: int, job: str) -> tuple[float, float]:
    """Seconds from the first join until all `n` nodes have their assignment, and from the last join
    reply until then (bench_rendezvous.py's figure)."""
    config = {"min_nodes": n, "max_nodes": n, "last_call_s": 30.0, "lease_timeout_s": 30.0}
    joined: list[float] = []

    async def node(session: aiohttp.ClientSession, i: int) -> float:
        body = {"v": 1, "node_id": f"node-{i}", "addr": "127.0.0.1", "local_world_size": 8, "master_port": 1,
                "config": config}
        async with session.post(f"{base}/v1/jobs/{job}/join", data=msgpack.packb(body), headers=HEADERS) as r:
            reply = msgpack.unpackb(await r.read())
            assert r.status == 200, reply
        joined.append(time.perf_counter())
        credential = reply["credential"]
        while reply.get("assignment") is None:
            poll = {"v": 1, "node_id": f"node-{i}", "credential": credential, "known_round": -1, "wait_s": 60.0}
            async with session.post(f"{base}/v1/jobs/{job}/poll", data=msgpack.packb(poll), headers=HEADERS) as r:
                reply = msgpack.unpackb(await r.read())
                assert r.status == 200, reply
        return time.perf_counter()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        t0 = time.perf_counter()
        assigned = await asyncio.gather(*(node(session, i) for i in range(n)))
        return max(assigned) - t0, max(assigned) - max(joined)


def formations(etcd: EtcdCluster, n: int, repeat: int) -> dict[str, tuple[float, float]]:
    """Median (total, after the last join) on each store."""
    runs: dict[str, list[tuple[float, float]]] = {"SQLite": [], "etcd": []}
    with running_server() as port:
        for k in range(repeat):
            runs["SQLite"].append(asyncio.run(formation(f"http://127.0.0.1:{port}", n, f"form-{k}")))
    proc, port = start_replica(etcd.url, f"/bench-formation-{os.getpid()}/")
    try:
        asyncio.run(wait_leader([f"http://127.0.0.1:{port}"]))
        for k in range(repeat):
            runs["etcd"].append(asyncio.run(formation(f"http://127.0.0.1:{port}", n, f"form-{k}")))
    finally:
        proc.terminate()
        proc.wait(30)
    for store, got in runs.items():
        for k, (total, after) in enumerate(got):
            print(f"formation {k}: {n} nodes on {store}: all assigned {total:.2f} s after the first join, "
                  f"{after * 1000:.0f} ms after the last", flush=True)
    return {store: (statistics.median(t for t, _ in got), statistics.median(a for _, a in got))
            for store, got in runs.items()}


# ---- 2. failovers ----

def check_acked(url: str, fleet: Fleet) -> int:
    """Acknowledged changes the replica at `url` does not hold (0 when nothing was lost)."""
    lost = 0
    for job in set(fleet.acked.restarts) | set(fleet.acked.joined):
        with urllib.request.urlopen(f"{url}/v1/jobs/{job}?node_limit=2000", timeout=30) as resp:
            view = json.load(resp)
        if view["restart_count"] < fleet.acked.restarts.get(job, 0):
            print(f"LOST: job {job} restart count {view['restart_count']} < acknowledged "
                  f"{fleet.acked.restarts[job]}", flush=True)
            lost += 1
        present = {n["node_id"] for name in ("nodes", "waiting", "spares", "excluded") for n in view[name]}
        missing = fleet.acked.joined.get(job, set()) - present
        if missing:
            print(f"LOST: job {job}: acknowledged joiners missing: {sorted(missing)[:5]}", flush=True)
            lost += len(missing)
    return lost


def rounds(url: str, jobs: int, settle_s: float = 30.0) -> dict[str, tuple[object, int]]:
    """Each job's (round id, restart count) at the replica at `url`, once every job runs a round (a
    restart the load asked for has formed its new round)."""
    deadline = time.monotonic() + settle_s
    while True:
        found, running = {}, True
        for i in range(jobs):
            with urllib.request.urlopen(f"{url}/v1/jobs/job-{i}?node_limit=1", timeout=30) as resp:
                view = json.load(resp)
            found[f"job-{i}"] = (view["round_id"], view["restart_count"])
            running = running and view["state"] == "running"
        if running or time.monotonic() > deadline:
            return found
        time.sleep(0.1)            # polling another process's state: no event to wait on


async def failovers(etcd: EtcdCluster, agents: int, jobs: int, count: int
                    ) -> tuple[list[float], list[float], int, int, int]:
    prefix = f"/bench-failover-{os.getpid()}/"
    procs: list[subprocess.Popen[str]] = []
    ports: list[int] = []
    logs = [os.path.join(etcd.dir, f"replica-{i}.log") for i in range(2)]
    takeovers: list[float] = []
    for i in range(2):
        proc, port = await asyncio.to_thread(start_replica, etcd.url, prefix, 0, logs[i])
        procs.append(proc)
        ports.append(port)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    per_job = agents // jobs
    config = {"min_nodes": per_job, "max_nodes": per_job, "last_call_s": 1.0, "lease_timeout_s": 10.0,
              "max_restarts": 1_000_000}
    renewals: list[float] = []
    lost = restarted = 0
    paused = asyncio.Event()
    inflight: set[asyncio.Task[None]] = set()
    try:
        await wait_leader(urls)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            fleet = Fleet(session, urls, config)
            first = [fleet.add(f"job-{i % jobs}", f"node-{i}") for i in range(per_job * jobs)]
            await asyncio.wait_for(asyncio.gather(*(a.assigned.wait() for a in first)), 120)
            print(f"{len(first)} agents in {jobs} jobs formed", flush=True)

            async def load() -> None:
                extra = 0
                while True:
                    await asyncio.sleep(random.expovariate(5.0))   # about 5 changes a second
                    if paused.is_set():
                        continue
                    if random.random() < 0.2:
                        fleet.add(f"job-{extra % jobs}", f"extra-{extra}")
                        extra += 1
                    else:
                        task = asyncio.create_task(random.choice(first).fail())
                        inflight.add(task)
                        task.add_done_callback(inflight.discard)

            loader = asyncio.create_task(load())
            for k in range(count):
                await asyncio.sleep(2.0)                          # load runs between failovers
                paused.set()
                await asyncio.gather(*inflight, return_exceptions=True)
                leader = await wait_leader(urls)
                before = await asyncio.to_thread(rounds, urls[leader], jobs)
                fleet.renewed_at.clear()
                fleet.all_renewed.clear()
                fleet.mark = time.time()
                procs[leader].send_signal(signal.SIGKILL)
                killed_at = time.time()
                procs[leader].wait()
                new = await wait_leader(urls)
                try:      # the agents' polls are answered after their holds
                    await asyncio.wait_for(fleet.all_renewed.wait(), 60)
                except asyncio.TimeoutError:
                    late = [a for a in fleet.agents if a.node not in fleet.renewed_at]
                    print(f"{len(late)} agents not renewed in 60 s: " +
                          "; ".join(f"{a.node}: {a.doing}" for a in late[:5]), flush=True)
                waited = [fleet.renewed_at.get(a.node, float("inf")) for a in fleet.agents]
                renewals.append(max(waited) - killed_at)
                served = await asyncio.to_thread(served_at, logs[new], killed_at)
                takeovers.append(served - killed_at if served is not None else float("nan"))
                gone = await asyncio.to_thread(check_acked, urls[new], fleet)
                lost += gone
                after = await asyncio.to_thread(rounds, urls[new], jobs)
                changed = sum(before[job] != after[job] for job in before)   # a new round: workers restarted
                restarted += changed
                print(f"failover {k}: replica {leader} killed; replica {new} served {takeovers[-1]:.2f} s later; "
                      f"every agent renewed with it after {renewals[-1]:.2f} s; {fleet.acked.count} changes "
                      f"acknowledged so far, {gone} lost; {changed} job(s) in a new round; "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
                procs[leader], _ = await asyncio.to_thread(start_replica, etcd.url, prefix, ports[leader],
                                                           logs[leader])
                paused.clear()
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            await fleet.close()
            if fleet.lost or fleet.refused:
                print(f"agents lost: {fleet.lost[:10]} ({len(fleet.lost)}); joins refused: {fleet.refused[:10]} "
                      f"({len(fleet.refused)})", flush=True)
            return renewals, takeovers, lost + len(fleet.lost), fleet.acked.count, restarted
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=10)
    p.add_argument("--failovers", type=int, default=50)
    p.add_argument("--formation-nodes", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3, help="formations on each store")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))     # stop like Ctrl-C: every process cleaned up
    print(f"load average at start {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as tmp, EtcdCluster(3, base_dir=tmp) as etcd:
        if args.formation_nodes:
            got = formations(etcd, args.formation_nodes, args.repeat)
            (sq_total, sq_after), (et_total, et_after) = got["SQLite"], got["etcd"]
            print(f"RESULT formation nodes={args.formation_nodes} total_s sqlite={sq_total:.2f} etcd={et_total:.2f} "
                  f"ratio={et_total / sq_total:.2f}; after_last_join_ms sqlite={sq_after * 1000:.0f} "
                  f"etcd={et_after * 1000:.0f} ratio={et_after / sq_after:.2f} (target <= 1.5); "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
        if args.failovers:
            renewals, takeovers, lost, acked, restarted = asyncio.run(
                failovers(etcd, args.agents, args.jobs, args.failovers))
            p90 = sorted(renewals)[int(0.9 * (len(renewals) - 1))]
            print(f"RESULT failovers={len(renewals)} agents={args.agents} renewal_s median="
                  f"{statistics.median(renewals):.2f} p90={p90:.2f} max={max(renewals):.2f} (target <= 2) "
                  f"takeover_s median={statistics.median(takeovers):.2f} max={max(takeovers):.2f} "
                  f"acknowledged={acked} lost={lost} (target 0) jobs_restarted_by_failover={restarted} "
                  f"(target 0); load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
