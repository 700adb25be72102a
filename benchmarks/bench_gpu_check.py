"""The built-in GPU check's cost without a GPU: 8 GPUs behind a stand-in NVML whose every call takes a set
time (0, 1, 4 ms: NVML's calls take about 1-4 ms each on a real node), run as the agent runs it (in a
thread), while the event loop's lag is measured by a 1 ms ticker. Prints calls per GPU, the check's time,
and the loop's worst lag. The real figure comes from `make gpu-check` on a GPU node.
Run: .venv/bin/python benchmarks/bench_gpu_check.py
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from node_agent.gpu.health import check_gpus  # noqa: E402
from node_agent.gpu.nvml import NvmlReader  # noqa: E402
from tests.unit.test_gpu_health import FakeNvml  # noqa: E402

GPUS = 8


class SlowNvml(FakeNvml):
    """The test's stand-in for pynvml, each call taking `latency` seconds (blocking, as NVML's do)."""

    def __init__(self, latency: float) -> None:
        super().__init__(nvmlDeviceGetCount=GPUS)
        self.latency = latency

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)

        def slow(*args: Any) -> Any:
            if self.latency:
                time.sleep(self.latency)
            return call(*args)
        return slow


async def lag_during(work: Any) -> float:
    """The worst delay of a 1 ms ticker while `work` runs in a thread (the agent's way)."""
    worst, stop = 0.0, asyncio.Event()

    async def tick() -> None:
        nonlocal worst
        while not stop.is_set():
            began = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - began - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.to_thread(work)
    stop.set()
    await ticker
    return worst


def main() -> None:
    print(f"built-in GPU check, {GPUS} GPUs, stand-in NVML (median of 10 checks):")
    for latency in (0.0, 0.001, 0.004):
        nv = SlowNvml(latency)
        reader = NvmlReader(load=lambda nv=nv: nv)   # type: ignore[misc]
        reader.open()
        reader.devices()
        nv.calls.clear()
        indices = list(range(GPUS))
        times = [check_gpus(reader, indices).seconds for _ in range(10)]
        per_gpu = len(nv.calls) / 10 / GPUS
        lag = asyncio.run(lag_during(lambda: check_gpus(reader, indices)))  # noqa: B023
        print(f"  {latency * 1000:.0f} ms per NVML call: {per_gpu:.0f} calls per GPU, check "
              f"{statistics.median(times) * 1000:.2f} ms, event loop's worst lag meanwhile {lag * 1000:.2f} ms")


if __name__ == "__main__":
    main()
