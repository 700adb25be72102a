"""The status page rendered from a hand-built rendezvous core: time is plain floats, no server.

Markup is parsed with html.parser, so "escaped" means: the browser sees the hostile text as text,
and no element came out of it.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from aiohttp.test_utils import TestClient, TestServer

from protocol.messages import (
    FailureReport,
    JobConfig,
    JoinRequest,
    NodeState,
    PollRequest,
    SuccessReport,
    WorkerFailure,
)
from protocol.notes import CopiesNote
from rdzv_ctl import tables as ctl
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.events import EventKind
from rdzv_server.core.goodput import MAX_COSTS
from rdzv_server.core.records import Event, NodeRecord
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival
from rdzv_server.web import views
from rdzv_server.web.app import create_app
from rdzv_server.web.page import cards as page_cards
from rdzv_server.web.page import parts as page_parts
from rdzv_server.web.page import render as page
from tests.unit import progress_jobs
from tests.unit.test_copies_rounds import CFG, JOB, started

T = 1_700_000_000.0          # 2023-11-14T22:13:20Z
HOSTILE = "<script>alert(1)</script>"


class Markup(HTMLParser):
    """Start tags with their attributes, and the text a reader sees (whitespace collapsed)."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self._text: list[str] = []
        self._skip = 0
        self.feed(text)
        self.close()
        self.text = " ".join(" ".join(self._text).split())

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))
        self._skip += tag in ("style", "title")

    def handle_endtag(self, tag):
        self._skip -= tag in ("style", "title")

    def handle_data(self, data):
        if not self._skip:
            self._text.append(data)

    def attr(self, name: str) -> list[str]:
        return [a[name] for _, a in self.tags if name in a]


def cfg(**kw) -> JobConfig:
    return JobConfig(**{"min_nodes": 2, "max_nodes": 2, "max_restarts": 3, "lease_timeout_s": 10_000.0, **kw})


def join(rz: Rendezvous, job: str, node: str, now: float, config: JobConfig, host: str = "", lws: int = 1):
    return rz.handle(job, JoinRequest(v=1, node_id=node, addr=f"10.0.0.{len(node)}", host=host or f"host-{node}",
                                    local_world_size=lws, master_port=29500, config=config,
                                    instance=f"{node}#1"), now)


def fail(rz: Rendezvous, job: str, node: str, now: float, message: str = "", exitcode: int = 1):
    round_id = rz.jobs[job].round.round_id
    failure = WorkerFailure(local_rank=0, rank=0, exitcode=exitcode, message=message)
    return rz.handle(job, FailureReport(v=1, node_id=node, round_id=round_id, failures=[failure]), now)


def running(rz: Rendezvous, job: str, nodes: list[str], config: JobConfig, t: float = T, **kw) -> None:
    for i, n in enumerate(nodes):
        join(rz, job, n, t + i, config, **kw)
    deadline = rz.next_deadline()
    if rz.jobs[job].round is None and deadline is not None:
        rz.tick(deadline)
    assert rz.jobs[job].round is not None


def health_of(markup: Markup) -> dict[str, str]:
    return {a["data-job"]: a["data-health"] for _, a in markup.tags if "data-health" in a}


# ---- the overview -------------------------------------------------------------------------------

def test_every_job_has_its_state_and_health_colour():
    rz = Rendezvous()
    running(rz, "ok", ["a", "b"], cfg())
    join(rz, "waits", "w", T, cfg(min_nodes=3, max_nodes=3))
    running(rz, "dies", ["d"], cfg(min_nodes=1, max_nodes=1, max_restarts=0))
    fail(rz, "dies", "d", T + 5)
    running(rz, "done", ["s"], cfg(min_nodes=1, max_nodes=1))
    rz.handle("done", SuccessReport(v=1, node_id="s", round_id=rz.jobs["done"].round.round_id), T + 6)
    running(rz, "shut", ["c"], cfg(min_nodes=1, max_nodes=1))
    rz.close_job("shut", "maintenance", T + 7)
    running(rz, "short", ["x", "y"], cfg(max_nodes=3, last_call_s=1.0))   # 2 of max 3
    running(rz, "tired", ["p", "q"], cfg())
    fail(rz, "tired", "p", T + 8)
    fail(rz, "tired", "p", T + 9)                                              # 2 of 3 restarts used

    m = Markup(page.index_page(rz, T + 60))

    assert health_of(m) == {"ok": "green", "waits": "amber", "dies": "red", "done": "blue", "shut": "grey",
                            "short": "orange", "tired": "orange"}
    assert "1 node short of max 3" in m.text and "restarts 2/3 used" in m.text
    assert "7 jobs" in m.text
    for state in ("running", "waiting", "failed", "succeeded", "closed"):
        assert ("span", {"class": f"badge s-{state}"}) in m.tags, state
    # unfinished jobs first (forming before running), then finished ones, newest first
    order = [a["data-job"] for t, a in m.tags if t == "tr" and "data-job" in a]
    assert order == ["waits", "ok", "short", "tired", "shut", "done", "dies"], order
    # cards for the first few jobs of the page only
    cards = [a["data-job"] for t, a in m.tags if t == "section"]
    assert cards == order[:page.INDEX_CARDS], cards


