"""One job's card on the status page: its stats, node tables, failures, config and event history.

Renders the documents of `views` (job_detail, job_events). Node tables show the rows the document
holds and say how many more there are, so a card costs the same for 10 nodes or 10,000.
"""
from __future__ import annotations

from typing import Any

from rdzv_server.logs import iso
from rdzv_server.web.page.parts import (
    BAD,
    GOOD,
    WARN,
    age,
    badge,
    esc,
    health,
    host,
    href,
    lease,
    restarts,
    table,
    when,
)

INDEX_EVENTS = 6          # events per job on the overview
DETAIL_EVENTS = 200       # events on a job's own page
_DETAIL_KEYS = ("rank", "local_rank", "exitcode", "signal", "reason", "host", "cause", "nodes", "world_size",
                "formation_s", "since_failure_s", "away_s", "min_nodes", "max_nodes")
_REPEATED = {"reason", "host", "message"}     # data keys often already said by the event's message


def _more(job: dict[str, Any], key: str, full: bool) -> str:
    """The line under a cut node table: how many rows are not shown and where to see them."""
    count, shown = job["counts"][key], len(job[key])
    if count <= shown:
        return ""
    if not full:
        return f'{count - shown:,} more &mdash; see <a href="{href(job["job_id"])}">/jobs/{esc(job["job_id"])}</a>'
    first = job.get("node_offset", 0) + 1
    return (f"rows {first:,}&ndash;{first + shown - 1:,} of {count:,}" if shown else
            f"none on this page ({count:,} in all)")


def _members(job: dict[str, Any], timeout: float | None, full: bool) -> str:
    rows = []
    for n in job["nodes"]:
        lws, offset = n["local_world_size"], n.get("rank_offset")
        ranks = "" if offset is None else (f"{offset}" if lws == 1 else f"{offset}&ndash;{offset + lws - 1}")
        ws = n.get("worker_state") or ""
        kind = {"running": "ok", "succeeded": "succeeded", "stopped": "ended"}.get(ws, "ended")
        shown = badge(kind, ws) if ws else "&mdash;"
        fails = n.get("recent_failures", 0)
        rows.append(
            f'<tr data-node="{esc(n["node_id"])}"><td class="num">{esc(n.get("group_rank"))}</td>'
            f'<td class="mono">{esc(n["node_id"])}</td><td>{host(n)}</td><td class="num">{lws}</td>'
            f'<td class="num mono">{ranks}</td><td class="num">{lease(n["lease_age_s"], timeout)}</td>'
            f'<td>{shown}</td><td class="num{" bad-text" if fails else ""}">{fails}</td></tr>')
    empty = "no members: no round is running" if not job["counts"]["nodes"] else _more(job, "nodes", full)
    return table([">group rank", "node id", "host / addr", ">local world", ">ranks", ">lease age",
                  "worker state", ">recent failures"], rows, empty, more=_more(job, "nodes", full))


def _others(job: dict[str, Any], timeout: float | None, now: float, full: bool) -> str:
    """Waiting, spare and excluded nodes (each table only when the job has such nodes)."""
    out = []
    counts = job["counts"]
    if counts["waiting"]:
        rows = [f'<tr><td class="mono">{esc(n["node_id"])}</td><td>{host(n)}</td><td class="num">'
                f'{n["local_world_size"]}</td><td class="num">{lease(n["lease_age_s"], timeout)}</td>'
                f'<td>{when(n.get("joined_at"), now)}</td></tr>' for n in job["waiting"]]
        out.append("<h3>Waiting for the next round</h3>" + table(
            ["node id", "host / addr", ">local world", ">lease age", "joined"], rows, _more(job, "waiting", full),
            more=_more(job, "waiting", full)))
    if counts["spares"]:
        rows = [f'<tr><td class="num">#{n.get("spare_position", 0) + 1}</td><td class="mono">{esc(n["node_id"])}'
                f'</td><td>{host(n)}</td><td class="num">{n["local_world_size"]}</td>'
                f'<td class="num">{lease(n["lease_age_s"], timeout)}</td></tr>' for n in job["spares"]]
        out.append("<h3>Spares</h3>" + table(
            [">position", "node id", "host / addr", ">local world", ">lease age"], rows, _more(job, "spares", full),
            more=_more(job, "spares", full)))
    if counts["excluded"]:
        rows = [f'<tr><td class="mono">{esc(n["node_id"])}</td><td>{host(n)}</td>'
                f'<td class="num bad-text">{age(n.get("excluded_for_s", 0))}</td>'
                f'<td class="num">{esc(n.get("exclusions"))}</td></tr>' for n in job["excluded"]]
        out.append("<h3>Excluded</h3>" + table(["node id", "host / addr", ">time left", ">exclusions"], rows,
                                               _more(job, "excluded", full), more=_more(job, "excluded", full)))
    if counts["drained"]:
        rows = [f'<tr><td class="mono">{esc(d["node_id"])}</td><td>{esc(d["reason"])}</td></tr>'
                for d in job["drained"]]
        out.append("<h3>Drained by an operator</h3>" + table(["node id", "reason"], rows,
                                                              _more(job, "drained", full),
                                                              more=_more(job, "drained", full)))
    return "".join(out)


