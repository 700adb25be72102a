"""One job's card on the status page (stats, node tables, failures, config, events) from `views`' documents. Node
tables show the rows the document holds and how many more there are, so a card costs the same at any job size."""
from __future__ import annotations

from typing import Any

import msgspec

from protocol.messages import JobConfig, WorkerFailure
from protocol.views import DrainedView, EventView, JobDetail, JobView, NodeView
from rdzv_server.logs import iso
from rdzv_server.web.page.goodput import goodput_line, restart_costs, slow_badge
from rdzv_server.web.page.parts import (
    BAD,
    GOOD,
    WARN,
    Column,
    age,
    badge,
    columns_table,
    esc,
    figure,
    health,
    host,
    href,
    lease,
    restarts,
    stat,
    table,
    when,
)

INDEX_EVENTS = 6          # events per job on the overview
DETAIL_EVENTS = 200       # events on a job's own page
_DETAIL_KEYS = ("rank", "local_rank", "exitcode", "signal", "reason", "host", "cause", "nodes", "world_size",
                "formation_s", "since_failure_s", "away_s", "min_nodes", "max_nodes")
_REPEATED = {"reason", "host", "message"}     # data keys often already said by the event's message


def _more(job: JobView, key: str, full: bool) -> str:
    """The line under a cut node table: how many rows are not shown and where to see them."""
    count, shown = getattr(job.counts, key), len(getattr(job, key))
    if count <= shown:
        return ""
    if not full:
        return f'{count - shown:,} more &mdash; see <a href="{href(job.job_id)}">/jobs/{esc(job.job_id)}</a>'
    first = (job.node_offset if isinstance(job, JobDetail) else 0) + 1
    return (f"rows {first:,}&ndash;{first + shown - 1:,} of {count:,}" if shown else
            f"none on this page ({count:,} in all)")


def _ranks(n: NodeView) -> str:
    lws, offset = n.local_world_size, n.rank_offset
    return "" if offset is None else (f"{offset}" if lws == 1 else f"{offset}&ndash;{offset + lws - 1}")


def _worker_state(n: NodeView) -> str:
    ws = n.worker_state or ""
    return badge({"running": "ok", "succeeded": "succeeded"}.get(ws, "ended"), ws) if ws else "&mdash;"


def _node_id(n: NodeView | DrainedView) -> str:
    return f'<span class="mono">{esc(n.node_id)}</span>'


def _ready(n: NodeView) -> str:
    """A node preparing (its warm interpreter importing) enters no round until it is ready; nor does a suspect
    until its checks pass again."""
    if n.checks_due:
        return '<span class="warn-text" data-checks-due="1">a suspect: its checks, once more</span>'
    if n.preparing_for_s is None:
        return "yes"
    return f'<span class="warn-text" data-preparing="1">preparing {age(n.preparing_for_s)}</span>'


def _copies(n: NodeView) -> str:
    """Its snapshot and copy, marked where the figures are the ones saved before the server restarted."""
    old = ' <span class="muted" data-copies-old="1">(as said before the server restarted)</span>'
    return _copies_said(n) + (old if n.copies_before_restart and n.copies is not None else "")


def _copies_said(n: NodeView) -> str:
    """Its newest snapshot and its newest copy on a peer (issue 46): a lost node resumes from the copy."""
    c = n.copies
    if c is None or c.local_step < 0:
        return "&mdash;"
    refused = (f' &middot; <span class="warn-text" title="{esc(c.last_refusal)}">{c.refused} refused</span>'
               if c.refused else "")
    if not c.copying:
        return f"{c.local_step} &middot; copies off"
    if c.copied_step < 0:
        return f'{c.local_step} &middot; <span class="warn-text">no copy</span>{refused}'
    lag = f" ({c.local_step - c.copied_step} behind)" if c.local_step > c.copied_step else ""
    return f"{c.local_step} &middot; copy {c.copied_step}{lag} on {esc(c.holder)}{refused}"


def node_columns(timeout: float | None, now: float) -> dict[str, list[Column[Any]]]:
    """Each node table's columns, declared once as (heading, cell) pairs."""
    lease_age: Column[NodeView] = (">lease age", lambda n: lease(n.lease_age_s, timeout))
    workers: Column[NodeView] = (">local world", lambda n: str(n.local_world_size))
    where: Column[NodeView] = ("host / addr", host)
    return {
        "nodes": [(">group rank", lambda n: esc(n.group_rank)), ("node id", lambda n: _node_id(n) + slow_badge(n.slow)),
                  where, workers, (">ranks", lambda n: f'<span class="mono">{_ranks(n)}</span>'), lease_age,
                  ("worker state", _worker_state),
                  (">recent failures", lambda n: f'<span class="bad-text">{n.recent_failures}</span>'
                   if n.recent_failures else "0"),
                  (">steps/s", lambda n: figure(n.steps_per_s) if n.steps_per_s is not None else "&mdash;"),
                  ("snapshot", _copies)],
        "waiting": [("node id", _node_id), where, workers, lease_age, ("joined", lambda n: when(n.joined_at, now)),
                    ("ready", _ready)],
        "spares": [(">position", lambda n: f"#{(n.spare_position or 0) + 1}"), ("node id", _node_id), where, workers,
                   lease_age, ("ready", _ready)],
        "excluded": [("node id", _node_id), where,
                     (">time left", lambda n: f'<span class="bad-text">{age(n.excluded_for_s or 0)}</span>'),
                     (">exclusions", lambda n: esc(n.exclusions))],
        "drained": [("node id", _node_id), ("reason", lambda d: esc(d.reason))],
    }


