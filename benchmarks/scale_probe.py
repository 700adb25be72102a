"""What `bench_scale.py` reads from outside the fleet: the server process, the machine, the server's views.

- `ServerSampler`: the server process's CPU time and RSS (psutil), sampled in the background so a
  window's CPU and the peak RSS are known; the whole machine's busy time beside it, so a figure taken
  while other work ran on the machine says so.
- `load()`: the load average (os.getloadavg) noted with every figure.
- `server_counters()`: nodes lost and rounds formed, by cause, from `/metrics` (counters that see
  every event, unlike a job's event list, which keeps the last 1,000).
- `time_views()`: the status views' response times under load.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
import urllib.request
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

STATUS_VIEWS = ("/v1/status", "/v1/jobs/{job}", "/metrics")
VIEW_TIMEOUT_S = 30.0


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_busy_s() -> float:
    """CPU-seconds the whole machine spent busy (every core, every process) since boot."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


class ServerSampler:
    """Samples the server process every `interval` s in a thread: peak RSS and CPU at window marks."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ServerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def mark(self) -> dict[str, float]:
        """A point to measure a window from: server CPU, machine busy time, wall time, RSS."""
        cpu = self.proc.cpu_times()
        rss = self.proc.memory_info().rss
        self.peak_rss = max(self.peak_rss, rss)
        return {"t": time.monotonic(), "cpu_s": cpu.user + cpu.system, "busy_s": machine_busy_s(), "rss": rss,
                "load": load()}


def window(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Server CPU and machine busy time between two marks, as % of one core."""
    dt = max(b["t"] - a["t"], 1e-9)
    return {"seconds": round(dt, 2), "server_cpu_pct": round(100 * (b["cpu_s"] - a["cpu_s"]) / dt, 1),
            "machine_busy_pct": round(100 * (b["busy_s"] - a["busy_s"]) / dt, 1),
            "machine_cores": psutil.cpu_count(), "load_start": a["load"], "load_end": b["load"]}


def _get(port: int, path: str, timeout: float = 60.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return resp.status, resp.read()


def server_counters(port: int) -> dict[str, Any]:
    """Nodes lost and rounds formed (by cause) since the server started, and its worst loop lag."""
    _, body = _get(port, "/metrics")
    lost, rounds, lag, open_polls = 0.0, {}, 0.0, 0.0
    store = {"commits": 0, "commit_s": 0.0, "commit_max_s": 0.0}
    names = {"rdzv_store_commits_total": "commits", "rdzv_store_commit_seconds_total": "commit_s",
             "rdzv_store_commit_max_seconds": "commit_max_s"}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name in names:
                store[names[s.name]] = round(s.value, 4)
            elif s.name == "rdzv_nodes_lost_total":
                lost = s.value
            elif s.name == "rdzv_rounds_total":
                rounds[s.labels["cause"]] = int(s.value)
            elif s.name == "rdzv_event_loop_lag_max_seconds":
                lag = s.value
            elif s.name == "rdzv_open_long_polls":
                open_polls = s.value
    return {"nodes_lost": int(lost), "rounds": {k: v for k, v in rounds.items() if v}, "loop_lag_max_s": lag,
            "open_long_polls": int(open_polls), "store": store}


def lost_events(port: int, job: str, limit: int = 5) -> list[str]:
    """The last few node_lost messages of a job (the events API keeps the last 1,000 events)."""
    import json
    _, body = _get(port, f"/v1/jobs/{job}/events")
    events = [e["message"] for e in json.loads(body)["events"] if e["kind"] == "node_lost"]
    return events[-limit:]


def time_views(port: int, job: str, samples: int, spacing_s: float) -> dict[str, Any]:
    """Each status view fetched `samples` times, `spacing_s` apart: response time and size."""
    out: dict[str, Any] = {}
    times: dict[str, list[float]] = {v: [] for v in STATUS_VIEWS}
    sizes: dict[str, int] = {}
    errors: dict[str, list[str]] = {v: [] for v in STATUS_VIEWS}
    for _ in range(samples):
        for view in STATUS_VIEWS:
            path = view.format(job=job)
            t0 = time.perf_counter()
            try:
                status, body = _get(port, path, VIEW_TIMEOUT_S)
            except (OSError, ValueError) as exc:       # a view that does not answer is a figure too
                errors[view].append(f"{type(exc).__name__}: {exc} after {time.perf_counter() - t0:.1f} s")
                continue
            times[view].append(time.perf_counter() - t0)
            sizes[view] = len(body)
            if status != 200:
                errors[view].append(f"HTTP {status}")
        time.sleep(spacing_s)         # a reader's pace, not a synchronisation
    for view, ts in times.items():
        out[view] = {"median_ms": round(1000 * statistics.median(ts), 1) if ts else None,
                     "max_ms": round(1000 * max(ts), 1) if ts else None, "bytes": sizes.get(view),
                     "samples": len(ts)}
        if errors[view]:
            out[view].update(failed=len(errors[view]), error=errors[view][0])
            out[view]["max_ms"] = 1000 * VIEW_TIMEOUT_S     # at least this long: it did not answer in time
    return out
