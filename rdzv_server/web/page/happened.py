"""What happened to one job, read from its kept events (pure): its rounds as spans by cause and member count,
and marks for failures, nodes going and coming, promoted spares and restarts (History); and the same in words
(summary). history.py draws it."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.views import JobView
from rdzv_server.core.events import EventKind
from rdzv_server.core.payloads import RoundFormed, WorkersFailed, payload_of
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, Event
from rdzv_server.web.page.parts import age, epoch, plural
from rdzv_server.web.page.svg import MARKS, cause_label, stamp

FINISHED = {EventKind.JOB_SUCCEEDED: "succeeded", EventKind.JOB_FAILED: "failed", EventKind.JOB_CLOSED: "closed"}
# Events drawn as marks, by the key of their style in svg.MARKS.
MARKED = {EventKind.WORKER_FAILED: "worker_failed", EventKind.HANG_DETECTED: "hang_detected",
          EventKind.NODE_EXCLUDED: "node_excluded",
          EventKind.NODE_LOST: "node_lost", EventKind.NODE_LEFT: "node_left", EventKind.NODE_DRAINED: "node_drained",
          EventKind.NODE_JOINED: "node_joined", EventKind.NODE_BENCHED: "node_spare",
          EventKind.NODE_READMITTED: "node_readmitted", EventKind.SERVER_RESTARTED: "server_restarted",
          EventKind.LEASES_EXTENDED: "server_restarted", EventKind.JOB_RESIZED: "job_resized"}
RESTARTS = {"failure": "a worker failure", "hang": "a hang"}    # round causes marked as restarts, in words


@dataclass(slots=True)
class Span:
    """A round (`round_id` set) or a time the job waited for nodes (None), from `start` to `end`."""
    start: float
    end: float | None = None          # None: still open at the end of the picture
    round_id: int | None = None
    nodes: int = 0
    world_size: int = 0
    cause: str = ""                   # a RoundCause value; "" for a round formed before the kept history
    reason: str = ""
    current: bool = False


@dataclass(slots=True)
class Mark:
    t: float
    kind: str                         # a key of svg.MARKS
    text: str
    count: int = 1


@dataclass(slots=True)
class History:
    t0: float
    t1: float                         # the end of the picture: now, or when the job finished
    cut: bool                         # older events were dropped: what came before t0 is unknown
    spans: list[Span]
    marks: list[Mark]
    finish: tuple[float, str] | None  # when the job finished, and how


def whole(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def read_history(job: JobView, events: Sequence[Event], now: float) -> History:
    """One pass over the kept events (oldest first; at most the last MAX_EVENTS_PER_JOB are read)."""
    events = events[-MAX_EVENTS_PER_JOB:]
    cut = bool(events) and events[0].seq > 1
    t0 = events[0].t if events else epoch(job.created_at or "")
    # A whole history starts with the job forming its first round; a cut one with the unknown.
    spans: list[Span] = [] if cut else [Span(t0)]
    marks: list[Mark] = []
    finish = None

    def close(t: float, then: Span | None) -> None:
        """End the open span (the last, while its `end` is None) at `t`; `then`, if any, opens the next."""
        if spans and spans[-1].end is None:
            spans[-1].end = t
        if then is not None:
            spans.append(then)

    for e in events:
        kind, payload = e.kind, payload_of(e.kind, e.data)
        if isinstance(payload, RoundFormed):
            cause = payload.cause
            close(e.t, Span(e.t, round_id=e.round_id, nodes=whole(payload.nodes), world_size=whole(payload.world_size),
                            cause=cause, reason=payload.reason))
            if cause in RESTARTS:
                marks.append(Mark(e.t, "restart", f"restart: round {e.round_id} formed after {RESTARTS[cause]}"))
            if promoted := whole(payload.promoted):
                marks.append(Mark(e.t, "promoted", f"{plural(promoted, 'spare')} promoted into round {e.round_id}",
                                  promoted))
        elif kind == EventKind.ROUND_ABANDONED:
            close(e.t, Span(e.t, reason=e.message))
        elif kind in FINISHED:
            close(e.t, None)
            finish = (e.t, FINISHED[kind])
        elif kind == EventKind.NODE_BENCHED and marks and marks[-1].kind == "node_joined" and marks[-1].t == e.t:
            marks[-1] = Mark(e.t, "node_spare", e.message)     # its join, decided at once: one mark
        elif kind in MARKED:
            marks.append(Mark(e.t, MARKED[kind], e.message, payload.count if isinstance(payload, WorkersFailed) else 1))
    rid = job.round_id
    if rid is not None and finish is None:
        if not any(s.round_id == rid for s in spans):     # formed before the oldest kept event
            spans.insert(0, Span(t0, round_id=rid, nodes=whole(job.group_world_size),
                                 world_size=whole(job.world_size), reason="formed before the kept history"))
        for s in spans:
            s.current = s.round_id == rid and s.end is None
    t1 = finish[0] if finish else epoch(job.finished_at) if job.finished_at else now
    return History(t0, max(t1, t0), cut, spans, marks, finish)


def summary(job: JobView, h: History) -> str:
    """What the picture shows, in words (its <desc>, for screen readers and the page's text)."""
    rounds = [s for s in h.spans if s.round_id is not None and s.cause]
    causes = Counter(cause_label(s.cause) for s in rounds)
    counts: Counter[str] = Counter()
    for m in h.marks:
        counts[m.kind] += m.count
    parts = [f"From {stamp(h.t0, '%Y-%m-%d')} {stamp(h.t0)} to {stamp(h.t1)} UTC ({age(h.t1 - h.t0)})"
             + ("; older events were not kept" if h.cut else "")]
    parts.append(f"{plural(len(rounds), 'round')} formed" + (" (" + ", ".join(f"{k}: {n}" for k, n in causes.items())
                                                            + ")" if causes else ""))
    if seen := [f"{n:,} x {MARKS[k].label}" for k, n in counts.items() if MARKS[k].lane != "in" or k == "promoted"]:
        parts.append(", ".join(seen))
    parts.append(f"restarts used {job.restart_count} of {job.max_restarts}")
    last = h.spans[-1] if h.spans else None
    if h.finish:
        parts.append(f"job {h.finish[1]} at {stamp(h.finish[0])} UTC")
    elif last is not None and last.current:
        parts.append(f"now round {last.round_id}: {plural(last.nodes, 'node')}, world size {last.world_size:,}")
    else:
        parts.append("now waiting for nodes")
    return "; ".join(parts) + "."
