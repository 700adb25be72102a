"""The picture of a job's history (rdzv_server/web/page/history.py), drawn from hand-built cores and
event lists: time is plain floats, no server. Markup is parsed with html.parser, as a browser would
tokenize it.
"""
from __future__ import annotations

import re

from protocol.messages import LeaveRequest, StallReport, SuccessReport
from protocol.notes import ProgressNote
from protocol.stalls import RankSeen, RankState
from protocol.views import JobView, NodeCounts
from rdzv_server.core.events import EventKind as K
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, Event
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.logs import iso
from rdzv_server.web import views
from rdzv_server.web.page import render as page
from rdzv_server.web.page import svg
from rdzv_server.web.page.history import history_svg
from tests.unit import progress_jobs
from tests.unit.test_page import Markup, T, cfg, fail, join, running

HOSTILE = "</svg><script>alert(1)</script><img src=x onerror=alert(2)>"


def picture(rz: Rendezvous, job_id: str, now: float, compact: bool = False) -> tuple[str, Markup]:
    record = rz.jobs[job_id]
    text = history_svg(views.job_detail(record, now), record.events, now, compact=compact)
    return text, Markup(text)


def tags(m: Markup, attr: str) -> list[dict[str, str]]:
    return [a for _, a in m.tags if attr in a]


def desc(text: str) -> str:
    found = re.search(r"<desc>(.*?)</desc>", text)
    assert found, text[:500]
    return Markup(found.group(1)).text


def rounds_drawn(m: Markup) -> list[int]:
    """Every round id a bar stands for: one bar per round, or a bar for a run of narrow ones."""
    ids = []
    for a in tags(m, "data-round"):
        ids.append(int(a["data-round"]))
    for a in tags(m, "data-rounds"):
        first, last = map(int, a["data-rounds"].split("-"))
        ids.extend(range(first, last + 1))
    return sorted(ids)


def test_a_two_node_job_with_a_failure_and_a_restart():
    rz = Rendezvous()
    running(rz, "j", ["alpha", "bravo"], cfg(max_restarts=3))
    fail(rz, "j", "bravo", T + 40, message="CUDA error: out of memory")
    text, m = picture(rz, "j", T + 90)

    bars = tags(m, "data-round")
    assert [(a["data-round"], a["data-cause"]) for a in bars] == [("1", "start"), ("2", "failure")]
    assert [a.get("data-current") for a in bars] == [None, "1"]           # the running round stands out
    # ... drawn as running, not red for the failure it began with (its label and the legend keep the cause)
    assert [a["fill"] for a in bars] == [svg.CAUSES["start"][0], svg.RUNNING]
    one, two = (float(a["x"]) for a in bars)
    width = float(bars[0]["width"])
    assert svg.LEFT <= one < two < svg.W - svg.RIGHT and abs(one + width - two) < 1, bars   # back to back
    assert [(a["data-kind"], a["data-count"]) for a in tags(m, "data-kind")
            if a["data-kind"] in ("worker_failed", "restart")] == [("worker_failed", "1"), ("restart", "1")]
    assert "CUDA error: out of memory" in text                              # in the failure's tooltip
    assert len(tags(m, "data-waiting")) == 1                                # forming, before round 1
    words = desc(text)
    assert "2 rounds formed (start: 1, failure (restart): 1)" in words, words
    assert "1 x worker failed" in words and "restarts used 1 of 3" in words, words
    assert words.endswith("now round 2: 2 nodes, world size 2."), words
    # a legend of what is drawn, and only that
    assert {"round: start", "round: failure (restart)", "current round (running)", "worker failed", "restart"} <= set(
        re.findall(r">([^<>]+)</text>", text)), text
    assert "node lost" not in m.text and "spare promoted" not in m.text
    # an accessible name, and a viewBox for scaling
    assert ("svg", m.tags[0][1]) == m.tags[0] and m.tags[0][1]["role"] == "img"
    assert m.tags[0][1]["aria-label"] == "History of job j" and m.tags[0][1]["viewbox"].startswith("0 0 1200 ")


def test_spares_promoted_losses_and_a_finished_job():
    rz = Rendezvous()
    config = cfg(min_nodes=2, max_nodes=2, last_call_s=1.0)
    running(rz, "j", ["a", "b"], config)
    join(rz, "j", "spare", T + 5, config)                  # at max: a spare
    rz.handle("j", LeaveRequest(v=1, node_id="b", reason="stopped"), T + 20)
    completed = [e for e in rz.jobs["j"].events if e.kind == K.ROUND_COMPLETED]
    assert completed[-1].data["promoted"] == 1 and "promoted" not in completed[0].data
    for node in ("a", "spare"):
        rz.handle("j", SuccessReport(v=1, node_id=node, round_id=2), T + 30)
    text, m = picture(rz, "j", T + 31)

    kinds = [(a["data-kind"], a["data-count"]) for a in tags(m, "data-kind")]
    assert sorted(kinds) == [("node_joined", "1"), ("node_joined", "1"), ("node_left", "1"), ("node_spare", "1"),
                             ("promoted", "1")], kinds
    assert [a["data-cause"] for a in tags(m, "data-round")] == ["start", "node_left"]
    assert not [a for a in tags(m, "data-round") if "data-current" in a]   # finished: no current round
    assert "job succeeded" in m.text and ">now<" not in text
    assert "1 x spare promoted" in desc(text) and desc(text).endswith("job succeeded at 22:13:50 UTC.")


