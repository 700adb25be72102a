"""A picture of one job's history (happened.py reads it from the events): an inline SVG (no script) of its rounds,
member count, failures, losses, joins and promoted spares over time; pure: `history_svg(job, events, now)` returns
markup. Bounded whatever the job's
size: one pass reads at most MAX_EVENTS_PER_JOB events, rounds narrower than a few pixels are drawn as one span
and marks closer than a few pixels as one mark with its count, so the SVG never has a row per node and its size
has a ceiling. Every client string (job id, reasons, messages) is escaped and clipped."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.views import JobDetail, JobView
from rdzv_server.core.records import Event
from rdzv_server.web.page import svg
from rdzv_server.web.page.happened import History, Mark, Span, read_history, summary, whole
from rdzv_server.web.page.parts import age, clip, plural
from rdzv_server.web.page.rate import rate_lane, rate_summary, read_points
from rdzv_server.web.page.svg import CAUSES, FINISH, INK, MARKS, MUTED, Frame, cause_label, num, stamp, x_

MIN_SPAN_S = 1.0         # the shortest time axis (a job a few ms old is not drawn over the whole width)
TEXT = 120               # characters of a client's text in a tooltip
SAMPLES = 2              # messages a grouped mark's tooltip quotes
_SEVERITY = {c: i for i, c in enumerate(CAUSES)}
_MARK_ORDER = {k: i for i, k in enumerate(MARKS)}


def _end(s: Span, h: History) -> float:
    return s.end if s.end is not None else h.t1


def _tip(f: Frame, text: str) -> str:
    """A tooltip (on the job's page; the overview's small picture has none: its size stays small)."""
    return "" if f.compact else f"<title>{x_(text)}</title>"


def _span_text(s: Span, h: History) -> str:
    when = f"{stamp(s.start)} to {'now' if s.current else stamp(_end(s, h))} UTC ({age(_end(s, h) - s.start)})"
    if s.round_id is None:
        return f"waiting for nodes, {when}" + (f": {clip(s.reason, TEXT)}" if s.reason else "")
    head = (f"round {s.round_id}{' (the current one)' if s.current else ''}: {plural(s.nodes, 'node')}, world size "
            f"{s.world_size:,}, cause: {cause_label(s.cause)}, {when}")
    return f"{head}; {clip(s.reason, TEXT)}" if s.reason else head


def _groups(h: History, f: Frame) -> list[list[Span]]:
    """The spans in time order; neighbours each narrower than `f.round_px` share a group (drawn as
    one) until the group is that wide. The current round is always its own."""
    out: list[list[Span]] = []
    group_x = 0.0                    # where the last group starts
    for s in h.spans:
        x0, x1 = f.x(s.start), f.x(_end(s, h))
        last = out[-1] if out else None
        if last and x1 - x0 < f.round_px and x0 - group_x < f.round_px and not s.current and not last[0].current:
            last.append(s)
        else:
            out.append([s])
            group_x = x0
    return out


def _group_text(g: list[Span], h: History) -> str:
    """The tooltip of a group of narrow spans."""
    rounds = [s for s in g if s.round_id is not None]
    counts = Counter(s.cause for s in rounds)
    waits = len(g) - len(rounds)
    return (f"rounds {rounds[0].round_id} to {rounds[-1].round_id}: {plural(len(rounds), 'round')} in "
            f"{age(_end(g[-1], h) - g[0].start)} from {stamp(g[0].start)} UTC, by cause: "
            + ", ".join(f"{cause_label(k)} {n}" for k, n in counts.items())
            + (f"; waited for nodes {plural(waits, 'time')}" if waits else ""))


def _rounds_lane(h: History, f: Frame, groups: list[list[Span]], legend: set[str]) -> list[str]:
    """A bar per round (or group of narrow ones) coloured by its cause, labelled when there is room."""
    y, height = f.lanes["rounds"]
    out, labels = ['<g stroke="#fff" stroke-width="1">'], []
    for g in groups:
        x0 = f.x(g[0].start)
        width = max(f.x(_end(g[-1], h)) - x0, 1.0)
        box = f'x="{num(x0)}" width="{num(width)}"'
        rounds = [s for s in g if s.round_id is not None]
        if not rounds:
            legend.add("waiting")
            out.append(f'<rect data-waiting="1" {box} y="{y + 3}" height="{height - 6}" fill="#fff8c5" '
                       f'stroke="#d4a72c" stroke-dasharray="3 2">{_tip(f, _span_text(g[0], h))}</rect>')
            continue
        worst = min(rounds, key=lambda s: _SEVERITY.get(s.cause, len(_SEVERITY)))
        cause = worst.cause if worst.cause in CAUSES else ""
        legend.add(f"cause:{cause}")
        s = g[0]
        if len(g) == 1:
            attrs, text = f'data-round="{s.round_id}" data-cause="{x_(s.cause)}"', _span_text(s, h)
            label = f"#{s.round_id}"
            if s.cause and width > 7 * (len(label) + len(cause_label(s.cause))) + 12:
                label += f" {cause_label(s.cause)}"
            if width > 7 * len(label) + 6:
                labels.append(f'<text x="{num(x0 + width / 2)}" y="{y + height / 2 + 4}" text-anchor="middle" '
                              f'fill="#fff" font-weight="600">{x_(label)}</text>')
        else:
            attrs = f'data-rounds="{rounds[0].round_id}-{rounds[-1].round_id}"'
            text = "" if f.compact else _group_text(g, h)
        fill = CAUSES[cause][0]
        if s.current:
            legend.add("current")
            attrs += f' data-current="1" stroke="{INK}" stroke-width="2.5"'
            fill = svg.RUNNING
        out.append(f'<rect {attrs} {box} y="{y + 1}" height="{height - 2}" rx="2" fill="{fill}">'
                   f'{_tip(f, text)}</rect>')
    return [*out, "</g>", *labels]


def _members(h: History, f: Frame, groups: list[list[Span]], job: JobView, legend: set[str]) -> list[str]:
    """The member count as a filled step line; the current round's time shaded; min/max nodes dashed."""
    y, height = f.lanes["members"]
    low, high = whole(job.min_nodes), whole(job.max_nodes)
    top, ticks = svg.members_scale(max((s.nodes for s in h.spans), default=0), low, high, f.compact)

    def yv(v: float) -> float:
        return y + height - v / top * height

    out = [f'<rect x="{f.left}" y="{y}" width="{f.right - f.left}" height="{height}" fill="#fbfcfd"/>']
    out += [f'<line x1="{f.left}" x2="{f.right}" y1="{yv(t):.1f}" y2="{yv(t):.1f}" stroke="{svg.GRID}"/>'
            f'<text x="{f.left - 6}" y="{yv(t) + 4:.1f}" text-anchor="end" fill="{MUTED}">{t:,}</text>' for t in ticks]
    for s in h.spans:
        if s.current:
            out.append(f'<rect x="{f.x(s.start):.1f}" y="{y}" width="{max(f.x(h.t1) - f.x(s.start), 1):.1f}" '
                       f'height="{height}" fill="#ddf4ff"/>')
    out += svg.limit_lines(f, yv, low, high, top)
    if groups:
        legend.add("members")
        d = [f"M{f.x(groups[0][0].start):.1f},{yv(0):.1f}"]
        for g in groups:
            values = [s.nodes for s in g]
            d.append(f"H{f.x(g[0].start):.1f}")
            if len(values) > 1:
                d.append(f"V{yv(min(values)):.1f}V{yv(max(values)):.1f}")
            d.append(f"V{yv(values[-1]):.1f}H{f.x(_end(g[-1], h)):.1f}")
        line = "".join(d)
        out.append(f'<path d="{line}V{yv(0):.1f}Z" fill="#0969da" fill-opacity=".13"/>'
                   f'<path class="members" d="{line}" fill="none" stroke="#0969da" stroke-width="2"/>')
        last = h.spans[-1]
        if last.current:
            text = f"{plural(last.nodes, 'node')}, world size {last.world_size:,}"
            out.append(f'<text x="{f.x(h.t1) - 6:.1f}" y="{max(yv(last.nodes) - 6, y + 11):.1f}" text-anchor="end" '
                       f'fill="{INK}" font-weight="600">{x_(text)}</text>')
    return out