def test_overview_shows_round_world_restarts_members_and_recent_events():
    rz = Rendezvous()
    running(rz, "job-1", ["alpha", "bravo"], cfg(), lws=4)
    fail(rz, "job-1", "bravo", T + 30, message="CUDA error: out of memory")
    m = Markup(page.index_page(rz, T + 90))

    job = views.job_detail(rz.jobs["job-1"], T + 90)
    assert job.round_id == 2 and job.world_size == 8
    assert "round #2 world size 8" in m.text and "restarts 1 / 3" in m.text, m.text
    assert sorted(m.attr("data-node")) == ["alpha", "bravo"]
    # group rank, node, host / addr, local world, ranks, lease age, worker state, recent failures
    assert "0 alpha host-alpha 10.0.0.5 4 0–3 1m 30s running 0" in m.text, m.text
    assert "1 bravo host-bravo 10.0.0.5 4 4–7 1m 00s running 1" in m.text, m.text
    # the failure is in the recent events, highlighted, with its UTC time and age
    seq = next(e.seq for e in rz.jobs["job-1"].events if e.kind == "worker_failed")
    assert ("tr", {"class": "event ev-bad", "data-kind": "worker_failed", "data-seq": str(seq)}) in m.tags
    assert "CUDA error: out of memory" in m.text
    assert "2023-11-14T22:13:50.000Z (1m 00s ago)" in m.text
    # only the last few events on the overview, newest first
    seqs = [int(s) for s in m.attr("data-seq")]
    assert seqs == sorted(seqs, reverse=True) and len(seqs) == page_cards.INDEX_EVENTS
    assert seqs[0] == rz.jobs["job-1"].events[-1].seq
    assert "/jobs/job-1" in m.attr("href")


def test_spares_and_excluded_nodes_with_time_left():
    rz = Rendezvous()
    config = cfg(max_nodes=2, exclude_after=1, exclude_cooldown_s=60.0, max_restarts=5)
    running(rz, "j", ["a", "b"], config)
    join(rz, "j", "c", T + 5, config)                     # job at max: spare #1
    fail(rz, "j", "b", T + 10)                            # b excluded for 60 s; spare c promoted
    m = Markup(page.index_page(rz, T + 25))
    assert rz.jobs["j"].nodes["b"].state == NodeState.EXCLUDED
    assert "time left exclusions b host-b 10.0.0.1 45s 1" in m.text, m.text
    join(rz, "j", "d", T + 26, config)
    m = Markup(page.index_page(rz, T + 27))
    assert "lease age ready #1 d host-d 10.0.0.1 1 1.0s yes" in m.text, m.text
    rz.handle("j", JoinRequest(v=1, node_id="e", addr="10.0.0.1", host="host-e", local_world_size=1,
                             master_port=29500, config=config, instance="e#1", ready=False), T + 27,
                                 Arrival(secret="secret-e"))
    m = Markup(page.index_page(rz, T + 30))
    assert "#2 e host-e 10.0.0.1 1 3.0s preparing 3.0s" in m.text, m.text      # its interpreter still imports
    assert ("span", {"class": "warn-text", "data-preparing": "1"}) in m.tags


def test_no_jobs_yet():
    m = Markup(page.index_page(Rendezvous(), T))
    assert "0 jobs" in m.text and "No jobs yet" in m.text
    assert ("meta", {"http-equiv": "refresh", "content": "2"}) in m.tags
    assert "2023-11-14T22:13:20.000Z" in m.text          # server time in the header


