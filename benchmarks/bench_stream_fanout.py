"""The server's own cost of a round change on the stream, in process (no sockets, no other work in the way).

N nodes join one job and subscribe (streams.StreamHub with connections that only count frames); one
node reports a worker failure. Printed: the report's own handling (the core forms the new round), and
the fan-out: every subscriber's view looked at and its new frame encoded and handed to its connection.
What a real server adds is the kernel's write per node and the machine's other work (bench_scale.py
measures those, end to end).

Run: .venv/bin/python benchmarks/bench_stream_fanout.py [--nodes 1000,10000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from protocol.errors import ErrorCode  # noqa: E402
from protocol.messages import FailureReport, JobConfig, JoinRequest, WorkerFailure  # noqa: E402
from rdzv_server.coordinator import Coordinator  # noqa: E402
from rdzv_server.streams import StreamHub  # noqa: E402


class CountingStream:
    def __init__(self) -> None:
        self.frames = 0

    def push(self, frame: bytes) -> bool:
        self.frames += 1
        return True

    def close(self, code: ErrorCode, message: str, leader: str = "") -> None:
        pass                  # only when the coordinator stops at the end

    def kernel_silence_s(self) -> float:
        return 0.0


async def one(n: int, probe_port: int) -> str:
    coord = Coordinator()
    await coord.start()
    hub = StreamHub(coord)
    cfg = JobConfig(min_nodes=n, max_nodes=n, max_restarts=5, last_call_s=0.0, lease_timeout_s=600.0)
    streams = []
    for i in range(n):
        status = await coord.handle("j", JoinRequest(v=1, node_id=f"n{i}", addr=f"10.0.{i // 250}.{i % 250}",
                                                     local_world_size=8, master_port=1, config=cfg,
                                                     instance=f"n{i}", probe_port=probe_port))
        stream = CountingStream()
        hub.subscribe(hub.opened("j", f"n{i}", stream), status.credential, -1, 0)
        streams.append((f"n{i}", status.credential, stream))
    job = coord.core.jobs["j"]
    assert job.round is not None
    node, credential, _ = streams[n // 2]
    fanout = 0.0
    push_views = hub._push_views

    def timed(job_id: str, subs: set) -> None:  # type: ignore[type-arg]
        nonlocal fanout
        started = time.perf_counter()
        push_views(job_id, subs)
        fanout = time.perf_counter() - started

    hub._push_views = timed  # type: ignore[method-assign]
    before = sum(s.frames for _, _, s in streams)
    started = time.perf_counter()
    await coord.handle("j", FailureReport(v=1, node_id=node, credential=credential, round_id=job.round.round_id,
                                          failures=[WorkerFailure(local_rank=0, rank=0, exitcode=1)]))
    reply = time.perf_counter() - started
    for _ in range(3):                       # the flush runs soon after the wake (call_soon)
        await asyncio.sleep(0)
    pushed = sum(s.frames for _, _, s in streams) - before
    await coord.stop()
    return (f"{n:>6} nodes, probe port {probe_port or 'none':>5}: the report handled in {1000 * reply:6.1f} ms, "
            f"fan-out {1000 * fanout:6.1f} ms for {pushed} frames ({1e6 * fanout / max(pushed, 1):.1f} us each)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=lambda v: [int(x) for x in v.split(",")], default=[1000, 10000])
    args = p.parse_args()
    for n in args.nodes:
        for probe_port in (29600, 0):
            print(asyncio.run(one(n, probe_port)), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
