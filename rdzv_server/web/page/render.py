"""The human status page: `GET /` (one page of jobs) and `GET /jobs/{job_id}` (one job, its nodes paged). Plain
HTML with inline CSS, no script, no build step; it reloads itself (<meta refresh>). All it shows is read from the
JSON documents of `views`, so the page and the API never disagree; every string is escaped, as node ids, hosts
and messages come from clients. Bounded whatever the server holds: one page of jobs (`?offset=`, `?limit=`),
cards for the first few with short node tables, one page of each node list (`?node_offset=`, `?node_limit=`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protocol.views import EventView, HostHold, JobView
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.logs import iso
from rdzv_server.web import views
from rdzv_server.web.page.cards import DETAIL_EVENTS, INDEX_EVENTS, card, config, failure
from rdzv_server.web.page.goodput import ettr, pace
from rdzv_server.web.page.history import history_svg
from rdzv_server.web.page.parts import (
    Column,
    age,
    badge,
    clip,
    columns_table,
    epoch,
    esc,
    health,
    href,
    job_path,
    link,
    pager,
    plural,
    restarts,
)
from rdzv_server.web.page.style import CSS

DEFAULT_REFRESH_S = 2
INDEX_JOBS = 50           # rows of the overview's summary table per page
INDEX_JOBS_MAX = 200
INDEX_CARDS = 5           # jobs of the page shown as cards (the first ones: what needs a human comes first)
CARD_NODES = 10           # rows per node table on an overview card
JOB_NODES = 100           # rows per node table on a job's page
JOB_NODES_MAX = 1000
NOT_FOUND_JOBS = 20       # jobs the 404 page lists
# How a job's state ranks in the header's counts.
_ORDER = {"failed": 0, "waiting": 1, "running": 2, "closed": 3, "succeeded": 4}


def refresh_seconds(raw: str | None) -> int:
    """The ?refresh= query value: seconds between reloads, 0 for none; the default when unreadable."""
    try:
        return max(0, min(3600, int(raw))) if raw is not None else DEFAULT_REFRESH_S
    except ValueError:
        return DEFAULT_REFRESH_S


@dataclass(frozen=True)
class PageQuery:
    """The page's query parameters; unreadable ones fall back to their default (a page answers no 400)."""
    refresh: int = DEFAULT_REFRESH_S
    offset: int = 0
    limit: int = INDEX_JOBS
    node_offset: int = 0
    node_limit: int = JOB_NODES

    @classmethod
    def of(cls, query: Mapping[str, str]) -> PageQuery:
        def number(name: str, default: int, low: int, high: int | None = None) -> int:
            return views.query_int(query, name, default, low=low, high=high, strict=False)
        return cls(refresh=refresh_seconds(query.get("refresh")), offset=number("offset", 0, 0),
                   limit=number("limit", INDEX_JOBS, 1, INDEX_JOBS_MAX), node_offset=number("node_offset", 0, 0),
                   node_limit=number("node_limit", JOB_NODES, 1, JOB_NODES_MAX))


def _layout(title: str, now: float, body: str, refresh: int, path: str, params: Mapping[str, int | None],
            summary: str = "", notes: tuple[str, ...] = ()) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    toggle = (f'refreshes every {refresh}s &middot; <a href="{link(path, {**params, "refresh": 0})}">pause</a>'
              if refresh else f'auto-refresh paused &middot; <a href="{link(path, params)}">resume</a>')
    # The server's warnings about its own exposure (no token on a network address, ...).
    warnings = "".join(f'<div class="box warn-text" data-note="1">&#9888; {esc(n)}</div>' for n in notes)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">{meta}<title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body>"
        f'<div class="top"><h1><a href="/">rdzv-server</a></h1><span>{summary}</span>'
        f'<span class="right muted">server time <span class="mono" id="server-time">{esc(iso(now))}</span>'
        f" &middot; {toggle}</span></div><main>{warnings}{body}</main></body></html>")