def test_refresh_can_be_paused_and_is_bounded():
    assert [page.refresh_seconds(v) for v in (None, "0", "5", "-3", "99999", "soon")] == [2, 0, 5, 0, 3600, 2]
    m = Markup(page.index_page(Rendezvous(), T, refresh=0))
    assert not [a for t, a in m.tags if t == "meta" and a.get("http-equiv") == "refresh"]
    assert "auto-refresh paused" in m.text


# ---- escaping -----------------------------------------------------------------------------------

def test_client_strings_are_escaped_everywhere():
    rz = Rendezvous()
    running(rz, "j", ["a", "b"], cfg(min_nodes=1, max_nodes=3), host=HOSTILE)
    fail(rz, "j", "a", T + 3, message='<img src=x onerror="alert(2)">')
    # a node id the protocol would refuse today, as an older store might hold it
    job = rz.jobs["j"]
    job.nodes["<script>"] = NodeRecord(node_id="<script>", instance="i", addr="<b>addr</b>", host=HOSTILE,
                                       role="default", local_world_size=1, master_port=1, state=NodeState.SPARE,
                                       joined_at=T, last_seen=T, lease_expires=T + 100)
    job.spares.append("<script>")
    job.drained["<script>drained"] = '<img src=y onerror="alert(4)">'
    job.record(Event(t=T + 4, seq=0, kind=EventKind.NODE_LEFT, message="</td></tr></table><script>x()</script>",
                     node_id="<script>", data={"k<i>": "v<i>"}))

    for text in (page.index_page(rz, T + 5), page.job_page(rz, "j", T + 5),
                 page.not_found_page(rz, "<script>alert(3)</script>", T + 5)):
        assert text is not None
        m = Markup(text)
        assert not {t for t, _ in m.tags} & {"script", "img"}, m.tags
        for raw in ("<script", "<img", "<b>addr", "<i>"):
            assert raw not in text, raw
    m = Markup(page.job_page(rz, "j", T + 5) or "")
    assert HOSTILE in m.text and '<img src=x onerror="alert(2)">' in m.text
    assert "</td></tr></table><script>x()</script>" in m.text and "k<i> v<i>" in m.text
    assert f"#1 <script> {HOSTILE} <b>addr</b>" in m.text, m.text
    assert '<script>drained <img src=y onerror="alert(4)">' in m.text, m.text
    assert "No job <script>alert(3)</script> on this server" in Markup(
        page.not_found_page(rz, "<script>alert(3)</script>", T)).text


def test_a_failure_message_with_terminal_controls_shows_them_as_escapes():
    """A review: a worker's failure message reached the page with its ESC and BEL bytes raw (the log showed them
    escaped); an operator's `curl` of the page to a terminal took them for its own. Line breaks stay."""
    rz = Rendezvous()
    running(rz, "j", ["a", "b"], cfg(min_nodes=1, max_nodes=3))
    fail(rz, "j", "a", T + 3, message="boom\x1b[2J\x1b]0;title\x07\nnext line\u202e")
    text = page.job_page(rz, "j", T + 5) or ""
    assert not any(c in text for c in "\x1b\x07\u202e"), [c for c in text if ord(c) < 32 and c not in "\n\t"]
    assert "boom\\x1b[2J" in text and "\\x07" in text


# ---- one job ------------------------------------------------------------------------------------

def test_job_page_has_config_failures_and_the_newest_events_first():
    rz = Rendezvous()
    running(rz, "j", ["a", "b"], cfg(max_restarts=7))
    fail(rz, "j", "b", T + 10, message="boom", exitcode=-9)
    for i in range(250):
        rz.jobs["j"].record(Event(t=T + 20 + i, seq=0, kind=EventKind.NODE_LEFT, message=f"note {i}"))
    m = Markup(page.job_page(rz, "j", T + 300) or "")

    assert "max_restarts 7" in m.text and "lease_timeout_s 10000.0" in m.text
    assert "Last failure (the root cause)" in m.text and "exitcode -9" in m.text and "message boom" in m.text
    seqs = [int(s) for s in m.attr("data-seq")]
    last = rz.jobs["j"].events[-1].seq
    assert seqs == list(range(last, last - page_cards.DETAIL_EVENTS, -1))
    assert sorted(m.attr("data-node")) == ["a", "b"]
    assert page.job_page(rz, "missing", T) is None


