"""PNG plots of `bench_scale.py` results against N (matplotlib, from the `bench` extra).

Each plot shows this server's one-job runs, the issue's goal for 10,000 nodes, and for reference the
figures issue 14 quoted (this project before the fleet-scale work, and torchft's lighthouse).
"""
from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Figures quoted in issue 14 (measured side by side on this machine before the work).
BEFORE = {
    "formation_first_s": {10000: 8.3},                 # 6.8-9.8 s
    "wake_p99_ms": {1000: 106, 5000: 916, 10000: 3400},
    "wake_p50_ms": {1000: 78, 5000: 752, 10000: 3200},
    "failure_reply_ms": {1000: 44, 5000: 590, 10000: 2800},
    "rss_mib": {1000: 62, 5000: 144, 10000: 240},
}
TORCHFT_FORMATION_S = {128: (0.14, 0.41), 1000: (3.6, 9.3)}
GOALS = {"last_join_s": 1.0, "wake_p99_ms": 250.0, "failure_reply_ms": 100.0, "cpu_pct": 35.0,
         "rss_mib": 150e6 / 2 ** 20}


def _series(runs: list[dict[str, Any]], *path: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in runs:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if v is not None:
            xs.append(r["nodes"])
            ys.append(float(v))
    return xs, ys


def _extra(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in doc["scenarios"] if r["kind"] in ("many_jobs", "overload")]


def _finish(ax: Any, title: str, ylabel: str, path: str, load: str) -> str:
    ax.set_xscale("log")
    ax.set_xlabel("nodes (log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.figure.text(0.01, 0.01, f"2-core machine, load average (1 min) during runs: {load}", fontsize=7, alpha=0.7)
    ax.figure.tight_layout(rect=(0, 0.03, 1, 1))
    ax.figure.savefig(path, dpi=110)
    plt.close(ax.figure)
    return path


def _loads(runs: list[dict[str, Any]]) -> str:
    vals = [x for r in runs for x in (r["load_start"][0], r["load_end"][0])]
    return f"{min(vals):.1f}-{max(vals):.1f}" if vals else "-"


def plot_all(doc: dict[str, Any], folder: str) -> list[str]:
    runs = sorted((r for r in doc["scenarios"] if r["kind"] == "one_job"), key=lambda r: r["nodes"])
    if not runs:
        return []
    load = _loads(runs + _extra(doc))
    out = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(*_series(runs, "formation", "first_join_to_all_assigned_s"), "o-", label="first join -> all assigned")
    ax.plot(*_series(runs, "formation", "last_join_to_all_assigned_s"), "s-", label="last join -> all assigned")
    ax.plot(list(BEFORE["formation_first_s"]), list(BEFORE["formation_first_s"].values()), "x", color="gray",
            markersize=9, label="before (issue 14): first join -> all")
    for n, (lo, hi) in TORCHFT_FORMATION_S.items():
        ax.plot([n, n], [lo, hi], "-", color="tab:red", linewidth=3, alpha=0.5)
    ax.plot([], [], "-", color="tab:red", linewidth=3, alpha=0.5, label="torchft lighthouse (issue 14)")
    ax.axhline(GOALS["last_join_s"], color="green", linestyle="--", label="goal: last join -> all <= 1 s")
    ax.set_yscale("log")
    out.append(_finish(ax, "Round formation, one job", "seconds (log scale)",
                       os.path.join(folder, "bench-scale-formation.png"), load))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(*_series(runs, "round_change", "wake_p50_ms"), "o-", label="every waiting node answered, p50")
    ax.plot(*_series(runs, "round_change", "wake_p99_ms"), "s-", label="every waiting node answered, p99")
    ax.plot(*_series(runs, "round_change", "failure_reply_ms"), "^-", label="the failure report's own reply")
    ax.plot(list(BEFORE["wake_p99_ms"]), list(BEFORE["wake_p99_ms"].values()), "x--", color="gray",
            label="before (issue 14): p99")
    ax.axhline(GOALS["wake_p99_ms"], color="green", linestyle="--", label="goal: p99 <= 250 ms")
    ax.axhline(GOALS["failure_reply_ms"], color="olive", linestyle=":", label="goal: failure reply <= 100 ms")
    ax.set_yscale("log")
    out.append(_finish(ax, "After a round change (one node reports a failure)", "ms (log scale)",
                       os.path.join(folder, "bench-scale-wake.png"), load))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(*_series(runs, "steady", "server_cpu_pct"), "o-", label="server CPU, steady state")
    ax.plot(*_series(runs, "steady", "machine_busy_pct"), ".:", color="gray",
            label="whole machine busy (of 200%: clients, others)")
    for r in _extra(doc):
        ax.plot(r["nodes"], r["steady"]["server_cpu_pct"], "D", label=f"{r['kind'].replace('_', ' ')}")
    ax.axhline(GOALS["cpu_pct"], color="green", linestyle="--", label="goal at 10,000: <= 35%")
    out.append(_finish(ax, "Server CPU with every node holding a long-poll", "% of one core",
                       os.path.join(folder, "bench-scale-cpu.png"), load))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(*_series(runs, "steady", "server_rss_mib"), "o-", label="server RSS, steady state")
    ax.plot(*_series(runs, "server_rss_peak_mib"), "s:", label="server RSS, peak")
    ax.plot(list(BEFORE["rss_mib"]), list(BEFORE["rss_mib"].values()), "x--", color="gray",
            label="before (issue 14)")
    for r in _extra(doc):
        ax.plot(r["nodes"], r["steady"]["server_rss_mib"], "D", label=f"{r['kind'].replace('_', ' ')}")
    ax.axhline(GOALS["rss_mib"], color="green", linestyle="--", label="goal at 10,000: <= 150 MB")
    out.append(_finish(ax, "Server memory", "MiB", os.path.join(folder, "bench-scale-rss.png"), load))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    everything = runs + _extra(doc)
    ax.plot(*_series(runs, "losses", "nodes_lost"), "o-", label="nodes declared lost (one job)")
    ax.plot(*_series(runs, "losses", "extra_rounds"), "s-", label="rounds beyond the expected (one job)")
    ax.plot(*_series(runs, "losses", "rejoins"), "^:", label="rejoins (nodes told gone)")
    for r in _extra(doc):
        ax.plot(r["nodes"], r["losses"]["spurious"], "D", label=f"{r['kind'].replace('_', ' ')}: lost + extra rounds")
    ax.axhline(0, color="green", linestyle="--", label="goal: 0")
    top = max([1.0] + [float(r["losses"][k]) for r in everything for k in ("nodes_lost", "extra_rounds", "rejoins")])
    ax.set_ylim(-0.05 * top, top * 1.15)
    out.append(_finish(ax, "Spurious losses", "count", os.path.join(folder, "bench-scale-losses.png"), load))
    return out