def _paused(refresh: int) -> int | None:
    """The refresh parameter links carry: only a non-default one."""
    return None if refresh == DEFAULT_REFRESH_S else refresh


def _latest(events: list[EventView], now: float) -> str:
    if not events:
        return "&mdash;"
    return (f'<span class="mono">{esc(events[-1].kind)}</span> <span class="muted">'
            f'{age(now - epoch(events[-1].time or ""))} ago</span>')


def _attention(job: JobView) -> str:
    if job.state == "failed":
        return f'<span class="bad-text">{esc(clip(job.reason, 90))}</span>'
    warns = health(job)[1]
    return f'<span class="warn-text">{esc("; ".join(warns))}</span>' if warns else ""


# The overview's summary table: each job's row, its columns declared once. (A row is a job and its latest events.)
SUMMARY: list[Column[tuple[JobView, list[EventView], float]]] = [
    ("", lambda r: f'<span class="dot h-{health(r[0])[0]}"></span>'),
    ("job", lambda r: f'<a class="mono" href="{href(r[0].job_id)}">{esc(r[0].job_id)}</a>'),
    ("state", lambda r: badge(r[0].state)),
    ("attention", lambda r: _attention(r[0])),
    (">round", lambda r: esc(r[0].round_id)),
    (">world size", lambda r: str(r[0].world_size)),
    (">nodes", lambda r: f'{r[0].group_world_size} <span class="muted">of {r[0].min_nodes}:{r[0].max_nodes}</span>'),
    ("restarts", lambda r: restarts(r[0].restart_count, r[0].max_restarts)),
    (">spares", lambda r: str(r[0].counts.spares)),
    (">excluded", lambda r: str(r[0].counts.excluded)),
    (">steps/s", lambda r: pace(r[0])),
    (">effective training", lambda r: ettr(r[0].progress)),
    ("latest event", lambda r: _latest(r[1], r[2])),
]
UNHEALTHY: list[Column[HostHold]] = [
    ("host", lambda h: f'<span class="mono">{esc(h.host)}</span>'),
    ("kind", lambda h: esc(h.kind)),
    ("left job / node", lambda h: f'<span class="mono">{esc(h.job_id)} / {esc(h.node_id)}</span>'),
    (">held for", lambda h: f"{h.held_for_s:.0f}s"),
    ("why", lambda h: esc(clip(h.reason, 300))),
]


def _unhealthy_hosts(holds: list[HostHold]) -> str:
    """Hosts whose node left a job unhealthy, held out of every job (core/unhealthy.py)."""
    if not holds:
        return ""
    hosts = columns_table(UNHEALTHY, holds, "", row=lambda h: f' data-host="{esc(h.host)}"')
    return ("<h2>Unhealthy hosts</h2>" + hosts + '<p class="muted">Kept out of every job; '
            '<span class="mono">rdzv-ctl clear-unhealthy HOST</span> lets one join again.</p>')


def _counts(states: dict[str, int]) -> str:
    n = sum(states.values())
    badges = " ".join(badge(s, f"{c:,} {s}") for s, c in sorted(states.items(), key=lambda kv: _ORDER.get(kv[0], 9)))
    return f'<b id="job-count">{plural(n, "job")}</b> {badges}'