def test_not_found_page_names_the_id_and_lists_known_jobs():
    rz = Rendezvous()
    running(rz, "real-job", ["a", "b"], cfg())
    m = Markup(page.not_found_page(rz, "nope", T))
    assert "No job nope on this server" in m.text and "real-job" in m.text
    assert "/jobs/real-job" in m.attr("href")


# ---- over HTTP ----------------------------------------------------------------------------------

async def test_app_serves_the_pages_as_html_and_unknown_jobs_as_a_404_page():
    rz = Rendezvous()
    running(rz, "j", ["a", "b"], cfg())
    client = TestClient(TestServer(create_app(Coordinator(rz, clock=lambda: T + 1)), host="127.0.0.1"))
    await client.start_server()
    try:
        for path in ("/", "/?refresh=0", "/jobs/j"):
            resp = await client.get(path)
            assert resp.status == 200 and resp.content_type == "text/html", path
            assert "a" in Markup(await resp.text()).attr("data-node")
        resp = await client.get("/jobs/%3Cb%3Eghost")
        body = await resp.text()
        assert resp.status == 404 and resp.content_type == "text/html"
        assert "No job <b>ghost on this server" in Markup(body).text and "<b>ghost" not in body
        resp = await client.get("/v1/jobs/j")                  # the JSON API still answers as before
        assert resp.status == 200 and (await resp.json())["job_id"] == "j"
    finally:
        await client.close()


@pytest.mark.parametrize("seconds,text", [(0.04, "0.0s"), (9.4, "9.4s"), (42, "42s"), (245, "4m 05s"),
                                          (7380, "2h 03m"), (273_605, "3d 4h")])
def test_ages_read_at_a_glance(seconds, text):
    assert page_parts.age(seconds) == text


# ---- training progress --------------------------------------------------------------------------

def goodput_text(html: str, job: str) -> str:
    """What a reader sees of one job's goodput line (the card's second row of stats)."""
    section = next(s for s in html.split("<section ")[1:] if f'data-job="{job}"' in s.split(">", 1)[0])
    found = re.search(r'<div class="stats goodput".*?(?=<p |<svg|<h3)', section)
    assert found, section[:2000]
    return Markup(found.group(0)).text


def test_the_card_shows_pace_ratio_time_lost_and_steps_redone():
    rz = Rendezvous()
    progress_jobs.stepping(rz)
    html = page.index_page(rz, T + 200)
    text = goodput_text(html, "train")
    assert text == ("steps/s 2 steps 200 effective training 83.7% lost to restarts 31s in 1 restart "
                    "steps redone 30"), text
    m = Markup(html)
    row = next(a for t, a in m.tags if t == "tr" and a.get("data-job") == "train")
    assert row and "2 83.7% work_redone" in m.text        # steps/s, ratio, the last event: the steps redone
    assert "no progress signal" not in m.text
    job = Markup(page.job_page(rz, "train", T + 200) or "")
    assert ("#2 failure (restart) 31s 30 31.00 s: stop 0.50 · rendezvous 20.00 · start 0.50 · set-up 5.00 · "
            "process group 2.00 · restore 1.50 · first step 1.50 (rank 3) on b") in job.text, job.text


def test_a_restart_under_way_says_how_long_it_has_lost_so_far():
    rz = Rendezvous()
    progress_jobs.restarting(rz)
    html = page.index_page(rz, T + 200)
    assert "restarting 2m 30s lost so far" in goodput_text(html, "again")
    job = Markup(page.job_page(rz, "again", T + 200) or "")
    assert ("Restarts and what they cost round cause cost steps redone where the time went #2 failure (restart) "
            "under way —") in job.text
    rz.close_job("again", "enough", T + 210)
    ended = Markup(page.job_page(rz, "again", T + 300) or "")
    assert "#2 failure (restart) never stepped again" in ended.text and "lost so far" not in ended.text


def test_a_job_that_has_ended_shows_no_pace_not_zero_steps_per_second():
    rz = Rendezvous()
    progress_jobs.succeeded(rz)
    html = page.index_page(rz, T + 200)
    assert goodput_text(html, "done").startswith("steps/s — steps 40 "), goodput_text(html, "done")
    assert Markup(html).attr("title").count("the job has ended") == 2         # the card's and the summary's


