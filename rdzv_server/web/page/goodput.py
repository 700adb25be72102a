"""A job's training progress on its card (from the view's `progress`, protocol/views.ProgressView): its pace, the
effective training time ratio, the time restarts cost and the restart under way, steps redone, slow nodes; and on
the job's page the cost of each restart. A job that never stepped says "no progress signal", never 0 steps/s: its
workers may not report steps at all."""
from __future__ import annotations

from protocol.views import JobView, ProgressView, RestartCostView
from rdzv_server.web.page.parts import Column, age, badge, clip, columns_table, esc, figure, plural, stat
from rdzv_server.web.page.svg import cause_label

SLOW_SHOWN = 5            # slow nodes named on a card (the view names up to views.SLOW_LIMIT)


def pace(job: JobView) -> str:
    """Steps per second as a cell: a dash where JobView.pace has none (no signal, or the job has ended)."""
    if (steps_per_s := job.pace()) is not None:
        return figure(steps_per_s)
    why = "no progress signal" if not job.progress.signal else "the job has ended"
    return f'<span class="muted" title="{why}">&mdash;</span>'


def ettr(p: ProgressView) -> str:
    """The effective training time ratio as a percentage cell: a dash when there is none."""
    if p.ettr is None:
        return '<span class="muted" title="no progress signal">&mdash;</span>'
    # orange once a tenth of the time since the first step was lost, red once half of it was
    cls = "bad-text" if p.ettr < 0.5 else "warn-text" if p.ettr < 0.9 else ""
    return f'<span class="{cls}">{p.ettr * 100:.1f}%</span>'


def slow_badge(slow: bool | None) -> str:
    return " " + badge("slow", "slow") if slow else ""


def goodput_line(job: JobView) -> str:
    """The card's goodput stats under its head, or "no progress signal" when the job never stepped."""
    p = job.progress
    if not p.signal:
        return ('<div class="stats goodput" data-signal="0"><span class="muted">no progress signal: no worker has '
                'reported a training step</span></div>')
    stats = [stat("steps/s", pace(job)), stat("steps", f"{p.steps:,}"),
             stat("effective training", ettr(p), ' title="effective training time ratio: time since the first step '
                                                 'less the time restarts cost, over the time since the first step"'),
             stat("lost to restarts", age(p.lost_s) + (f' <span class="muted">in {plural(p.restarts, "restart")}</span>'
                                                       if p.restarts else ""))]
    if p.redone or any(c.redone is not None for c in p.costs):
        stats.append(stat("steps redone", f"{p.redone:,}"))
    if p.alike_step is not None:
        stats.append(stat("replicas alike", f"step {p.alike_step:,}", ' data-alike="1" title="the newest snapshot '
                                                                     'step every replica held alike, bit for bit"'))
    if p.restarting_for_s is not None:
        stats.append(stat("restarting", f'<span class="warn-text">{age(p.restarting_for_s)} lost so far</span>',
                          ' data-restarting="1"'))
    if p.slow_nodes:
        names = ", ".join(f'<span class="mono">{esc(clip(n, 60))}</span>' for n in p.slow_nodes[:SLOW_SHOWN])
        more = len(p.slow_nodes) - SLOW_SHOWN
        stats.append(stat("slow nodes", f'<span class="warn-text">{names}</span>'
                                        + (f' <span class="muted">and {more} more</span>' if more > 0 else ""),
                          ' data-slow="1"'))
    if p.stall:
        stats.append(stat("not stepping" if p.stall_kind == "alone" else "long collective",
                          f'<span class="warn-text mono">{esc(clip(p.stall, 300))}</span>',
                          f' data-stall="{esc(p.stall_kind or "")}"'))
    return f'<div class="stats goodput" data-signal="1">{"".join(stats)}</div>'


def _cost(c: RestartCostView, under_way: bool) -> str:
    if c.cost_s is not None:
        return age(c.cost_s)
    return '<span class="warn-text">under way</span>' if under_way else '<span class="muted">never stepped again</span>'


# The table of restarts, its columns declared once; a row is a restart and whether it is the one under way.
COSTS: list[Column[tuple[RestartCostView, bool]]] = [
    (">round", lambda r: r[0].round_label),
    ("cause", lambda r: esc(cause_label(r[0].cause) if r[0].cause else "")),
    (">cost", lambda r: _cost(*r)),
    (">steps redone", lambda r: esc(f"{r[0].redone:,}" if r[0].redone is not None else None)),
    ("where the time went", lambda r: _phases(r[0])),
]


def _phases(c: RestartCostView) -> str:
    if c.anatomy is None:
        return ""
    return f'<span class="mono" data-phases="1">{esc(c.anatomy.line())} on {esc(c.anatomy_node or "?")}</span>'



def restart_costs(job: JobView) -> str:
    """The job page's table of restarts since the job first stepped, newest first; "" when there were none."""
    p = job.progress
    if not p.costs:
        return ""
    last = p.costs[-1]
    rows = [(c, c is last and p.restarting_for_s is not None) for c in reversed(p.costs)]
    total = p.restarts + (last.cost_s is None)       # the done ones, and the last if it never stepped again
    shown = (f'<p class="muted">The last {len(p.costs)} of {plural(total, "restart")}; {age(p.lost_s)} lost in all '
             f"to those done.</p>" if len(p.costs) < total else "")
    return ("<h3>Restarts and what they cost</h3>"
            + columns_table(COSTS, rows, "", row=lambda r: f' data-cost-round="{r[0].round_id}"')
            + shown + '<p class="muted">A restart costs the time from the last step before it to the first step '
                      "after it, whatever caused it. Where the time went, on the node the job waited for: its "
                      "workers stopping, the new round, the workers' start, the script's set-up, CUDA, the process "
                      "group, the restore and the first step.</p>")