def index_page(core: Rendezvous, now: float, refresh: int = DEFAULT_REFRESH_S, notes: tuple[str, ...] = (),
               *, offset: int = 0, limit: int = INDEX_JOBS) -> str:
    """One page of jobs in the views' order (unfinished first, then the newest finished): a summary
    row each, and a card for each of the first INDEX_CARDS."""
    status = views.server_status(core, now, offset, limit, list_limit=0)
    page = status.jobs
    params = {"offset": offset or None, "limit": None if limit == INDEX_JOBS else limit, "refresh": _paused(refresh)}
    if not page:
        empty = ("No jobs yet: agents create a job with their first join." if not status.total else
                 f"No jobs on this page: the server holds {plural(status.total, 'job')}.")
        body = f'<div class="box"><div class="empty">{esc(empty)}</div></div>'
    else:
        rows = [(j, views.job_events(core.jobs[j.job_id], limit=1).events, now) for j in page]
        nav = pager("jobs", offset, len(page), status.total, "/", params, "offset", limit)
        cards = []
        for j in page[:INDEX_CARDS]:
            record = core.jobs[j.job_id]
            detail = views.job_detail(record, now, 0, CARD_NODES)
            cards.append(card(detail, views.job_events(record, limit=INDEX_EVENTS).events, now, full=False,
                              picture=history_svg(detail, record.events, now, compact=True)))
        shown = (f'<p class="muted">The first {len(cards)} jobs of this page; every job has its own page.</p>'
                 if len(page) > len(cards) else "")
        summary = columns_table(SUMMARY, rows, "", cls="summary", row=lambda r: f' data-job="{esc(r[0].job_id)}" '
                                                                                f'data-health="{health(r[0])[0]}"')
        body = f"<h2>Jobs</h2>{nav}{summary}{nav}<h2>Details</h2>{shown}{''.join(cards)}"
    body += _unhealthy_hosts(status.unhealthy_hosts)
    return _layout("rdzv-server status", now, body, refresh, "/", params, _counts(status.job_states), notes)


def job_page(core: Rendezvous, job_id: str, now: float, refresh: int = DEFAULT_REFRESH_S, *,
             node_offset: int = 0, node_limit: int = JOB_NODES) -> str | None:
    """One job in full, one page of each node list; None when the server has no such job (`not_found_page`)."""
    record = core.jobs.get(job_id)
    if record is None:
        return None
    job = views.job_detail(record, now, node_offset, node_limit)
    events = views.job_events(record, limit=DETAIL_EVENTS).events
    root, last = job.root_cause, job.last_failure
    failures = (failure("Last failure (the root cause)" if root == last else "Last failure", last, now)
                + ("" if root == last else failure("Root cause (first failure of the last failed round)", root, now)))
    extra = f'<div class="grid"><div>{failures}</div>{config(job.config)}</div>'
    path = job_path(job_id)
    params = {"node_offset": node_offset or None, "node_limit": None if node_limit == JOB_NODES else node_limit,
              "refresh": _paused(refresh)}
    longest = max(getattr(job.counts, k) for k in views.NODE_LISTS)
    shown = max(len(getattr(job, k)) for k in views.NODE_LISTS)
    nav = pager("nodes (per list)", node_offset, shown, longest, path, params, "node_offset", node_limit)
    body = card(job, events, now, full=True, extra=extra, pager=nav, picture=history_svg(job, record.events, now))
    return _layout(f"{job_id} · rdzv-server", now, f'<p><a href="/">&larr; all jobs</a></p>{body}', refresh, path,
                   params, f'job <b class="mono">{esc(job_id)}</b>')


def not_found_page(core: Rendezvous, job_id: str, now: float, refresh: int = DEFAULT_REFRESH_S) -> str:
    """The 404 page; it reloads too, so it turns into the job's page once the job's first agent joins.
    It names the first few jobs the server holds (the overview pages through all of them)."""
    status = views.server_status(core, now, 0, NOT_FOUND_JOBS, list_limit=0)
    known = "".join(f'<li><a class="mono" href="{href(j.job_id)}">{esc(j.job_id)}</a> '
                    f'{badge(j.state)}</li>' for j in status.jobs)
    rest = status.total - len(status.jobs)
    if rest > 0:
        known += f'<li>and {rest:,} more on <a href="/">the overview</a></li>'
    body = (f'<section class="job h-grey"><header><span class="id">No job <span class="mono">{esc(job_id)}</span> '
            f'on this server</span></header><p class="muted">No agent has joined it yet, or its state was dropped. '
            f'Jobs this server knows:</p><ul>{known or "<li>none</li>"}</ul><p><a href="/">&larr; all jobs</a></p>'
            f"</section>")
    return _layout("job not found · rdzv-server", now, body, refresh, job_path(job_id), {}, "job not found")
