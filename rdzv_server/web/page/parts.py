"""Small pieces of the status page's HTML: escaping, links, times, badges, tables, pagers. Every client string goes
through `esc` (html.escape with quotes) and every link through `link`, so a node id or host never becomes markup."""
from __future__ import annotations

import datetime as dt
import html
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from protocol.quoting import lines_kept
from protocol.views import JobView, NodeView
from rdzv_server.core.events import EventKind

T = TypeVar("T")

FINISHED = {"succeeded", "failed", "closed"}
# How an event kind is coloured in the history tables.
BAD = {k.value for k in (EventKind.WORKER_FAILED, EventKind.NODE_LOST, EventKind.JOB_FAILED, EventKind.NODE_EXCLUDED,
                         EventKind.HANG_DETECTED, EventKind.REPLICAS_DIVERGED)}
WARN = {k.value for k in (EventKind.ROUND_ABANDONED, EventKind.NODE_DRAINED, EventKind.JOB_CLOSED,
                          EventKind.SERVER_RESTARTED, EventKind.NODE_LEFT, EventKind.NODE_SLOW,
                          EventKind.NODE_SUSPECT)}
GOOD = {k.value for k in (EventKind.ROUND_COMPLETED, EventKind.JOB_SUCCEEDED, EventKind.NODE_READMITTED,
                          EventKind.NODE_PACE_OK)}


def esc(value: Any) -> str:
    """`value` as page text: markup escaped, and control characters a client sent shown as escapes."""
    return "&mdash;" if value is None or value == "" else html.escape(lines_kept(str(value)), quote=True)


def job_path(job_id: str) -> str:
    """The job page's path (not escaped: pass it to `link`)."""
    return "/jobs/" + urllib.parse.quote(job_id, safe="")


def link(path: str, params: Mapping[str, int | None] | None = None) -> str:
    """An escaped href for `path` with the non-None query parameters."""
    query = urllib.parse.urlencode({k: v for k, v in (params or {}).items() if v is not None})
    return html.escape(path + ("?" + query if query else ""), quote=True)


def href(job_id: str) -> str:
    return link(job_path(job_id))


def age(seconds: float) -> str:
    """A short human duration: 0.4s, 12s, 4m 05s, 2h 03m, 3d 4h."""
    s = max(0.0, float(seconds))
    m, h = int(s) // 60, int(s) // 3600
    return (f"{s:.1f}s" if s < 9.95 else f"{s:.0f}s" if s < 59.5 else f"{m}m {int(s) % 60:02d}s" if m < 60
            else f"{h}h {m % 60:02d}m" if h < 24 else f"{h // 24}d {h % 24}h")


def epoch(iso: str) -> float:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def when(iso: str | None, now: float) -> str:
    """UTC ISO time in monospace with its age; a dash when there is none."""
    if not iso:
        return "&mdash;"
    ago = now - epoch(iso)
    rel = f"{age(ago)} ago" if ago >= 0 else f"in {age(-ago)}"
    return f'<span class="mono nowrap">{esc(iso)}</span> <span class="muted nowrap">({rel})</span>'


def figure(value: float) -> str:
    """A rate at a glance: 1,234 / 12.5 / 0.25 (three digits at most after the thousands; tiny ones in e-notation)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}" if value >= 0.01 or value <= 0 else f"{value:.1e}"


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def badge(state: str, text: str | None = None) -> str:
    return f'<span class="badge s-{esc(state)}">{esc(text or state)}</span>'


def stat(key: str, value: str, attr: str = "") -> str:
    return f'<div class="stat"{attr}><span class="k">{key}</span><span class="v">{value}</span></div>'


# A table's column: its heading (">" first: right-aligned, numeric) and its cell for one item, as HTML.
Column = tuple[str, Callable[[T], str]]


def columns_table(columns: Sequence[Column[T]], items: Iterable[T], empty: str, *, more: str = "", cls: str = "",
                  row: Callable[[T], str] = lambda item: "") -> str:
    """`table` of `items`, one row each, its cells by `columns`; `row(item)`: the <tr>'s attributes."""
    tds = [('<td class="num">' if head.startswith(">") else "<td>", cell) for head, cell in columns]
    rows = [f"<tr{row(item)}>" + "".join(f"{td}{cell(item)}</td>" for td, cell in tds) + "</tr>" for item in items]
    return table([head for head, _ in columns], rows, empty, cls, more)


