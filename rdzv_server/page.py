"""The human status page: `GET /` (every job) and `GET /jobs/{job_id}` (one job, in full).

Plain HTML with inline CSS, no script and no build step; it reloads itself (<meta refresh>).
Everything shown is read from the JSON documents of `views` (job_detail, job_events,
server_status), so the page and the API never disagree. Every string goes through html.escape:
node ids, hosts and failure messages come from clients. Times are UTC ISO 8601 plus an age.
"""
from __future__ import annotations

import datetime as dt
import html
import urllib.parse
from typing import Any
from collections.abc import Iterable

from rdzv_server import views
from rdzv_server.events import EventKind
from rdzv_server.rendezvous import Rendezvous

DEFAULT_REFRESH_S = 2
INDEX_EVENTS = 6          # events per job on the overview
DETAIL_EVENTS = 200       # events on a job's own page
# How an event kind is coloured in the history tables.
_BAD = {k.value for k in (EventKind.WORKER_FAILED, EventKind.NODE_LOST, EventKind.JOB_FAILED, EventKind.NODE_EXCLUDED)}
_WARN = {k.value for k in (EventKind.ROUND_ABANDONED, EventKind.NODE_DRAINED, EventKind.JOB_CLOSED,
                           EventKind.SERVER_RESTARTED, EventKind.NODE_LEFT)}
_GOOD = {k.value for k in (EventKind.ROUND_COMPLETED, EventKind.JOB_SUCCEEDED, EventKind.NODE_READMITTED)}
_FINISHED = {"succeeded", "failed", "closed"}
# How a job's state ranks on the overview: what needs a human comes first.
_ORDER = {"failed": 0, "waiting": 1, "running": 2, "closed": 3, "succeeded": 4}
_DETAIL_KEYS = ("rank", "local_rank", "exitcode", "signal", "reason", "host", "cause", "nodes", "world_size",
                "formation_s", "since_failure_s", "away_s", "min_nodes", "max_nodes")
_REPEATED = {"reason", "host", "message"}     # data keys often already said by the event's message

_CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d0d7de;--soft:#f6f8fa;--bg:#fff;--link:#0969da;
--green:#1a7f37;--green-bg:#dafbe1;--amber:#9a6700;--amber-bg:#fff8c5;--orange:#bc4c00;--orange-bg:#fff1e5;
--red:#cf222e;--red-bg:#ffebe9;--blue:#0969da;--blue-bg:#ddf4ff;--grey:#6e7781;--grey-bg:#eaeef2;
--c-green:#2da44e;--c-amber:#d4a72c;--c-orange:#e16f24;--c-red:#cf222e;--c-blue:#0969da;--c-grey:#8c959f}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,sans-serif;color:var(--fg);background:var(--soft)}
a{color:var(--link);text-decoration:none}a:hover{text-decoration:underline}
.mono,code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
.muted{color:var(--muted)}.nowrap{white-space:nowrap}.empty{padding:10px 12px;color:var(--muted)}
.top{display:flex;align-items:baseline;gap:24px;flex-wrap:wrap;padding:14px 28px;background:#24292f;color:#f6f8fa}
.top h1{font-size:18px;margin:0;font-weight:600}.top a{color:#f6f8fa}.top .muted{color:#adbac7}.right{margin-left:auto}
main{padding:20px 28px 40px;max-width:1500px}
h2{font-size:15px;margin:22px 0 8px}h3{font-size:13px;margin:16px 0 6px;color:var(--muted);
text-transform:uppercase;letter-spacing:.04em}
table{border-collapse:collapse;width:100%;background:var(--bg)}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid var(--line);vertical-align:baseline}
th{font-size:12px;font-weight:600;color:var(--muted);background:var(--soft)}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}tr:last-child td{border-bottom:0}
.box{border:1px solid var(--line);border-radius:6px;overflow:hidden;background:var(--bg)}
.job{border:1px solid var(--line);border-left:6px solid var(--grey);border-radius:6px;background:var(--bg);
padding:14px 18px 16px;margin:0 0 18px}
.job>header{display:flex;align-items:center;gap:12px;flex-wrap:wrap}
.job>header .id{font-size:16px;font-weight:600}
.stats{display:flex;flex-wrap:wrap;gap:8px 28px;margin:10px 0 4px}
.stat .k{display:block;font-size:11px;color:var(--muted);text-transform:uppercase;letter-spacing:.04em}
.stat .v{font-size:15px;font-weight:600;font-variant-numeric:tabular-nums}
.reason{margin:6px 0 0;color:var(--fg)}.warns{margin:6px 0 0;color:var(--orange);font-weight:500}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;
border:1px solid transparent;white-space:nowrap}
.dot{display:inline-block;width:10px;height:10px;border-radius:50%;background:var(--grey)}
.h-green{--c:var(--c-green)}.h-amber{--c:var(--c-amber)}.h-orange{--c:var(--c-orange)}
.h-red{--c:var(--c-red)}.h-blue{--c:var(--c-blue)}.h-grey{--c:var(--c-grey)}
.job[class*=h-]{border-left-color:var(--c)}.dot[class*=h-]{background:var(--c)}
.s-running,.s-member,.s-ok{color:var(--green);background:var(--green-bg);border-color:#aceebb}
.s-waiting,.s-spare{color:var(--amber);background:var(--amber-bg);border-color:#eac54f}
.s-failed,.s-excluded{color:var(--red);background:var(--red-bg);border-color:#ffcecb}
.s-succeeded{color:var(--blue);background:var(--blue-bg);border-color:#b6e3ff}
.s-closed,.s-gone,.s-ended{color:var(--grey);background:var(--grey-bg);border-color:#d0d7de}
.bar{display:inline-block;width:64px;height:8px;border-radius:4px;background:var(--grey-bg);
vertical-align:middle;margin-right:8px;overflow:hidden}
.bar i{display:block;height:100%;background:var(--green)}.bar.mid i{background:var(--orange)}
.bar.full i{background:var(--red)}.warn-text{color:var(--orange);font-weight:600}
.bad-text{color:var(--red);font-weight:600}tr.ev-bad td{background:var(--red-bg)}
tr.ev-bad td.kind{color:var(--red);font-weight:600}tr.ev-warn td.kind{color:var(--orange);font-weight:600}
tr.ev-good td.kind{color:var(--green)}td.kind{white-space:nowrap}td.msg{width:50%}.chips{margin-top:2px}
.chip{display:inline-block;margin:1px 4px 1px 0;padding:0 6px;border-radius:4px;background:var(--soft);
border:1px solid var(--line);font-size:11.5px;color:var(--muted)}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:18px}
.kv td:first-child{color:var(--muted);width:40%}.more{display:inline-block;margin-top:10px;font-weight:500}
pre{margin:0;white-space:pre-wrap;font-size:12px}
table.summary td,table.summary th{white-space:nowrap}table.summary td.note{white-space:normal;width:30%}
"""


# ---- small pieces ---------------------------------------------------------------------------------

def _e(value: Any) -> str:
    return "&mdash;" if value is None or value == "" else html.escape(str(value), quote=True)


def _href(job_id: str) -> str:
    return "/jobs/" + html.escape(urllib.parse.quote(job_id, safe=""), quote=True)


def _age(seconds: float) -> str:
    """A short human duration: 0.4s, 12s, 4m 05s, 2h 03m, 3d 4h."""
    s = max(0.0, float(seconds))
    m, h = int(s) // 60, int(s) // 3600
    return (f"{s:.1f}s" if s < 9.95 else f"{s:.0f}s" if s < 59.5 else f"{m}m {int(s) % 60:02d}s" if m < 60
            else f"{h}h {m % 60:02d}m" if h < 24 else f"{h // 24}d {h % 24}h")


def _epoch(iso: str) -> float:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _when(iso: str | None, now: float) -> str:
    """UTC ISO time in monospace with its age; a dash when there is none."""
    if not iso:
        return "&mdash;"
    ago = now - _epoch(iso)
    rel = f"{_age(ago)} ago" if ago >= 0 else f"in {_age(-ago)}"
    return f'<span class="mono nowrap">{_e(iso)}</span> <span class="muted nowrap">({rel})</span>'


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _badge(state: str, text: str | None = None) -> str:
    return f'<span class="badge s-{_e(state)}">{_e(text or state)}</span>'


def _table(head: Iterable[str], rows: list[str], empty: str, cls: str = "") -> str:
    if not rows:
        return f'<div class="box"><div class="empty">{_e(empty)}</div></div>'
    # a heading starting with ">" is a right-aligned (numeric) column
    ths = "".join(f'<th class="num">{h[1:]}</th>' if h.startswith(">") else f"<th>{h}</th>" for h in head)
    return (f'<div class="box"><table class="{cls}"><thead><tr>{ths}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def health(job: dict[str, Any]) -> tuple[str, list[str]]:
    """(colour, warnings) for a job summary: the colour of its state, orange when running degraded."""
    state = job["state"]
    colour = {"running": "green", "waiting": "amber", "failed": "red", "succeeded": "blue"}.get(state, "grey")
    if state in _FINISHED:
        return colour, []
    warns = []
    used, budget = job["restart_count"], job["max_restarts"]
    if used and used * 2 > budget:
        warns.append(f"restarts {used}/{budget} used" + (" (none left)" if used >= budget else ""))
    short = job["max_nodes"] - job["group_world_size"]
    if state == "running" and short > 0:
        warns.append(f"{short} node{'s' if short != 1 else ''} short of max {job['max_nodes']}")
    if job["excluded"]:
        warns.append(f"{len(job['excluded'])} node{'s' if len(job['excluded']) != 1 else ''} excluded")
    if warns and state == "running":
        colour = "orange"
    return colour, warns


def _restarts(used: int, budget: int) -> str:
    frac = 1.0 if budget == 0 and used else (used / budget if budget else 0.0)
    level = "full" if used >= budget and used else ("mid" if used * 2 > budget else "")
    return (f'<span class="nowrap" title="restarts used / max_restarts"><span class="bar {level}">'
            f'<i style="width:{min(frac, 1.0) * 100:.0f}%"></i></span>{used} / {budget}</span>')


def _lease(age: float, timeout: float | None) -> str:
    """A lease's age, orange past half the lease timeout, red past it."""
    cls = "" if not timeout else "bad-text" if age > timeout else "warn-text" if age > timeout / 2 else ""
    return f'<span class="{cls}">{_age(age)}</span>'


def _host(n: dict[str, Any]) -> str:
    host, addr = n.get("host") or "", n.get("addr") or ""
    if host and host != addr:
        return f'<span class="mono">{_e(host)}</span> <span class="mono muted">{_e(addr)}</span>'
    return f'<span class="mono">{_e(addr or host)}</span>'


# ---- tables -------------------------------------------------------------------------------------

def _members(job: dict[str, Any], timeout: float | None) -> str:
    rows = []
    for n in job["nodes"]:
        lws, offset = n["local_world_size"], n.get("rank_offset")
        ranks = "" if offset is None else (f"{offset}" if lws == 1 else f"{offset}&ndash;{offset + lws - 1}")
        ws = n.get("worker_state") or ""
        kind = {"running": "ok", "succeeded": "succeeded", "stopped": "ended"}.get(ws, "ended")
        shown = _badge(kind, ws) if ws else "&mdash;"
        fails = n.get("recent_failures", 0)
        rows.append(
            f'<tr data-node="{_e(n["node_id"])}"><td class="num">{_e(n.get("group_rank"))}</td>'
            f'<td class="mono">{_e(n["node_id"])}</td><td>{_host(n)}</td><td class="num">{lws}</td>'
            f'<td class="num mono">{ranks}</td><td class="num">{_lease(n["lease_age_s"], timeout)}</td>'
            f'<td>{shown}</td><td class="num{" bad-text" if fails else ""}">{fails}</td></tr>')
    return _table([">group rank", "node id", "host / addr", ">local world", ">ranks", ">lease age",
                   "worker state", ">recent failures"], rows, "no members: no round is running")


def _others(job: dict[str, Any], timeout: float | None, now: float) -> str:
    """Waiting, spare and excluded nodes (each table only when it has rows)."""
    out = []
    if job["waiting"]:
        rows = [f'<tr><td class="mono">{_e(n["node_id"])}</td><td>{_host(n)}</td><td class="num">'
                f'{n["local_world_size"]}</td><td class="num">{_lease(n["lease_age_s"], timeout)}</td>'
                f'<td>{_when(n.get("joined_at"), now)}</td></tr>' for n in job["waiting"]]
        out.append("<h3>Waiting for the next round</h3>" + _table(
            ["node id", "host / addr", ">local world", ">lease age", "joined"], rows, ""))
    rows = [f'<tr><td class="num">#{n.get("spare_position", 0) + 1}</td><td class="mono">{_e(n["node_id"])}</td>'
            f'<td>{_host(n)}</td><td class="num">{n["local_world_size"]}</td>'
            f'<td class="num">{_lease(n["lease_age_s"], timeout)}</td></tr>' for n in job["spares"]]
    if rows:
        out.append("<h3>Spares</h3>" + _table(
            [">position", "node id", "host / addr", ">local world", ">lease age"], rows, ""))
    rows = [f'<tr><td class="mono">{_e(n["node_id"])}</td><td>{_host(n)}</td>'
            f'<td class="num bad-text">{_age(n.get("excluded_for_s", 0))}</td>'
            f'<td class="num">{_e(n.get("exclusions"))}</td></tr>' for n in job["excluded"]]
    if rows:
        out.append("<h3>Excluded</h3>" + _table(["node id", "host / addr", ">time left", ">exclusions"],
                                                rows, ""))
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
        chips.append(f'<span class="chip">{_e(k)} <b>{_e(v)}</b></span>')
    return f'<div class="chips">{"".join(chips)}</div>' if chips else ""


def _events(events: list[dict[str, Any]], now: float, limit: int, details: bool) -> str:
    rows = []
    for e in reversed(events[-limit:]):
        kind = e["kind"]
        cls = "ev-bad" if kind in _BAD else "ev-warn" if kind in _WARN else "ev-good" if kind in _GOOD else ""
        rows.append(
            f'<tr class="event {cls}" data-kind="{_e(kind)}" data-seq="{e["seq"]}"><td>{_when(e["time"], now)}</td>'
            f'<td class="kind mono">{_e(kind)}</td><td class="num mono">{_e(e.get("round_id"))}</td>'
            f'<td class="mono">{_e(e.get("node_id"))}</td><td class="msg">{_e(e["message"])}'
            f'{_chips(e.get("data"), e["message"]) if details else ""}</td></tr>')
    return _table(["time (UTC)", "event", ">round", "node", "message"], rows, "no events yet")


# ---- one job ------------------------------------------------------------------------------------

def _card(job: dict[str, Any], events: list[dict[str, Any]], now: float, *, full: bool, extra: str = "") -> str:
    colour, warns = health(job)
    timeout = (job.get("config") or {}).get("lease_timeout_s")
    jid = job["job_id"]
    title = (f'<span class="id mono">{_e(jid)}</span>' if full else
             f'<a class="id mono" href="{_href(jid)}">{_e(jid)}</a>')
    ended = f' &middot; {job["state"]} {_when(job["finished_at"], now)}' if job.get("finished_at") else ""
    stats = [("round", f'#{job["round_id"]}' if job["round_id"] is not None else "&mdash;"),
             ("world size", str(job["world_size"])),
             ("nodes", f'{job["group_world_size"]} <span class="muted">of {job["min_nodes"]}:'
                       f'{job["max_nodes"]}</span>'),
             ("restarts", _restarts(job["restart_count"], job["max_restarts"])),
             ("spares", str(len(job["spares"]))),
             ("excluded", f'<span class="{"bad-text" if job["excluded"] else ""}">{len(job["excluded"])}</span>')]
    if job.get("last_call_ends_in_s") is not None:
        stats.append(("last call ends in", _age(job["last_call_ends_in_s"])))
    parts = [
        f'<section class="job h-{colour}" id="job-{_e(jid)}" data-job="{_e(jid)}" data-health="{colour}">',
        f'<header><span class="dot h-{colour}"></span>{title}{_badge(job["state"])}',
        f'<span class="right muted">created {_when(job["created_at"], now)}{ended}</span></header>',
        '<div class="stats">' + "".join(f'<div class="stat"><span class="k">{k}</span><span class="v">{v}</span></div>'
                                        for k, v in stats) + "</div>",
        f'<p class="reason"><span class="muted">last decision:</span> {_e(job["reason"])}</p>' if job["reason"] else "",
        f'<p class="warns">&#9888; {_e("; ".join(warns))}</p>' if warns else "",
        "<h3>Members</h3>", _members(job, timeout), _others(job, timeout, now), extra,
        f'<h3>{"Event history, newest first" if full else "Recent events"}</h3>',
        _events(events, now, DETAIL_EVENTS if full else INDEX_EVENTS, details=full),
    ]
    if not full:
        parts.append(f'<a class="more" href="{_href(jid)}">Full details, config and history &rarr;</a>')
    parts.append("</section>")
    return "".join(parts)


def _failure(title: str, f: dict[str, Any] | None, now: float) -> str:
    if not f:
        return f'<div><h3>{title}</h3><div class="box"><div class="empty">none</div></div></div>'
    ts = views.iso(f.get("timestamp")) if f.get("timestamp") else None
    keys = ["node_id", "host", "rank", "local_rank", "exitcode", "signal", "reason", "message"]
    rows = [f'<tr><td>{k}</td><td class="mono">{_e(f.get(k))}</td></tr>' for k in keys]
    rows.insert(0, f"<tr><td>time</td><td>{_when(ts, now)}</td></tr>")
    if f.get("traceback"):
        rows.append(f'<tr><td>traceback</td><td><pre class="mono">{_e(f["traceback"])}</pre></td></tr>')
    return f'<div><h3>{title}</h3><div class="box"><table class="kv">{"".join(rows)}</table></div></div>'


def _config(config: dict[str, Any]) -> str:
    rows = "".join(f'<tr><td class="mono">{_e(k)}</td><td class="mono">{_e(v)}</td></tr>' for k, v in config.items())
    return f'<div><h3>Config</h3><div class="box"><table class="kv">{rows}</table></div></div>'


# ---- whole pages --------------------------------------------------------------------------------

def refresh_seconds(raw: str | None) -> int:
    """The ?refresh= query value: seconds between reloads, 0 for none; the default when unreadable."""
    try:
        return max(0, min(3600, int(raw))) if raw is not None else DEFAULT_REFRESH_S
    except ValueError:
        return DEFAULT_REFRESH_S


def _layout(title: str, now: float, body: str, refresh: int, path: str, summary: str = "",
            notes: tuple[str, ...] = ()) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    toggle = (f'refreshes every {refresh}s &middot; <a href="{path}?refresh=0">pause</a>' if refresh else
              f'auto-refresh paused &middot; <a href="{path}">resume</a>')
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">{meta}<title>{_e(title)}</title>'
        f"<style>{_CSS}</style></head><body>"
        f'<div class="top"><h1><a href="/">rdzv-server</a></h1><span>{summary}</span>'
        f'<span class="right muted">server time <span class="mono" id="server-time">{_e(views.iso(now))}</span>'
        f" &middot; {toggle}</span></div><main>{_notes(notes)}{body}</main></body></html>")


def _notes(notes: tuple[str, ...]) -> str:
    """The server's warnings about its own exposure (no token on a network address, ...)."""
    return "".join(f'<div class="box warn-text" data-note="1">&#9888; {_e(n)}</div>' for n in notes)


def _summary_row(job: dict[str, Any], events: list[dict[str, Any]], now: float) -> str:
    colour, warns = health(job)
    last = events[-1] if events else None
    latest = (f'<span class="mono">{_e(last["kind"])}</span> <span class="muted">'
              f'{_age(now - _epoch(last["time"]))} ago</span>') if last else "&mdash;"
    if job["state"] == "failed":
        note = f'<span class="bad-text">{_e(_clip(job["reason"], 90))}</span>'
    else:
        note = f'<span class="warn-text">{_e("; ".join(warns))}</span>' if warns else ""
    return (f'<tr data-job="{_e(job["job_id"])}"><td><span class="dot h-{colour}"></span></td>'
            f'<td class="mono"><a href="#job-{_e(job["job_id"])}">{_e(job["job_id"])}</a></td>'
            f'<td>{_badge(job["state"])}</td><td class="note">{note}</td><td class="num">{_e(job["round_id"])}</td>'
            f'<td class="num">{job["world_size"]}</td>'
            f'<td class="num">{job["group_world_size"]} <span class="muted">of {job["min_nodes"]}:{job["max_nodes"]}'
            f'</span></td><td>{_restarts(job["restart_count"], job["max_restarts"])}</td>'
            f'<td class="num">{len(job["spares"])}</td><td class="num">{len(job["excluded"])}</td>'
            f"<td>{latest}</td></tr>")


def _counts(jobs: list[dict[str, Any]]) -> str:
    n = len(jobs)
    by: dict[str, int] = {}
    for j in jobs:
        by[j["state"]] = by.get(j["state"], 0) + 1
    badges = " ".join(_badge(s, f"{c} {s}") for s, c in sorted(by.items(), key=lambda kv: _ORDER.get(kv[0], 9)))
    return f'<b id="job-count">{n} job{"s" if n != 1 else ""}</b> {badges}'


def index_page(core: Rendezvous, now: float, refresh: int = DEFAULT_REFRESH_S, notes: tuple[str, ...] = ()) -> str:
    status = views.server_status(core, now)
    order = sorted(status["jobs"], key=lambda j: (_ORDER.get(j["state"], 9), j["job_id"]))
    jobs = [(views.job_detail(core.jobs[j["job_id"]], now), views.job_events(core.jobs[j["job_id"]])["events"])
            for j in order]
    if not jobs:
        body = '<div class="box"><div class="empty">No jobs yet: agents create a job with their first join.</div></div>'
    else:
        rows = [_summary_row(j, ev, now) for j, ev in jobs]
        head = ["", "job", "state", "attention", ">round", ">world size", ">nodes", "restarts", ">spares",
                ">excluded", "latest event"]
        body = ("<h2>Jobs</h2>" + _table(head, rows, "", "summary")
                + "<h2>Details</h2>" + "".join(_card(j, ev, now, full=False) for j, ev in jobs))
    return _layout("rdzv-server status", now, body, refresh, "/", _counts([j for j, _ in jobs]), notes)


def job_page(core: Rendezvous, job_id: str, now: float, refresh: int = DEFAULT_REFRESH_S) -> str | None:
    """One job in full; None when the server has no such job (see `not_found_page`)."""
    record = core.jobs.get(job_id)
    if record is None:
        return None
    job = views.job_detail(record, now)
    events = views.job_events(record)["events"]
    root, last = job["root_cause"], job["last_failure"]
    failures = (_failure("Last failure (the root cause)" if root == last else "Last failure", last, now)
                + ("" if root == last else _failure("Root cause (first failure of the last failed round)", root, now)))
    extra = f'<div class="grid"><div>{failures}</div>{_config(job["config"])}</div>'
    body = f'<p><a href="/">&larr; all jobs</a></p>{_card(job, events, now, full=True, extra=extra)}'
    title = f'job <b class="mono">{_e(job_id)}</b>'
    return _layout(f"{job_id} · rdzv-server", now, body, refresh, _href(job_id), title)


def not_found_page(core: Rendezvous, job_id: str, now: float, refresh: int = DEFAULT_REFRESH_S) -> str:
    """The 404 page; it reloads too, so it turns into the job's page once the job's first agent joins."""
    jobs = sorted(views.server_status(core, now)["jobs"], key=lambda j: j["job_id"])
    known = "".join(f'<li><a class="mono" href="{_href(j["job_id"])}">{_e(j["job_id"])}</a> '
                    f'{_badge(j["state"])}</li>' for j in jobs)
    body = (f'<section class="job h-grey"><header><span class="id">No job <span class="mono">{_e(job_id)}</span> '
            f'on this server</span></header><p class="muted">No agent has joined it yet, or its state was dropped. '
            f'Jobs this server knows:</p><ul>{known or "<li>none</li>"}</ul><p><a href="/">&larr; all jobs</a></p>'
            f"</section>")
    return _layout("job not found · rdzv-server", now, body, refresh, _href(job_id), "job not found")
