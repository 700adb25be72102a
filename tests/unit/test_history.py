"""The picture of a job's history (rdzv_server/web/page/history.py), drawn from hand-built cores and
event lists: time is plain floats, no server. Markup is parsed with html.parser, as a browser would
tokenize it.
"""
from __future__ import annotations

import re

from protocol.messages import LeaveRequest, SuccessReport
from protocol.views import JobView, NodeCounts
from rdzv_server.core.events import EventKind as K
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, Event
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.logs import iso
from rdzv_server.web import views
from rdzv_server.web.page import render as page
from rdzv_server.web.page import svg
from rdzv_server.web.page.history import history_svg
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
    rz.leave("j", LeaveRequest(v=1, node_id="b", reason="stopped"), T + 20)
    completed = [e for e in rz.jobs["j"].events if e.kind == K.ROUND_COMPLETED]
    assert completed[-1].data["promoted"] == 1 and "promoted" not in completed[0].data
    for node in ("a", "spare"):
        rz.report_success("j", SuccessReport(v=1, node_id=node, round_id=2), T + 30)
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
    rz.leave(HOSTILE, LeaveRequest(v=1, node_id="a", reason=HOSTILE), T + 20)
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
