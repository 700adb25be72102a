"""What `bench_first_step.py` measured, read from the workers' markers; its table and its chart.

Markers (examples/train_ddp.py --markers): `WHAT RANK RESTART TIME` lines, TIME from time.time() in each
worker (one clock for every process on the machine). A recovery runs from the `crash` line to the last
rank's first `step` after it; its parts are those of that last rank: restart (crash -> the new
interpreter's first line), import, CUDA (the context; none on the CPU), process group, model + optimizer,
snapshot load, first step.
"""
from __future__ import annotations

import statistics
from typing import Any

PARTS = (("restart", "start"), ("import", "import"), ("CUDA", "cuda"), ("process group", "pg"),
         ("model + optimizer", "built"), ("snapshot load", "loaded"), ("first step", "step"))


def read_markers(path: str) -> list[tuple[str, int, float]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 4 and parts[1].isdigit():
                    out.append((parts[0], int(parts[1]), float(parts[3])))
    except FileNotFoundError:
        pass
    return out


def recovery(markers: list[tuple[str, int, float]], world: int) -> dict[str, Any] | None:
    """The recovery's total and parts, or None when some rank never stepped again after the crash."""
    crashes = [t for what, _, t in markers if what == "crash"]
    if not crashes:
        return None
    crash = min(crashes)
    first: dict[int, dict[str, float]] = {}
    for what, rank, t in sorted(markers, key=lambda m: m[2]):
        if t > crash:
            first.setdefault(rank, {}).setdefault(what, t)
    if sorted(r for r, seen in first.items() if "step" in seen) != list(range(world)):
        return None
    last = max(first, key=lambda r: first[r]["step"])
    times, parts, before = first[last], {}, crash
    for name, marker in PARTS:
        if marker not in times:
            return None
        parts[name] = times[marker] - before
        before = times[marker]
    return {"total": times["step"] - crash, "parts": parts, "last_rank": last}


def _spread(values: list[float]) -> str:
    if not values:
        return ""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{min(values):.2f}-{max(values):.2f}"


def table(runs: list[dict[str, Any]], launchers: list[str]) -> str:
    """Markdown: per launcher, the total's median and range, and each part's range."""
    head = "| launcher | crash -> all ranks stepping again: median (range), s | " + \
        " | ".join(name for name, _ in PARTS) + " |"
    lines = [head, "|" + "---|" * (2 + len(PARTS))]
    for name in launchers:
        mine = [r for r in runs if r["launcher"] == name]
        done = [r for r in mine if r["result"] is not None]
        totals = [r["result"]["total"] for r in done]
        total = f"**{statistics.median(totals):.2f}** ({_spread(totals)})" if totals else "never"
        if len(done) < len(mine):
            total += f"; in {len(mine) - len(done)} of {len(mine)} runs no rank stepped again ({_why(mine)})"
        cells = [_spread([r["result"]["parts"].get(part, 0.0) for r in done]) for part, _ in PARTS]
        lines.append(f"| {name} | {total} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _why(runs: list[dict[str, Any]]) -> str:
    """How the runs in which no rank stepped again ended: killed at the time limit, or the job failed."""
    hung = sum(1 for r in runs if r["result"] is None and r["timed_out"])
    failed = sum(1 for r in runs if r["result"] is None and not r["timed_out"])
    return ", ".join(text for n, text in ((hung, f"{hung} hung, killed at {runs[0]['timeout_s']:g} s"),
                                          (failed, f"{failed} failed: the launchers exited non-zero")) if n)


def medians(runs: list[dict[str, Any]], launcher: str) -> float | None:
    totals = [r["result"]["total"] for r in runs if r["launcher"] == launcher and r["result"] is not None]
    return statistics.median(totals) if totals else None


def plot(runs: list[dict[str, Any]], launchers: list[str], path: str, note: str) -> None:
    """A stacked bar per run, grouped by launcher (matplotlib, from the `bench` extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.45 * len(runs)))
    colors = ["#8c564b", "#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#ff7f0e", "#d62728"]
    labels, y = [], 0
    totals = [r["result"]["total"] for r in runs if r["result"] is not None]
    hung_width = max(totals) * 1.1 if totals else max(r["timeout_s"] for r in runs)   # keep the scale readable
    for launcher in launchers:
        for k, run in enumerate(r for r in runs if r["launcher"] == launcher):
            labels.append(f"{launcher} #{k + 1}")
            result = run["result"]
            if result is None:
                ax.barh(y, hung_width, color="#dddddd", hatch="//", edgecolor="#999999")
                why = f"hung, killed at {run['timeout_s']:g} s" if run["timed_out"] else "the job failed"
                ax.text(0.2, y, f"no rank stepped again ({why})", va="center", fontsize=8)
            else:
                left = 0.0
                for (part, _), color in zip(PARTS, colors, strict=True):
                    width = max(0.0, result["parts"].get(part, 0.0))   # older runs had no CUDA part
                    ax.barh(y, width, left=left, color=color)
                    left += width
                ax.text(left + 0.1, y, f"{result['total']:.1f} s", va="center", fontsize=8)
            y += 1
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the crash until every rank has finished a training step again")
    ax.set_title(f"Crash -> training again\n{note}", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors]
    ax.legend(handles, [p for p, _ in PARTS], fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              ncol=len(PARTS), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
