"""`rdzv-ctl`'s text: the server's typed views (protocol/views.py) as tables and lines for a terminal. Every cell that
quotes what a client sent is escaped, so none can move the cursor or recolour the operator's terminal."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from protocol.messages import FailureReason
from protocol.quoting import one_line
from protocol.views import (
    DrainedView,
    EventsView,
    EventView,
    JobDetail,
    JobView,
    NodeView,
    ProgressView,
    RestartCostView,
    StatusView,
)

REASON_WIDTH = 60
SLOW_SHOWN = 10           # slow nodes named per job by `status` (the job's own view names them all)
T = TypeVar("T")


def _visible(text: str) -> str:
    return one_line(text).replace("\t", "\\t")


def truncate(text: str, width: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 3] + "..."


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def clock(iso_time: str | None) -> str:
    """'2024-05-01T12:34:56.789Z' -> '12:34:56.789' (UTC, as the server sends it)."""
    return iso_time.split("T", 1)[-1].rstrip("Z") if iso_time else "-"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ranks(node: NodeView) -> str:
    first, n = node.rank_offset, node.local_world_size
    if first is None:
        return "-"
    return str(first) if n <= 1 else f"{first}-{first + n - 1}"


def rate(value: float) -> str:
    """Steps per second: 1,234 / 12.5 / 0.25 (tiny ones in e-notation)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}" if value >= 0.01 or value <= 0 else f"{value:.1e}"


def pace(job: JobView) -> str | None:
    """A job's steps per second; None (shown as "-") where JobView.pace has none."""
    return rate(steps_per_s) if (steps_per_s := job.pace()) is not None else None


def ettr(p: ProgressView) -> str | None:
    return f"{p.ettr * 100:.1f}%" if p.ettr is not None else None


# Each table's columns, declared once as (heading, cell) pairs.
Column = tuple[str, Callable[[T], object]]
JOBS: list[Column[JobView]] = [
    ("JOB", lambda j: j.job_id), ("STATE", lambda j: j.state), ("ROUND", lambda j: j.round_id),
    ("WORLD", lambda j: j.world_size), ("NODES", lambda j: f"{j.counts.nodes} ({j.min_nodes}:{j.max_nodes})"),
    ("RESTARTS", lambda j: f"{j.restart_count}/{j.max_restarts}"), ("SPARES", lambda j: j.counts.spares),
    ("EXCLUDED", lambda j: j.counts.excluded), ("STEPS/S", pace),
    ("ETTR", lambda j: ettr(j.progress)), ("REASON", lambda j: truncate(j.reason, REASON_WIDTH))]
def _snapshot(n: NodeView) -> str | None:
    """Its newest in-memory snapshot's step / its newest copy's on a peer (issue 46): "25/25", "25/-", and how many
    pushes a peer refused: "25/20!3"; "25/off": its round makes no copies."""
    c = n.copies
    if c is None or c.local_step < 0:
        return None
    old = " (before restart)" if n.copies_before_restart else ""     # no note since the server came back
    if not c.copying:
        return f"{c.local_step}/off{old}"
    return (f"{c.local_step}/{c.copied_step if c.copied_step >= 0 else '-'}" + (f"!{c.refused}" if c.refused else "")
            + old)


MEMBERS: list[Column[NodeView]] = [
    ("RANK", lambda n: n.group_rank), ("NODE", lambda n: n.node_id), ("ADDR", lambda n: n.addr),
    ("WORKERS", lambda n: n.local_world_size), ("RANKS", _ranks), ("LEASE AGE", lambda n: duration(n.lease_age_s)),
    ("WORKER STATE", lambda n: n.worker_state or n.state),
    ("SNAPSHOT/COPY", _snapshot),
    ("STEPS/S", lambda n: rate(n.steps_per_s) if n.steps_per_s is not None else None),
    ("PACE", lambda n: "slow" if n.slow else None)]