@dataclass(slots=True)
class _Bucket:
    """The marks of one lane closer than `mark_px`: drawn as one, in the style of its commonest kind."""
    first: Mark
    last: Mark
    counts: dict[str, int]
    marks: int = 0
    samples: tuple[Mark, ...] = ()      # the first few, quoted in the tooltip

    def add(self, m: Mark) -> None:
        self.last = m
        self.marks += 1
        self.counts[m.kind] = self.counts.get(m.kind, 0) + m.count
        if len(self.samples) < SAMPLES:
            self.samples += (m,)

    def kind(self) -> str:
        return max(self.counts, key=lambda k: (self.counts[k], -_MARK_ORDER[k]))

    def text(self) -> str:
        first, last = self.first, self.last
        if self.marks == 1 and first.count == 1:
            return f"{stamp(first.t)} UTC: {clip(first.text, TEXT)}"
        quoted = "; ".join(clip(m.text, TEXT // 2) for m in self.samples)
        return (f"{stamp(first.t)} to {stamp(last.t)} UTC: " + ", ".join(
            f"{n:,} x {MARKS[k].label}" for k, n in self.counts.items()) + f": {quoted}"
            + ("; ..." if self.marks > SAMPLES else ""))


def _buckets(h: History, f: Frame) -> list[tuple[str, _Bucket]]:
    """Each lane's marks in buckets at least `f.mark_px` apart (so at most a few hundred per lane)."""
    width = f.mark_px / (f.right - f.left) * f.span       # mark_px, in seconds
    open_: dict[str, _Bucket] = {}
    out: list[tuple[str, _Bucket]] = []
    for m in h.marks:
        lane = MARKS[m.kind].lane
        bucket = open_.get(lane)
        if bucket is None or m.t - bucket.first.t >= width:
            bucket = open_[lane] = _Bucket(m, m, {})
            out.append((lane, bucket))
        bucket.add(m)
    return out


def _marks(h: History, f: Frame, legend: set[str]) -> list[str]:
    """A mark per bucket in its lane (restarts and server events as lines across the rounds and
    members), with the bucket's count beside it where there is room."""
    out: list[str] = []
    labels: list[str] = []
    low = f.lanes.get("rate", f.lanes["members"])       # lines cross the rounds, members and steps per second
    top, bottom = f.lanes["rounds"][0], low[0] + low[1]
    buckets = [(lane, b) for lane, b in _buckets(h, f) if lane in f.lanes or (lane == "line" and not f.compact)]
    room: dict[int, float] = {}      # bucket -> how far right its count may reach: the next mark in its lane
    following: dict[str, float] = {}
    for lane, b in reversed(buckets):
        room[id(b)] = following.get(lane, f.right + 40)
        following[lane] = f.x(b.first.t) - 5
    for lane, bucket in buckets:
        kind = bucket.kind()
        style = MARKS[kind]
        legend.update(bucket.counts)
        x, count = f.x(bucket.first.t), sum(bucket.counts.values())
        attrs = f' data-kind="{kind}" data-count="{count}"'
        if lane == "line":
            cy, size = top + (bottom - top) / 2, (bottom - top) / 2 - 2
        else:
            cy, size = f.lanes[lane][0] + f.lanes[lane][1] / 2, 3.5 if f.compact else 4.5
        out.append(svg.glyph(style.shape, x, cy, style.colour, size, attrs, _tip(f, bucket.text())))
        words = f"{count:,}"
        if lane != "line" and count > 1 and x + 7 + 6 * len(words) < room[id(bucket)]:
            labels.append(f'<text x="{num(x + 7)}" y="{num(cy + 4)}">{words}</text>')
    return [*out, f'<g font-size="10" fill="{MUTED}">', *labels, "</g>"]


def _finish(h: History, f: Frame, legend: set[str]) -> list[str]:
    if h.finish is None:
        return []
    t, state = h.finish
    legend.add(f"finish:{state}")
    x, colour = f.x(t), FINISH[state]
    top, (y, height) = f.lanes["rounds"][0], f.lanes["members"]
    return [f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{y + height}" stroke="{colour}" stroke-width="2.5"/>'
            f'<text x="{x - 5:.1f}" y="{y + 13}" text-anchor="end" fill="{colour}" font-weight="600">job {state}'
            f"</text>"]


def history_svg(job: JobView, events: Sequence[Event], now: float, *, compact: bool = False) -> str:
    """The picture of `job` (a view) from its kept `events`: rounds by cause, member count, steps per second (a
    job's page, from JobDetail.rate), marks for failures, nodes going and coming, restarts; a legend of what it
    shows; `compact` for a card."""
    h = read_history(job, events, now)
    points = read_points(job.rate, h.t0) if isinstance(job, JobDetail) and not compact else []
    f = svg.frame(h.t0, h.t1, MIN_SPAN_S, compact, rate=bool(points))
    legend: set[str] = set()
    groups = _groups(h, f)
    body = [*svg.lane_labels(f), *svg.axis(f, h.t1, h.finish is None), *_members(h, f, groups, job, legend),
            *(rate_lane(f, points, legend) if points else []), *_rounds_lane(h, f, groups, legend),
            *_marks(h, f, legend), *_finish(h, f, legend)]
    if h.cut:
        legend.add("cut")
    rounds = sum(1 for s in h.spans if s.round_id is not None)
    if not rounds:
        y, height = f.lanes["members"]
        body.append(f'<text x="{(f.left + f.right) / 2}" y="{y + height / 2 + 4}" text-anchor="middle" '
                    f'fill="{MUTED}">no round formed yet</text>')
    items, legend_height = svg.legend(legend, f.bottom + 22)
    total = f.bottom + 22 + legend_height
    title = f"History of job {clip(job.job_id, TEXT)}"
    return (f'<svg class="history{" compact" if compact else ""}" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="0 0 {svg.W} {total:.0f}" role="img" aria-label="{x_(title)}" data-round-count="{rounds}" '
            f'font-family="system-ui, sans-serif" font-size="11"><title>{x_(title)}</title>'
            f"<desc>{x_(summary(job, h) + rate_summary(points))}</desc>{''.join(body)}{''.join(items)}</svg>")