def test_a_1000_node_job_with_many_rounds_stays_small():
    """1,000 kept events (the most a job keeps) of the busiest kinds, many rounds of 1,000 nodes:
    rounds too narrow to draw alone share a bar, marks share a mark, and the SVG has a ceiling."""
    kinds = [K.WORKER_FAILED, K.NODE_LOST, K.NODE_JOINED, K.ROUND_COMPLETED]
    events: list[Event] = []
    rounds = 0
    for i in range(2 * MAX_EVENTS_PER_JOB):                # the picture reads only the last 1,000
        kind, data = kinds[i % len(kinds)], {}
        if kind == K.ROUND_COMPLETED:
            rounds += 1
            data = {"cause": "node_lost", "nodes": 1000 - i % 3, "world_size": 8000, "reason": "r" * 500}
        events.append(Event(t=T + i, seq=i + 1, kind=kind, message="m" * 500, node_id=f"node-{i}",
                            round_id=rounds if kind == K.ROUND_COMPLETED else -1, data=data))
    job = JobView(job_id="big", state="running", reason="", round_id=events[-1].round_id, world_size=8000,
                  group_world_size=999, min_nodes=900, max_nodes=1000, created_at=iso(T), finished_at=None,
                  restart_count=0, max_restarts=3, counts=NodeCounts(999, 0, 0, 0, 0), nodes=[], waiting=[],
                  spares=[], excluded=[], drained=[], lists_cut=True)
    now = events[-1].t + 5
    full = history_svg(job, events, now)
    assert full == history_svg(job, events[-MAX_EVENTS_PER_JOB:], now)
    small = history_svg(job, events, now, compact=True)
    assert len(full) < 128_000 and len(small) < 32_000, (len(full), len(small))
    for text in (full, small):
        m = Markup(text)
        assert len(m.tags) < 1500 and "node-1999" not in text            # no row, no mark per node
        assert rounds_drawn(m) == [e.round_id for e in events[-MAX_EVENTS_PER_JOB:] if e.kind == K.ROUND_COMPLETED]
        assert len(tags(m, "data-rounds")) > 0                           # too many to draw one by one
        current = [a for a in tags(m, "data-current")]
        assert [a.get("data-round") for a in current] == [str(events[-1].round_id)]
        assert "older events not kept" in m.text and "1,000" in m.text   # the member scale
    counted = sum(int(a["data-count"]) for a in tags(Markup(full), "data-kind") if a["data-kind"] == "node_lost")
    assert counted == MAX_EVENTS_PER_JOB // len(kinds)                   # grouped, none lost


def test_client_strings_are_escaped():
    rz = Rendezvous()
    running(rz, HOSTILE, ["a", "b"], cfg(max_restarts=3))
    fail(rz, HOSTILE, "b", T + 10, message=HOSTILE)
    rz.handle(HOSTILE, LeaveRequest(v=1, node_id="a", reason=HOSTILE), T + 20)
    for compact in (False, True):
        text, m = picture(rz, HOSTILE, T + 30, compact)
        assert text.count("</svg>") == 1 and text.endswith("</svg>")
        assert not {t for t, _ in m.tags} & {"script", "img"}, m.tags
        assert "<script" not in text and "<img" not in text
        assert m.tags[0][1]["aria-label"] == f"History of job {HOSTILE}"
    text, m = picture(rz, HOSTILE, T + 30)
    assert HOSTILE in Markup(text.replace("<title>", "<p>").replace("</title>", "</p>")).text


def test_a_new_job_and_one_without_events():
    rz = Rendezvous()
    join(rz, "new", "a", T, cfg(min_nodes=2, max_nodes=2))
    text, m = picture(rz, "new", T + 3)
    assert "no round formed yet" in m.text and not rounds_drawn(m)
    assert len(tags(m, "data-waiting")) == 1 and ">now<" in text
    assert desc(text).endswith("now waiting for nodes.")
    job = views.job_detail(rz.jobs["new"], T + 3)
    bare = history_svg(job, [], T + 3)                                    # nothing kept at all
    assert "no round formed yet" in Markup(bare).text and bare.endswith("</svg>")