# Rows start with "#": a line of a job's view that starts with a digit is a member's (scripts read them so).
COSTS: list[Column[RestartCostView]] = [
    ("ROUND", lambda c: c.round_label), ("CAUSE", lambda c: c.cause or "-"),
    ("COST", lambda c: duration(c.cost_s) if c.cost_s is not None else "not stepped since"),
    ("REDONE", lambda c: c.redone)]
OTHERS: list[Column[NodeView]] = [
    ("NODE", lambda n: n.node_id), ("ADDR", lambda n: n.addr), ("WORKERS", lambda n: n.local_world_size),
    ("LEASE AGE", lambda n: duration(n.lease_age_s)),
    ("READY", lambda n: "checks-due" if n.checks_due else
     f"preparing {duration(n.preparing_for_s)}" if n.preparing_for_s is not None else "yes")]
EXCLUDED: list[Column[NodeView]] = [
    ("NODE", lambda n: n.node_id), ("ADDR", lambda n: n.addr),
    ("EXCLUSIONS", lambda n: f"{n.exclusions}(suspect)" if n.suspicions else n.exclusions),
    ("TIME LEFT", lambda n: duration(n.excluded_for_s)), ("LEASE AGE", lambda n: duration(n.lease_age_s))]
DRAINED: list[Column[DrainedView]] = [("NODE", lambda d: d.node_id), ("REASON", lambda d: d.reason)]
EVENTS: list[Column[EventView]] = [
    ("TIME", lambda e: clock(e.time)), ("KIND", lambda e: e.kind), ("NODE", lambda e: e.node_id),
    ("ROUND", lambda e: e.round_id), ("MESSAGE", lambda e: e.message)]
# The lists after the members: (key, columns, what its cut line calls the rows).
OTHER_LISTS: list[tuple[str, Sequence[Column[Any]], str]] = [
    ("waiting", OTHERS, "waiting"), ("spares", OTHERS, "spares"), ("excluded", EXCLUDED, "excluded nodes"),
    ("drained", DRAINED, "drained nodes")]