OTHER_LISTS = (("waiting", "Waiting for the next round"), ("spares", "Spares"), ("excluded", "Excluded"),
               ("drained", "Drained by an operator"))


def _node_tables(job: JobView, columns: dict[str, list[Column[Any]]], full: bool) -> str:
    """The members, then the waiting, spare, excluded and drained nodes (each only when the job has such nodes)."""
    more = _more(job, "nodes", full)
    empty = more if job.counts.nodes else "no members: no round is running"
    out = ["<h3>Members</h3>" + columns_table(columns["nodes"], job.nodes, empty, more=more, row=lambda n: (
        f' data-node="{esc(n.node_id)}"' + (' data-slow="1"' if n.slow else "")))]
    for key, title in OTHER_LISTS:
        if getattr(job.counts, key):
            more = _more(job, key, full)
            out.append(f"<h3>{title}</h3>" + columns_table(columns[key], getattr(job, key), more, more=more))
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


def events_table(events: list[EventView], now: float, details: bool) -> str:
    """`events` (oldest first, as the document has them) newest first."""
    rows = []
    for e in reversed(events):
        kind = e.kind
        cls = "ev-bad" if kind in BAD else "ev-warn" if kind in WARN else "ev-good" if kind in GOOD else ""
        rows.append(
            f'<tr class="event {cls}" data-kind="{esc(kind)}" data-seq="{e.seq}"><td>{when(e.time, now)}</td>'
            f'<td class="kind mono">{esc(kind)}</td><td class="num mono">{esc(e.round_id)}</td>'
            f'<td class="mono">{esc(e.node_id)}</td><td class="msg">{esc(e.message)}'
            f'{_chips(e.data, e.message) if details else ""}</td></tr>')
    return table(["time (UTC)", "event", ">round", "node", "message"], rows, "no events yet")


def card(job: JobView, events: list[EventView], now: float, *, full: bool, extra: str = "",
         pager: str = "", picture: str = "") -> str:
    """A job's card: `full` on its own page (node tables paged by `pager`), else the overview's, its node tables cut
    at what `job` holds and linking to the job's page. `picture`: the job's history (history.py), under its stats."""
    colour, warns = health(job)
    jid, counts = job.job_id, job.counts
    columns = node_columns(job.config.lease_timeout_s if isinstance(job, JobDetail) else None, now)
    title = (f'<span class="id mono">{esc(jid)}</span>' if full else
             f'<a class="id mono" href="{href(jid)}">{esc(jid)}</a>')
    ended = f" &middot; {job.state} {when(job.finished_at, now)}" if job.finished_at else ""
    stats = [("round", f"#{job.round_id}" if job.round_id is not None else "&mdash;"),
             ("world size", str(job.world_size)),
             ("nodes", f'{job.group_world_size} <span class="muted">of {job.min_nodes}:{job.max_nodes}</span>'),
             ("restarts", restarts(job.restart_count, job.max_restarts)),
             ("spares", str(counts.spares)),
             ("excluded", f'<span class="{"bad-text" if counts.excluded else ""}">{counts.excluded}</span>')]
    if counts.waiting:
        stats.append(("waiting", str(counts.waiting)))
    if isinstance(job, JobDetail) and job.last_call_ends_in_s is not None:
        stats.append(("last call ends in", age(job.last_call_ends_in_s)))
    parts = [
        f'<section class="job h-{colour}" id="job-{esc(jid)}" data-job="{esc(jid)}" data-health="{colour}">',
        f'<header><span class="dot h-{colour}"></span>{title}{badge(job.state)}',
        f'<span class="right muted">created {when(job.created_at, now)}{ended}</span></header>',
        '<div class="stats">' + "".join(stat(k, v) for k, v in stats) + "</div>",
        goodput_line(job),
        (f'<p class="reason"><span class="muted">last decision:</span> {esc(job.reason)}</p>'
         if job.reason else ""),
        f'<p class="warns">&#9888; {esc("; ".join(warns))}</p>' if warns else "",
        (f'<p class="warns" data-copies="off"><span class="muted">peer copies</span> {esc(job.copies_off)}</p>'
         if job.copies_off else ""),
        (f'<h3>History</h3>{picture}' if full else picture) if picture else "",
        pager, _node_tables(job, columns, full), pager, restart_costs(job) if full else "", extra,
        f'<h3>{"Event history, newest first" if full else "Recent events"}</h3>',
        events_table(events, now, details=full),
        "" if full else f'<a class="more" href="{href(jid)}">Full details, config and history &rarr;</a>',
        "</section>",
    ]
    return "".join(parts)


def failure(title: str, f: WorkerFailure | None, now: float) -> str:
    if not f:
        return f'<div><h3>{title}</h3><div class="box"><div class="empty">none</div></div></div>'
    keys = ["node_id", "host", "rank", "local_rank", "exitcode", "signal", "reason", "message"]
    rows = [f"<tr><td>time</td><td>{when(iso(f.timestamp) if f.timestamp else None, now)}</td></tr>"]
    rows += [f'<tr><td>{k}</td><td class="mono">{esc(getattr(f, k))}</td></tr>' for k in keys]
    if f.traceback:
        rows.append(f'<tr><td>traceback</td><td><pre class="mono">{esc(f.traceback)}</pre></td></tr>')
    return f'<div><h3>{title}</h3><div class="box"><table class="kv">{"".join(rows)}</table></div></div>'


def config(settings: JobConfig) -> str:
    rows = "".join(f'<tr><td class="mono">{esc(k)}</td><td class="mono">{esc(v)}</td></tr>'
                   for k, v in msgspec.structs.asdict(settings).items())
    return f'<div><h3>Config</h3><div class="box"><table class="kv">{rows}</table></div></div>'
