"""What one open, subscribed stream costs the server in memory (issue 23's RSS goal: 10,000 streams
in <= 150 MB).

A real rdzv-server (no state dir; `--store`: SQLite) and N stream nodes from this process
(aiohttp's WebSocket client, plain msgpack frames), `--batch` at a time: each says hello, joins one
job of N nodes and subscribes. Reported: the
server's RSS before the nodes, once all hold their assignment, and the difference per stream; the
server is asked for its RSS after a few seconds of heartbeats, so what the join storm freed and
kept counts too.
Run: .venv/bin/python benchmarks/bench_stream_memory.py [--nodes 4000] [--loop uvloop|asyncio] [--store] [--batch 200]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import aiohttp
import msgpack
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(loop: str, state_dir: str) -> tuple[subprocess.Popen[str], int]:
    server = os.path.join(os.path.dirname(sys.executable), "rdzv-server")
    cmd = [server, "--host", "127.0.0.1", "--port", "0", "--state-dir", state_dir, "--event-loop", loop]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if (m := re.search(r"listening on http://[^:]+:(\d+)", line)) is not None:
            return proc, int(m.group(1))
    proc.kill()
    raise SystemExit("rdzv-server did not start")


Stream = aiohttp.ClientWebSocketResponse


def assigned(msg: aiohttp.WSMessage) -> bool:
    """Whether a message from the server is a status holding the node's assignment (its round)."""
    if msg.type is not aiohttp.WSMsgType.BINARY:
        raise SystemExit(f"a stream ended before its round: {msg}")
    frame = msgpack.unpackb(msg.data)
    return frame.get("t") == "status" and bool(frame["status"].get("assignment"))


async def node(http: aiohttp.ClientSession, port: int, i: int, n: int) -> tuple[Stream, bool]:
    """A node's stream, joined and subscribed; and whether its first status holds its assignment."""
    ws = await http.ws_connect(f"http://127.0.0.1:{port}/v1/jobs/mem/stream")
    await ws.send_bytes(msgpack.packb({"t": "hello", "v": 1, "node_id": f"n{i}"}))
    body = {"v": 1, "node_id": f"n{i}", "addr": f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", "local_world_size": 8,
            "master_port": 29500, "config": {"min_nodes": n, "max_nodes": n, "lease_timeout_s": 60.0}}
    await ws.send_bytes(msgpack.packb({"t": "request", "id": 1, "action": "join", "body": body}))
    reply = msgpack.unpackb((await ws.receive()).data)
    await ws.send_bytes(msgpack.packb({"t": "subscribe", "credential": reply["status"]["credential"],
                                       "known_round": -1}))
    return ws, assigned(await ws.receive())


async def until_assigned(nodes: list[tuple[Stream, bool]], deadline_s: float) -> None:
    """Every node's stream has pushed it a status with an assignment (the round formed)."""
    async def one(ws: Stream) -> None:
        while not assigned(await ws.receive()):
            pass
    await asyncio.wait_for(asyncio.gather(*(one(ws) for ws, done in nodes if not done)), deadline_s)


async def measure(port: int, server: psutil.Process, n: int, settle_s: float, batch: int) -> dict[str, float]:
    before = server.memory_info().rss
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        nodes: list[tuple[Stream, bool]] = []
        started = time.monotonic()
        for first in range(0, n, batch):
            nodes += await asyncio.gather(*(node(http, port, i, n) for i in range(first, min(n, first + batch))))
        await until_assigned(nodes, 120.0)
        streams = [ws for ws, _ in nodes]
        formed = time.monotonic() - started
        heartbeat = msgpack.packb({"t": "heartbeat"})
        for _ in range(int(settle_s)):
            await asyncio.gather(*(ws.send_bytes(heartbeat) for ws in streams))
            await asyncio.sleep(1.0)
        after = server.memory_info().rss
        for ws in streams:
            await ws.close()
    return {"rss_before_mib": before / 2**20, "rss_streams_mib": after / 2**20,
            "kib_per_stream": (after - before) / n / 1024, "formed_s": formed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4000)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of heartbeats before the RSS is read")
    ap.add_argument("--batch", type=int, default=200, help="nodes opening their streams at once")
    ap.add_argument("--store", action="store_true", help="the server keeps its state (SQLite, in a temporary dir)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))     # N client sockets here
    if args.nodes + 64 > hard:
        raise SystemExit(f"{args.nodes} streams need an open-file limit over {args.nodes + 64} (ulimit -n: {hard})")
    with tempfile.TemporaryDirectory() as state:
        proc, port = start_server(args.loop, state if args.store else "none")
        try:
            figures = asyncio.run(measure(port, psutil.Process(proc.pid), args.nodes, args.settle, args.batch))
        finally:
            proc.terminate()
            proc.wait(10)
    figures = {k: round(v, 1) for k, v in figures.items()}
    print(json.dumps({"nodes": args.nodes, "loop": args.loop, "store": args.store, **figures}))
    store = "SQLite store" if args.store else "no store"
    print(f"{args.nodes} subscribed streams ({args.loop}, {store}): server RSS {figures['rss_before_mib']:.0f} -> "
          f"{figures['rss_streams_mib']:.0f} MiB, {figures['kib_per_stream']:.1f} KiB a stream "
          f"(10,000 streams: ~{figures['rss_before_mib'] + figures['kib_per_stream'] * 10000 / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