def _chips(data: dict[str, Any] | None, message: str) -> str:
    if not data:
        return ""
    keys = [k for k in _DETAIL_KEYS if k in data] + sorted(k for k in data if k not in _DETAIL_KEYS)
    chips = []
    for k in keys:
        v = data[k]
        if v in ("", None) or isinstance(v, (dict, list)) or (k in _REPEATED and str(v) in message):
            continue
        if isinstance(v, float) and k.endswith("_s"):
            v = f"{v * 1000:.3g}ms" if v < 1 else f"{v:.3g}s"
        chips.append(f'<span class="chip">{esc(k)} <b>{esc(v)}</b></span>')
    return f'<div class="chips">{"".join(chips)}</div>' if chips else ""


def events_table(events: list[dict[str, Any]], now: float, details: bool) -> str:
    """`events` (oldest first, as the document has them) newest first."""
    rows = []
    for e in reversed(events):
        kind = e["kind"]
        cls = "ev-bad" if kind in BAD else "ev-warn" if kind in WARN else "ev-good" if kind in GOOD else ""
        rows.append(
            f'<tr class="event {cls}" data-kind="{esc(kind)}" data-seq="{e["seq"]}"><td>{when(e["time"], now)}</td>'
            f'<td class="kind mono">{esc(kind)}</td><td class="num mono">{esc(e.get("round_id"))}</td>'
            f'<td class="mono">{esc(e.get("node_id"))}</td><td class="msg">{esc(e["message"])}'
            f'{_chips(e.get("data"), e["message"]) if details else ""}</td></tr>')
    return table(["time (UTC)", "event", ">round", "node", "message"], rows, "no events yet")


def card(job: dict[str, Any], events: list[dict[str, Any]], now: float, *, full: bool, extra: str = "",
         pager: str = "", picture: str = "") -> str:
    """A job's card: `full` on its own page (node tables paged by `pager`), else the overview's, whose
    node tables stop at what `job` holds and link to the job's page for the rest. `picture`: the
    job's history drawn (history.py), under its stats."""
    colour, warns = health(job)
    timeout = (job.get("config") or {}).get("lease_timeout_s")
    jid, counts = job["job_id"], job["counts"]
    title = (f'<span class="id mono">{esc(jid)}</span>' if full else
             f'<a class="id mono" href="{href(jid)}">{esc(jid)}</a>')
    ended = f' &middot; {job["state"]} {when(job["finished_at"], now)}' if job.get("finished_at") else ""
    stats = [("round", f'#{job["round_id"]}' if job["round_id"] is not None else "&mdash;"),
             ("world size", str(job["world_size"])),
             ("nodes", f'{job["group_world_size"]} <span class="muted">of {job["min_nodes"]}:'
                       f'{job["max_nodes"]}</span>'),
             ("restarts", restarts(job["restart_count"], job["max_restarts"])),
             ("spares", str(counts["spares"])),
             ("excluded", f'<span class="{"bad-text" if counts["excluded"] else ""}">{counts["excluded"]}</span>')]
    if counts["waiting"]:
        stats.append(("waiting", str(counts["waiting"])))
    if job.get("last_call_ends_in_s") is not None:
        stats.append(("last call ends in", age(job["last_call_ends_in_s"])))
    parts = [
        f'<section class="job h-{colour}" id="job-{esc(jid)}" data-job="{esc(jid)}" data-health="{colour}">',
        f'<header><span class="dot h-{colour}"></span>{title}{badge(job["state"])}',
        f'<span class="right muted">created {when(job["created_at"], now)}{ended}</span></header>',
        '<div class="stats">' + "".join(f'<div class="stat"><span class="k">{k}</span><span class="v">{v}</span></div>'
                                        for k, v in stats) + "</div>",
        (f'<p class="reason"><span class="muted">last decision:</span> {esc(job["reason"])}</p>'
         if job["reason"] else ""),
        f'<p class="warns">&#9888; {esc("; ".join(warns))}</p>' if warns else "",
        (f'<h3>History</h3>{picture}' if full else picture) if picture else "",
        pager, "<h3>Members</h3>", _members(job, timeout, full), _others(job, timeout, now, full), pager, extra,
        f'<h3>{"Event history, newest first" if full else "Recent events"}</h3>',
        events_table(events, now, details=full),
    ]
    if not full:
        parts.append(f'<a class="more" href="{href(jid)}">Full details, config and history &rarr;</a>')
    parts.append("</section>")
    return "".join(parts)


def failure(title: str, f: dict[str, Any] | None, now: float) -> str:
    if not f:
        return f'<div><h3>{title}</h3><div class="box"><div class="empty">none</div></div></div>'
    ts = iso(f.get("timestamp")) if f.get("timestamp") else None
    keys = ["node_id", "host", "rank", "local_rank", "exitcode", "signal", "reason", "message"]
    rows = [f'<tr><td>{k}</td><td class="mono">{esc(f.get(k))}</td></tr>' for k in keys]
    rows.insert(0, f"<tr><td>time</td><td>{when(ts, now)}</td></tr>")
    if f.get("traceback"):
        rows.append(f'<tr><td>traceback</td><td><pre class="mono">{esc(f["traceback"])}</pre></td></tr>')
    return f'<div><h3>{title}</h3><div class="box"><table class="kv">{"".join(rows)}</table></div></div>'


def config(settings: dict[str, Any]) -> str:
    rows = "".join(f'<tr><td class="mono">{esc(k)}</td><td class="mono">{esc(v)}</td></tr>'
                   for k, v in settings.items())
    return f'<div><h3>Config</h3><div class="box"><table class="kv">{rows}</table></div></div>'