def columns_table(columns: Sequence[Column[T]], items: Sequence[T]) -> str:
    """Columns padded to their widest cell, the last not padded; a row per item. Cells may quote what clients sent:
    control characters are escaped, so none can move the cursor or recolour the operator's terminal."""
    rows = [[cell(item) for _, cell in columns] for item in items]
    cells = [[head for head, _ in columns]] + [["-" if c is None else _visible(str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def format_status(doc: StatusView) -> str:
    held = [f"unhealthy host {h.host}: held out {h.held_for_s}s more (node {h.node_id} of job {h.job_id}, "
            f"{h.kind}: {truncate(h.reason, REASON_WIDTH)})" for h in doc.unhealthy_hosts]
    return "\n".join([_format_jobs(doc), *map(_visible, _notes(doc.jobs)), *held])


def _notes(jobs: Sequence[JobView]) -> list[str]:
    """Lines per job after the table (names and stalls do not fit a column): slow nodes, ranks not stepping."""
    out = []
    for j in jobs:
        if names := j.progress.slow_nodes:
            more = f" and {len(names) - SLOW_SHOWN} more" if len(names) > SLOW_SHOWN else ""
            out.append(f"slow nodes in job {j.job_id}: {', '.join(names[:SLOW_SHOWN])}{more}")
        if j.progress.stall:
            out.append(f"not stepping in job {j.job_id}: {j.progress.stall}")
    return out


def _progress(p: ProgressView, live: bool) -> list[str]:
    """A job's training progress, a few lines of the job's view."""
    if not p.signal:
        return ["progress   no progress signal (no worker reported a training step)"]
    paced = f", {rate(p.steps_per_s)} steps/s" if live else ""
    out = [f"progress   {p.steps:,} steps{paced}, effective training time ratio "
           f"{ettr(p) or '-'} (first step {p.first_step_at or '-'})"]
    lost = f"lost       {duration(p.lost_s)} to {_plural(p.restarts, 'restart')}"
    if p.redone or any(c.redone is not None for c in p.costs):
        lost += f", {_plural(p.redone, 'step')} redone"
    out.append(lost)
    if p.restarting_for_s is not None and live:
        out.append(f"restarting {duration(p.restarting_for_s)} lost so far")
    if p.slow_nodes:
        out.append(f"slow       {_visible(', '.join(p.slow_nodes))}")
    if p.alike_step is not None:
        out.append(f"replicas   alike at step {p.alike_step:,} (the newest snapshot compared)")
    if p.stall and live:
        out.append(f"stall      {_visible(p.stall)}")
    return out


def _format_jobs(doc: StatusView) -> str:
    jobs, total = doc.jobs, doc.total
    if not jobs:
        if total:
            return f"no jobs from offset {doc.offset} (the server holds {_plural(total, 'job')})"
        return f"no jobs on this server (server time {doc.time or '?'})"
    out = columns_table(JOBS, jobs)
    if doc.offset or len(jobs) < total:
        out += f"\njobs {doc.offset + 1}-{doc.offset + len(jobs)} of {total}"
        if doc.next_offset is not None:
            out += f"; next page: rdzv-ctl status --offset {doc.next_offset}"
    return out


def _cut(doc: JobDetail, key: str, what: str) -> list[str]:
    """'N more WHAT (...)' when the server sent only part of a node list."""
    shown, count, offset = len(getattr(doc, key)), getattr(doc.counts, key), doc.node_offset
    if offset + shown >= count:
        return [] if not offset or shown else [f"(no {what} from {offset}: {count} in all)"]
    return [f"... {count - offset - shown} more {what} (rdzv-ctl job {doc.job_id} --node-offset {offset + shown})"]


def format_job(doc: JobDetail) -> str:
    out = [f"job        {doc.job_id}",
           f"state      {doc.state}" + (f" since {doc.finished_at}" if doc.finished_at else ""),
           f"reason     {_visible(doc.reason or '-')}",
           f"round      {doc.round_id if doc.round_id is not None else '-'}: "
           f"{_plural(doc.group_world_size, 'node')}, world size {doc.world_size} "
           f"(nodes {doc.min_nodes}:{doc.max_nodes})",
           f"restarts   {doc.restart_count}/{doc.max_restarts}",
           f"created    {doc.created_at or '-'}"]
    if doc.last_call_ends_in_s is not None:
        out.append(f"last call  ends in {duration(max(0.0, doc.last_call_ends_in_s))}")
    out += _progress(doc.progress, doc.finished_at is None)
    if doc.copies_off:
        out.append(f"copies     {_visible(doc.copies_off)}")
    out.append("")
    if doc.nodes:
        out.append(columns_table(MEMBERS, doc.nodes))
    elif not doc.counts.nodes:
        out.append("no round running")
    out += _cut(doc, "nodes", "members")
    for key, columns, what in OTHER_LISTS:
        if getattr(doc, key):
            out += ["", f"{key}:", columns_table(columns, getattr(doc, key))]
        out += _cut(doc, key, what)
    if costs := doc.progress.costs:
        out += ["", "restarts since the first step (cost: from the last step before to the first after):",
                columns_table(COSTS, costs)]
        out += [f"#{c.round_id} took {c.anatomy.line()} on {c.anatomy_node}" for c in costs if c.anatomy is not None]
    if failure := doc.last_failure:
        how = f", signal {failure.signal}" if failure.signal else \
            "" if failure.reason == FailureReason.HANG else f", exit code {failure.exitcode}"   # a hang's rank: no exit
        text = f"rank {failure.rank} (local {failure.local_rank}) on " \
               f"{failure.host or failure.node_id}: {failure.reason or 'exited'}{how}"
        if failure.message:
            text += f": {_visible(failure.message)}"
        out += ["", f"last failure  {text}"]
    return "\n".join(out)


def format_events(doc: EventsView, last: int | None) -> str:
    events = doc.events
    if last is not None:       # the server already kept only the last N; an older one sends them all
        events = events[-last:] if last > 0 else []
    if not events:
        return f"no events for job {doc.job_id}"
    return columns_table(EVENTS, events)
