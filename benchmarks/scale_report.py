"""Text forms of `bench_scale.py` results: one line per scenario as it ends, a markdown table at the end."""
from __future__ import annotations

from typing import Any


def _get(r: dict[str, Any], *path: str, default: Any = None) -> Any:
    for p in path:
        if not isinstance(r, dict) or p not in r:
            return default
        r = r[p]
    return r


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms"


def _s(v: float | None) -> str:
    return "-" if v is None else (f"{v:.2f} s" if v >= 1 else f"{1000 * v:.0f} ms")


def _load(r: dict[str, Any]) -> str:
    return f"{r['load_start'][0]:.1f}->{r['load_end'][0]:.1f}"


def _clients(r: dict[str, Any]) -> str:
    """The clients' worst CPU (% of a core) and loop lag over the phases, and whether they were the limit."""
    phases = [_get(r, *p) for p in (("formation", "clients"), ("steady", "clients"), ("round_change", "clients"))]
    phases = [p for p in phases if p]
    cpu = max((max(p["cpu_pct"]) for p in phases), default=0)
    lag = max((max(p["loop_lag_p99_ms"]) for p in phases), default=0)
    flag = " (limit?)" if any(p["bottleneck"] for p in phases) else ""
    return f"{cpu:.0f}% / {lag:.0f} ms{flag}"


def _others(r: dict[str, Any]) -> str:
    """CPU (% of a core) the machine's other work took during the steady window and the round change:
    on 2 shared cores, work beside the benchmark delays the server whatever its priority."""
    vals = [_get(r, "steady", "others_pct"), _get(r, "round_change", "window", "others_pct")]
    return " / ".join("-" if v is None else f"{v:.0f}%" for v in vals)


def _label(r: dict[str, Any]) -> str:
    if r["kind"] == "many_jobs":
        return f"{r['jobs']} jobs x {r['nodes_per_job']:,} ({r['duration_s']:.0f} s)"
    if r["kind"] == "overload":
        extra = f", {r['server_cpu_note']}" if r.get("server_cpu_note") else ""
        return f"overload {r['nodes']:,} ({r.get('load_factor')}x of {r.get('kept_up_with', 0):,}{extra})"
    return f"{r['nodes']:,}"


def summary_line(r: dict[str, Any]) -> str:
    f, st, rc, lo = r["formation"], r["steady"], r["round_change"], r["losses"]
    first = f.get("first_join_to_all_assigned_s", _get(f, "first_job", "first_join_to_all_assigned_s"))
    last = f.get("last_join_to_all_assigned_s", _get(f, "first_job", "last_join_to_all_assigned_s"))
    views = r.get("status_views", {}).get("/v1/status", {})
    return (f"[{_label(r)}] formation first->all {_s(first)}, last->all {_s(last)}; wake p50/p99 "
            f"{_ms(rc.get('wake_p50_ms'))}/{_ms(rc.get('wake_p99_ms'))} ({rc['answered']}/{rc['expected']}), "
            f"failure reply {_ms(rc['failure_reply_ms'])}"
            + (f", server's fan-out {_ms(rc['server_fan_out_ms'])}" if rc.get("server_fan_out_ms") else "")
            + f"; steady CPU {st['server_cpu_pct']:.0f}% "
            f"({st['polls_per_s']:.0f} polls/s, {st['server_cpu_us_per_poll'] or '-'} us/poll), "
            f"RSS {st['server_rss_mib']:.0f} MiB; /v1/status {_ms(views.get('median_ms'))} "
            f"(max {_ms(views.get('max_ms'))}); lost "
            f"{lo['nodes_lost']}, extra rounds {lo['extra_rounds']}, rejoins {lo['rejoins']}; clients {_clients(r)}; "
            f"load {_load(r)}, others {_others(r)}" + (f"; CAPPED: {r['capped']}" if r.get("capped") else ""))


HEADER = ("| nodes | formation: first join -> all / last join -> all | round change: wake p50 / p99 | failure reply "
          "| steady CPU (% core) / polls/s | RSS steady / peak | /v1/status median (max) | lost / extra rounds "
          "/ rejoins | clients: max CPU / lag p99 | load 1-min | others' CPU: steady / round change |\n"
          + "|---" * 11 + "|")


def markdown_table(doc: dict[str, Any]) -> str:
    rows = [HEADER]
    order = {"one_job": 0, "many_jobs": 1, "overload": 2}
    for r in sorted(doc["scenarios"], key=lambda r: (order.get(r["kind"], 9), r["nodes"], r["kind"])):
        if r["kind"] == "blip":          # its own figures (scale_blip.py), not this table's columns
            continue
        f, st, rc, lo = r["formation"], r["steady"], r["round_change"], r["losses"]
        if r["kind"].startswith("many_jobs"):
            form = f"all {r['jobs']} jobs {_s(f['all_jobs_s'])}"
        else:
            form = f"{_s(f['first_join_to_all_assigned_s'])} / {_s(f['last_join_to_all_assigned_s'])}"
        views = r.get("status_views", {}).get("/v1/status", {})
        rows.append(
            f"| {_label(r)} | {form} | {_ms(rc.get('wake_p50_ms'))} / {_ms(rc.get('wake_p99_ms'))} "
            f"| {_ms(rc['failure_reply_ms'])} | {st['server_cpu_pct']:.0f}% / {st['polls_per_s']:.0f} "
            f"| {st['server_rss_mib']:.0f} / {r['server_rss_peak_mib']:.0f} MiB "
            f"| {_ms(views.get('median_ms'))} ({_ms(views.get('max_ms'))}) "
            f"| {lo['nodes_lost']} / {lo['extra_rounds']} / {lo['rejoins']} | {_clients(r)} | {_load(r)} "
            f"| {_others(r)} |")
    return "\n".join(rows)