def test_the_pages_show_the_picture():
    rz = Rendezvous()
    running(rz, "j", ["a", "b"], cfg())
    fail(rz, "j", "a", T + 10)
    index = Markup(page.index_page(rz, T + 20))
    assert [a["class"] for t, a in index.tags if t == "svg"] == ["history compact"]
    job = Markup(page.job_page(rz, "j", T + 20) or "")
    assert [a["class"] for t, a in job.tags if t == "svg"] == ["history"]
    assert [a["data-round"] for a in tags(job, "data-round")] == ["1", "2"]


# ---- training progress: steps per second, restarts after a hang ---------------------------------------

def _trained(rz: Rendezvous) -> None:
    """Round 1 steps at 2/s from T+10 to T+300, a crash, round 2 steps at 3/s from T+400 to T+600."""
    progress_jobs.join(rz, "j", "a", T)
    progress_jobs.join(rz, "j", "b", T)
    for round_id, start, end, rate in ((1, 10, 300, 2.0), (2, 400, 600, 3.0)):
        if round_id == 2:
            progress_jobs.crash(rz, "j", "b", T + 301)
        for t in range(start, end + 1, 5):
            for node in ("a", "b"):
                progress_jobs.poll(rz, "j", node, T + t, ProgressNote(
                    round_id=round_id, probes=1, steps=int((t - start) * rate) + 1, first_step_at=T + start,
                    last_step_at=T + t, window_s=10.0, window_steps=int(10 * rate), demand=0.5))


def test_steps_per_second_have_their_own_lane_broken_where_the_job_did_not_step():
    rz = Rendezvous()
    _trained(rz)
    now = T + 610
    detail = views.job_detail(rz.jobs["j"], now)
    text, m = picture(rz, "j", now)
    (line,) = [a for t, a in m.tags if t == "path" and a.get("class") == "rate"]
    assert int(line["data-points"]) == len(detail.rate) > 40
    assert line["d"].count("M") == 2                          # the restart is a gap, not a line across it
    members_bottom = sum(svg.frame(T, now, 1.0, False, rate=True).lanes["members"])
    ys = [float(xy.split(",")[1]) for xy in re.findall(r"[\d.]+,[\d.]+", line["d"])]
    assert min(ys) > members_bottom                           # under the members, on a scale of its own
    labels = re.findall(r">([^<>]+)</text>", text)
    assert "steps/s" in labels and "3/s" in labels and "5" in labels    # the lane, the latest value, the top
    assert "steps per second (own scale)" in labels
    assert desc(text).endswith("Steps per second: 3 at the latest point, 3 at most.")
    compact, cm = picture(rz, "j", now, compact=True)
    assert not [a for t, a in cm.tags if a.get("class") == "rate"] and "steps/s" not in compact


def test_a_job_without_rate_points_has_no_lane_and_the_same_picture_as_before():
    rz = Rendezvous()
    running(rz, "j", ["a", "b"], cfg())
    text, m = picture(rz, "j", T + 30)
    assert 'class="rate"' not in text and "steps/s" not in text
    assert m.tags[0][1]["viewbox"] == f"0 0 {svg.W} {svg.frame(T, T + 30, 1.0, False).bottom + 22 + 22:.0f}"


def test_a_round_after_a_hang_is_drawn_as_a_restart_with_the_hang_marked():
    rz = Rendezvous()
    progress_jobs.join(rz, "j", "a", T)
    progress_jobs.join(rz, "j", "b", T)
    waiting = [RankSeen(rank=r, local_rank=r % 2, state=RankState.WAITING, stalled_s=6.0) for r in range(4)]
    quiet = RankSeen(rank=3, local_rank=1, state=RankState.STOPPED, stalled_s=6.0, where="train.py:16 in <module>")
    for node, ranks in (("a", waiting[:2]), ("b", [waiting[2], quiet])):
        rz.handle("j", StallReport(v=1, node_id=node, credential=f"secret-{node}", round_id=1, threshold_s=5.0,
                                         ranks=ranks), T + 10)
    assert rz.jobs["j"].round.round_id == 2
    text, m = picture(rz, "j", T + 20)
    assert [(a["data-round"], a["data-cause"]) for a in tags(m, "data-round")] == [("1", "start"), ("2", "hang")]
    kinds = [a["data-kind"] for a in tags(m, "data-kind")]
    assert "restart" in kinds and "hang_detected" in kinds, kinds
    assert {"round: hang (restart)", "hang detected"} <= set(re.findall(r">([^<>]+)</text>", text))
    job = Markup(page.job_page(rz, "j", T + 20) or "")
    assert ("tr", {"class": "event ev-bad", "data-kind": "hang_detected",
                   "data-seq": str(next(e.seq for e in rz.jobs["j"].events if e.kind == K.HANG_DETECTED))}) in job.tags
