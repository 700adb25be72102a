"""What one peer copy costs (issue 46): a snapshot file in /dev/shm pushed to a holder's store and fetched back
over loopback, with the agents' own code (node_agent/replicas: sha256 while sending and receiving, and again
before a fetch is served), uncapped and at --replica-bandwidth's default; and sha256 alone, for scale. On a real
network the NIC's rate bounds it too: a copy of S bytes every I seconds keeps up while S / I stays under both.

Run: .venv/bin/python benchmarks/bench_copy_speed.py [--sizes 64,256,1024] [--runs 3]   (make bench-copy-speed)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from node_agent.client.listener import Listener, agent_caps  # noqa: E402
from node_agent.copies import client, wire  # noqa: E402
from node_agent.copies.store import CopyStore  # noqa: E402
from node_agent.settings import WorkerSettings  # noqa: E402
from protocol.messages import CopySource  # noqa: E402

KEY = "bench-copy-speed-key-0123456789"
BASE = "/dev/shm" if os.path.isdir("/dev/shm") else None


def _snapshot_file(where: str, mb: int) -> str:
    path = os.path.join(where, "step-1")
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    return path


def _sha_seconds(path: str) -> float:
    began = time.perf_counter()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return time.perf_counter() - began


async def one_size(mb: int, runs: int) -> dict:
    size = mb << 20
    with tempfile.TemporaryDirectory(dir=BASE) as tmp:
        src = _snapshot_file(tmp, mb)
        store = CopyStore(os.path.join(tmp, "held"), 4 * size, {"a": CopySource(node_id="a", token=KEY)},
                             round_now=lambda: 1, reach=lambda: wire.MAX_STEP)

        async def handle(line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if wire.is_copy_request(line):
                await store.serve(line, reader, writer)

        server = Listener(handle, agent_caps(), print, name="bench")          # the agent's own listener
        port = await server.start("127.0.0.1")
        times: dict[str, list[float]] = {"sha256": [], "push": [], "push_capped": [], "fetch": []}
        try:
            for i in range(runs):
                times["sha256"].append(_sha_seconds(src))
                for label, rate in (("push", None), ("push_capped", float(WorkerSettings.copy_bandwidth))):
                    step = 2 * i + (label == "push_capped") + 1
                    began = time.perf_counter()
                    done = await client.push("127.0.0.1", port, key=KEY, node_id="a", local_rank=0, step=step,
                                             path=src, bandwidth_bytes_s=rate)
                    times[label].append(time.perf_counter() - began)
                    assert done.ok, done
                dest = os.path.join(tmp, f"fetched-{i}")
                os.makedirs(dest)
                began = time.perf_counter()
                got = await client.fetch("127.0.0.1", port, key=KEY, node_id="a", local_rank=0, dest_dir=dest)
                times["fetch"].append(time.perf_counter() - began)
                assert got.step is not None, got
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(dest, f"step-{got.step}"))
        finally:
            await server.close()
    row = {"mb": mb, **{k: round(statistics.median(v), 3) for k, v in times.items()}}
    row.update({f"{k}_gb_s": round(size / 2**30 / row[k], 2) for k in times})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,256,1024", help="snapshot sizes, MiB")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = []
    for mb in (int(x) for x in args.sizes.split(",")):
        rows.append(asyncio.run(one_size(mb, args.runs)))
        r = rows[-1]
        print(f"{mb:>6} MiB: sha256 {r['sha256']:.3f} s ({r['sha256_gb_s']} GiB/s); push {r['push']:.3f} s "
              f"({r['push_gb_s']} GiB/s), at the 1 GiB/s default cap {r['push_capped']:.3f} s; fetch "
              f"{r['fetch']:.3f} s ({r['fetch_gb_s']} GiB/s)  [{os.cpu_count()} CPUs]", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