def test_a_job_without_steps_says_no_progress_signal_never_zero_steps_per_second():
    rz = Rendezvous()
    progress_jobs.silent(rz)
    html = page.index_page(rz, T + 100)
    assert goodput_text(html, "quiet").startswith("no progress signal")
    m = Markup(html)
    assert goodput_text(html, "quiet") == "no progress signal: no worker has reported a training step"
    assert "0.0%" not in m.text
    assert m.attr("title").count("no progress signal") == 2       # the summary's steps/s and ratio cells
    assert "Restarts and what they cost" not in (page.job_page(rz, "quiet", T + 100) or "")


def test_a_slow_node_has_a_badge_on_its_row_and_is_named_on_the_card():
    rz = Rendezvous()
    progress_jobs.slow(rz)
    html = page.job_page(rz, "lagging", T + 100) or ""
    m = Markup(html)
    slow_rows = [a["data-node"] for t, a in m.tags if t == "tr" and a.get("data-slow") == "1"]
    assert slow_rows == ["b"]
    assert ("span", {"class": "badge s-slow"}) in m.tags and "1 b slow host-b" in m.text, m.text
    assert "0 a host-a" in m.text                                   # a keeps pace: no badge
    assert goodput_text(html, "lagging").endswith("slow nodes b")


def test_a_rank_alone_is_said_on_the_card():
    rz = Rendezvous()
    progress_jobs.alone(rz)
    html = page.job_page(rz, "evaluating", T + 70) or ""
    m = Markup(html)
    assert [a.get("data-stall") for t, a in m.tags if t == "div" and "data-stall" in a] == ["alone"]
    assert goodput_text(html, "evaluating").endswith(
        "not stepping rank 0 alone for 20s at train.py:41 in evaluate; ranks 1-3 waiting in all_reduce")


def test_the_restarts_table_says_when_it_shows_only_the_latest():
    rz = Rendezvous()
    config = cfg(max_restarts=100, last_call_s=0.0, exclude_after=1000)   # a keeps failing: never excluded
    progress_jobs.join(rz, "many", "a", T, config)
    progress_jobs.join(rz, "many", "b", T, config)
    restarts = MAX_COSTS + 2
    for i in range(restarts + 1):                 # each round steps for 10 s, then crashes; 5 s to step again
        t = T + 15 * i
        progress_jobs.step(rz, "many", ["a", "b"], t + 5, t + 14, 10, t + 14)
        if i < restarts:
            progress_jobs.crash(rz, "many", "a", t + 14.5)
    m = Markup(page.job_page(rz, "many", T + 15 * restarts + 20) or "")
    assert len(m.attr("data-cost-round")) == MAX_COSTS
    assert f"The last {MAX_COSTS} of {restarts} restarts; 3m 24s lost in all to those done." in m.text, m.text


def test_a_nodes_copies_show_their_lag_and_refusals_on_the_page_and_in_rdzv_ctl():
    rz = started({"a": "1", "b": "2"}, CFG)
    note = CopiesNote(local_step=30, copied_step=20, holder="10.0.0.2:4000", refused=3,
                      last_refusal="10.0.0.2:4000: refused: stale round 4 (holding copies of round 5)")
    rz.handle(JOB, PollRequest(v=1, node_id="a", credential="secret-a", copies=note), 1.0)
    html = page.job_page(rz, JOB, 1.0) or ""
    m = Markup(html)
    assert "30 · copy 20 (10 behind) on 10.0.0.2:4000 · 3 refused" in m.text, m.text
    assert any(a.get("title") == note.last_refusal for t, a in m.tags if t == "span")
    rows = ctl.format_job(views.job_detail(rz.jobs[JOB], 1.0)).splitlines()
    assert any(row.split()[:2] == ["0", "a"] and "30/20!3" in row.split() for row in rows), rows


def test_a_node_whose_round_makes_no_copies_shows_its_snapshot_without_a_warning():
    rz = started({"a": "1", "b": "2"}, CFG)
    note = CopiesNote(local_step=30, copying=False)
    rz.handle(JOB, PollRequest(v=1, node_id="a", credential="secret-a", copies=note), 1.0)
    m = Markup(page.job_page(rz, JOB, 1.0) or "")
    assert "30 · copies off" in m.text and "no copy" not in m.text, m.text
    rows = ctl.format_job(views.job_detail(rz.jobs[JOB], 1.0)).splitlines()
    assert any(row.split()[:2] == ["0", "a"] and "30/off" in row.split() for row in rows), rows