def table(head: Iterable[str], rows: list[str], empty: str, cls: str = "", more: str = "") -> str:
    """A boxed table (or the `empty` sentence when no rows); a ">" heading is numeric, right-aligned; `more`: a last
    line, e.g. rows left out."""
    if not rows:
        return f'<div class="box"><div class="empty">{esc(empty)}</div></div>'
    ths = "".join(f'<th class="num">{h[1:]}</th>' if h.startswith(">") else f"<th>{h}</th>" for h in head)
    tail = f'<div class="cut">{more}</div>' if more else ""
    return (f'<div class="box"><table class="{cls}"><thead><tr>{ths}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>{tail}</div>')


def pager(what: str, offset: int, shown: int, total: int, path: str, params: Mapping[str, int | None],
          offset_key: str, limit: int) -> str:
    """'jobs 51–100 of 20,000' with links to the previous and next page (other parameters kept)."""
    if total <= shown and offset == 0:
        return ""
    first, last = (offset + 1, offset + shown) if shown else (0, 0)
    parts = [f"{what} {first:,}&ndash;{last:,} of {total:,}"]
    if offset > 0:
        parts.append(f'<a rel="prev" href="{link(path, {**params, offset_key: max(0, offset - limit)})}">'
                     f"&larr; previous</a>")
    if offset + limit < total:
        parts.append(f'<a rel="next" href="{link(path, {**params, offset_key: offset + limit})}">next &rarr;</a>')
    return f'<nav class="pager">{" ".join(parts)}</nav>'


def health(job: JobView) -> tuple[str, list[str]]:
    """(colour, warnings) for a job summary: the colour of its state, orange when running degraded."""
    state = job.state
    colour = {"running": "green", "waiting": "amber", "failed": "red", "succeeded": "blue"}.get(state, "grey")
    if state in FINISHED:
        return colour, []
    warns = []
    used, budget = job.restart_count, job.max_restarts
    if used and used * 2 > budget:
        warns.append(f"restarts {used}/{budget} used" + (" (none left)" if used >= budget else ""))
    short = job.max_nodes - job.group_world_size
    if state == "running" and short > 0:
        warns.append(f"{short} node{'s' if short != 1 else ''} short of max {job.max_nodes}")
    if excluded := job.counts.excluded:
        warns.append(f"{excluded} node{'s' if excluded != 1 else ''} excluded")
    if warns and state == "running":
        colour = "orange"
    return colour, warns


def restarts(used: int, budget: int) -> str:
    frac = 1.0 if budget == 0 and used else (used / budget if budget else 0.0)
    level = "full" if used >= budget and used else ("mid" if used * 2 > budget else "")
    return (f'<span class="nowrap" title="restarts used / max_restarts"><span class="bar {level}">'
            f'<i style="width:{min(frac, 1.0) * 100:.0f}%"></i></span>{used} / {budget}</span>')


def lease(seconds: float, timeout: float | None) -> str:
    """A lease's age, orange past half the lease timeout, red past it."""
    cls = "" if not timeout else "bad-text" if seconds > timeout else "warn-text" if seconds > timeout / 2 else ""
    return f'<span class="{cls}">{age(seconds)}</span>'


def host(n: NodeView) -> str:
    name, addr, checks = n.host, n.addr, n.checks
    # what the node checks of itself; a skipped GPU check is shown as a warning, never as healthy
    said = f'<br><span class="{"warn-text" if "skipped" in checks else "muted"}">{esc(checks)}</span>' if checks else ""
    if name and name != addr:
        return f'<span class="mono">{esc(name)}</span> <span class="mono muted">{esc(addr)}</span>{said}'
    return f'<span class="mono">{esc(addr or name)}</span>{said}'
