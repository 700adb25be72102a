"""The status views stay bounded whatever the server holds: pages of jobs, capped and paged node lists,
counts that always tell the whole truth. Built on the rendezvous core directly (plain float times).

Sizes, not times, are asserted (times live in benchmarks/bench_views.py): a view of a server with
many more jobs, or of a job with many more nodes, has the same number of rows and about the same
number of bytes.
"""
from __future__ import annotations

import json
import re

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from protocol.messages import JobConfig, JoinRequest, LeaveRequest, SuccessReport
from protocol.views import JobDetail, ProgressView, RestartCostView, to_json
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.goodput import JobProgress
from rdzv_server.core.records import JobRecord
from rdzv_server.core.rendezvous import Limits, Rendezvous
from rdzv_server.web import views as typed_views
from rdzv_server.web.app import create_app
from rdzv_server.web.page import cards as page_cards
from rdzv_server.web.page import render as page
from tests.unit import progress_jobs

T = 1_700_000_000.0


class _Documents:
    """rdzv_server.web.views, its views read back as the JSON documents the API sends."""

    def __getattr__(self, name: str) -> object:
        attr = getattr(typed_views, name)
        if name in ("server_status", "job_detail", "job_summary", "job_events"):
            return lambda *args, **kwargs: json.loads(to_json(attr(*args, **kwargs)))
        return attr


views = _Documents()


def join(rz: Rendezvous, job: str, node: str, now: float, config: JobConfig, lws: int = 1) -> None:
    rz.handle(job, JoinRequest(v=1, node_id=node, addr="10.0.0.1", host=f"host-{node}", local_world_size=lws,
                             master_port=29500, config=config, instance=f"{node}#1"), now)


def server(finished: int, nodes: int = 0, spares: int = 0) -> Rendezvous:
    """`finished` one-node jobs that succeeded one after another (done-00000 first), and, with `nodes`,
    a running job `big` of that many members plus `spares` spares."""
    rz = Rendezvous(limits=Limits(max_jobs=finished + 10))
    one = JobConfig(min_nodes=1, max_nodes=1)
    for i in range(finished):
        job = f"done-{i:05d}"
        join(rz, job, "n", T + i, one)
        rz.handle(job, SuccessReport(v=1, node_id="n", round_id=rz.jobs[job].round.round_id), T + i)
    if nodes:
        big = JobConfig(min_nodes=nodes, max_nodes=nodes, lease_timeout_s=10_000.0)
        for i in range(nodes + spares):
            join(rz, "big", f"node-{i:05d}", T + finished + i * 0.001, big, lws=2)
        assert rz.jobs["big"].round is not None and len(rz.jobs["big"].spares) == spares
    return rz


NOW = T + 2000          # before any finished job is due for pruning (1 h)


def rows(html: str, attr: str) -> list[str]:
    return re.findall(rf'<tr {attr}="([^"]*)"', html)


# ---- /v1/status -----------------------------------------------------------------------------------

def test_status_is_one_page_of_jobs_whatever_the_server_holds():
    few, many = server(2 * views.STATUS_LIMIT), server(8 * views.STATUS_LIMIT)
    small, large = views.server_status(few, NOW), views.server_status(many, NOW)
    assert len(small["jobs"]) == len(large["jobs"]) == views.STATUS_LIMIT
    assert (small["total"], large["total"]) == (2 * views.STATUS_LIMIT, 8 * views.STATUS_LIMIT)
    assert large["job_states"] == {"succeeded": 8 * views.STATUS_LIMIT}
    assert (large["offset"], large["limit"], large["next_offset"]) == (0, views.STATUS_LIMIT, views.STATUS_LIMIT)
    size_small, size_large = len(json.dumps(small)), len(json.dumps(large))
    assert size_large < size_small * 1.02, (size_small, size_large)


def test_status_orders_unfinished_jobs_first_then_finished_newest_first_and_pages_cover_every_job():
    rz = server(30)
    join(rz, "forming", "w", T + 100, JobConfig(min_nodes=2, max_nodes=2))
    join(rz, "a-running", "r", T + 100, JobConfig(min_nodes=1, max_nodes=1))
    seen: list[str] = []
    offset: int | None = 0
    while offset is not None:
        doc = views.server_status(rz, NOW, offset, 7)
        assert len(doc["jobs"]) <= 7 and doc["total"] == 32
        seen += [j["job_id"] for j in doc["jobs"]]
        offset = doc["next_offset"]
    assert seen == ["forming", "a-running"] + [f"done-{i:05d}" for i in range(29, -1, -1)]
    assert views.server_status(rz, NOW, 40, 7)["jobs"] == []


def test_status_caps_each_node_list_and_counts_every_node():
    rz = server(0, nodes=300, spares=40)
    (job,) = views.server_status(rz, NOW)["jobs"]
    assert job["counts"] == {"nodes": 300, "waiting": 0, "spares": 40, "excluded": 0, "drained": 0}
    assert len(job["nodes"]) == len(job["spares"]) == views.LIST_LIMIT and job["lists_cut"] is True
    assert [n["group_rank"] for n in job["nodes"]] == list(range(views.LIST_LIMIT))
    assert [s["spare_position"] for s in job["spares"]] == list(range(views.LIST_LIMIT))
    bigger = views.server_status(server(0, nodes=1200, spares=40), NOW)
    assert len(json.dumps(bigger)) < len(json.dumps(views.server_status(rz, NOW))) * 1.02
    small = views.server_status(server(3), NOW)["jobs"][0]
    assert small["lists_cut"] is False and small["counts"]["nodes"] == len(small["nodes"]) == 1


# ---- /v1/jobs/{id} and its events -----------------------------------------------------------------

def test_job_detail_pages_its_node_lists():
    rz = server(0, nodes=1000, spares=30)
    job = rz.jobs["big"]
    first = views.job_detail(job, NOW, 0, 400)
    assert (first["counts"]["nodes"], len(first["nodes"]), first["lists_cut"]) == (1000, 400, True)
    assert (first["node_offset"], first["node_limit"]) == (0, 400)
    members: list[str] = []
    spares: list[dict] = []
    for offset in range(0, 1000, 400):
        doc = views.job_detail(job, NOW, offset, 400)
        members += [n["node_id"] for n in doc["nodes"]]
        spares += doc["spares"]
    assert members == job.round.members
    assert [s["spare_position"] for s in spares] == list(range(30)) and [s["node_id"] for s in spares] == job.spares
    default = views.job_detail(job, NOW)
    assert len(default["nodes"]) == views.NODE_LIMIT and default["config"]["max_nodes"] == 1000
    assert views.job_detail(job, NOW, 0, 2000)["lists_cut"] is False


def test_events_after_a_seq_and_limited():
    rz = server(0, nodes=50)
    job = rz.jobs["big"]
    whole = views.job_events(job)
    assert whole["last_seq"] == job.event_seq and [e["seq"] for e in whole["events"]] == [e.seq for e in job.events]
    newest = views.job_events(job, limit=5)
    assert [e["seq"] for e in newest["events"]] == list(range(job.event_seq - 4, job.event_seq + 1))
    page1 = views.job_events(job, after=10, limit=5)
    assert [e["seq"] for e in page1["events"]] == [11, 12, 13, 14, 15] and page1["more"] is True
    tail = views.job_events(job, after=job.event_seq - 2, limit=5)
    assert [e["seq"] for e in tail["events"]] == [job.event_seq - 1, job.event_seq] and tail["more"] is False


# ---- the HTML page ---------------------------------------------------------------------------------

def test_overview_has_one_page_of_rows_and_a_few_cards_whatever_the_number_of_jobs():
    few, many = server(2 * page.INDEX_JOBS), server(10 * page.INDEX_JOBS)
    small, large = page.index_page(few, NOW), page.index_page(many, NOW)
    for html in (small, large):
        assert len(rows(html, "data-job")) == page.INDEX_JOBS
        assert html.count("<section ") == page.INDEX_CARDS
    assert f"{10 * page.INDEX_JOBS:,} jobs" in large and f"jobs 1&ndash;{page.INDEX_JOBS} of" in large
    assert len(large) < len(small) * 1.02, (len(small), len(large))
    later = page.index_page(many, NOW, offset=3 * page.INDEX_JOBS)
    assert rows(later, "data-job")[0] == f"done-{10 * page.INDEX_JOBS - 1 - 3 * page.INDEX_JOBS:05d}"
    assert f'href="/?offset={2 * page.INDEX_JOBS}"' in later and f'href="/?offset={4 * page.INDEX_JOBS}"' in later


def test_a_huge_job_has_a_capped_card_and_a_paged_page():
    rz, bigger = server(3, nodes=600, spares=20), server(3, nodes=1800, spares=20)
    overview = page.index_page(rz, NOW)
    card = overview[overview.index('<section class="job'):overview.index("</section>")]
    assert len(rows(card, "data-node")) == page.CARD_NODES
    assert f"{600 - page.CARD_NODES} more &mdash; see" in card and 'href="/jobs/big"' in card
    assert len(page.index_page(bigger, NOW)) < len(overview) * 1.02

    html = page.job_page(rz, "big", NOW) or ""
    assert len(rows(html, "data-node")) == page.JOB_NODES and "nodes (per list) 1&ndash;100 of 600" in html
    assert 'href="/jobs/big?node_offset=100"' in html
    assert len(page.job_page(bigger, "big", NOW) or "") < len(html) * 1.02
    later = page.job_page(rz, "big", NOW, node_offset=550, node_limit=100) or ""
    assert rows(later, "data-node") == [f"node-{i:05d}" for i in range(550, 600)]
    assert "none on this page (20 in all)" in later          # the spares list is shorter than the offset
    assert 'href="/jobs/big?node_offset=450"' in later and 'rel="next"' not in later


def test_not_found_page_names_a_few_jobs_only():
    html = page.not_found_page(server(100), "nope", NOW)
    assert html.count("<li><a ") == page.NOT_FOUND_JOBS and "and 80 more on" in html


def test_event_tables_are_bounded():
    rz = server(0, nodes=1500)
    html = page.job_page(rz, "big", NOW) or ""
    assert html.count('class="event') == page_cards.DETAIL_EVENTS


# ---- over HTTP --------------------------------------------------------------------------------------

async def test_query_parameters_are_checked_and_capped():
    rz = server(300, nodes=100)
    client = TestClient(TestServer(create_app(Coordinator(rz, clock=lambda: NOW)), host="127.0.0.1"))
    await client.start_server()
    try:
        for path, name in (("/v1/status?limit=0", "limit"), ("/v1/status?offset=-1", "offset"),
                           ("/v1/jobs/big?node_limit=x", "node_limit"), ("/v1/jobs/big/events?after=no", "after")):
            resp = await client.get(path)
            body = await resp.json()
            assert resp.status == 400 and body["code"] == "bad_request" and repr(name) in body["message"], body
        doc = await (await client.get("/v1/status?limit=100000&offset=10")).json()
        assert doc["limit"] == views.STATUS_LIMIT_MAX and len(doc["jobs"]) == views.STATUS_LIMIT_MAX
        assert doc["offset"] == 10 and doc["total"] == 301
        detail = await (await client.get("/v1/jobs/big?node_offset=90&node_limit=20")).json()
        assert [n["group_rank"] for n in detail["nodes"]] == list(range(90, 100))
        events = await (await client.get("/v1/jobs/big/events?after=3&limit=2")).json()
        assert [e["seq"] for e in events["events"]] == [4, 5] and events["more"] is True
        for path in ("/?offset=x&limit=-3", "/jobs/big?node_offset=-1&node_limit=zz"):  # pages fall back
            resp = await client.get(path)
            assert resp.status == 200 and resp.content_type == "text/html", path
        html = await (await client.get("/?limit=7&offset=14&refresh=0")).text()
        assert len(rows(html, "data-job")) == 7 and 'href="/?offset=21&amp;limit=7&amp;refresh=0"' in html
    finally:
        await client.close()


# ---- training progress (core/goodput.py, filled by the core from the agents' notes) ---------------

def test_a_job_that_crashed_and_stepped_again_has_its_ratio_cost_and_pace():
    rz = Rendezvous()
    progress_jobs.stepping(rz)
    now = progress_jobs.T + 200
    p = typed_views.progress(rz.jobs["train"], now)
    # first step T+10, last step before the crash T+100, first after it T+131: one restart of 31 s
    assert p.signal and p.steps == 200 and p.steps_per_s == progress_jobs.RATE
    assert p.ettr == pytest.approx((190 - 31) / 190, abs=1e-4)
    assert (p.lost_s, p.restarts, p.redone, p.restarting_for_s) == (31.0, 1, 30, None)
    assert p.costs == [RestartCostView(round_id=2, cause="failure", cost_s=31.0, redone=30,
                                       anatomy=progress_jobs.ANATOMY, anatomy_node="b")]
    assert (p.first_step_at, p.last_step_at) == ("2023-11-14T22:13:30.000Z", "2023-11-14T22:15:40.000Z")
    detail = views.job_detail(rz.jobs["train"], now)          # the JSON document: both views carry it
    assert detail["progress"]["ettr"] == p.ettr and detail["progress"]["costs"][0]["cost_s"] == 31.0
    assert views.server_status(rz, now)["jobs"][0]["progress"] == detail["progress"]
    assert [(n["node_id"], n["slow"], n["steps_per_s"]) for n in detail["nodes"]] == [("a", False, 2.0),
                                                                                      ("b", False, 2.0)]
    assert detail["rate"] and all(v == 2.0 for _, v in detail["rate"])
    assert detail["rate"][-1][0] == "2023-11-14T22:15:40.000Z"
    assert "slow" not in detail["spares"] and all("slow" not in n for n in views.server_status(
        server(0, nodes=3, spares=1), NOW)["jobs"][0]["spares"])     # only members carry a pace


def test_a_restart_under_way_counts_as_lost_until_the_job_steps_again_and_stops_when_it_ends():
    rz = Rendezvous()
    progress_jobs.restarting(rz)                              # last step T+50, crash at T+60
    job = rz.jobs["again"]
    p = typed_views.progress(job, progress_jobs.T + 200)
    assert p.restarting_for_s == 150.0 and p.lost_s == 0.0 and p.restarts == 0
    assert p.ettr == pytest.approx((190 - 150) / 190, abs=1e-4)
    assert p.costs == [RestartCostView(round_id=2, cause="failure", cost_s=None, redone=None)]
    assert p.steps_per_s == 0.0                               # the new round has not stepped
    rz.close_job("again", "enough", progress_jobs.T + 210)
    ended = typed_views.progress(job, progress_jobs.T + 300)
    assert ended.restarting_for_s is None and ended.ettr == 1.0     # up to its last step: nothing was lost by then
    assert ended.costs[0].cost_s is None and ended.signal


def test_a_job_waiting_for_nodes_has_no_pace():
    rz = Rendezvous()
    progress_jobs.restarting(rz)                              # stepped at 2/s, then a crash: a new round formed
    job = rz.jobs["again"]
    progress_jobs.step(rz, "again", ["a", "b"], progress_jobs.T + 70, progress_jobs.T + 80, 20, progress_jobs.T + 80)
    assert typed_views.progress(job, progress_jobs.T + 90).steps_per_s == progress_jobs.RATE
    rz.handle("again", LeaveRequest(v=1, node_id="b", credential="secret-b", reason="bye"), progress_jobs.T + 90)
    assert job.round is None and job.progress.pending is not None  # the wait is a restart under way ...
    waiting = typed_views.progress(job, progress_jobs.T + 100)
    assert waiting.steps_per_s == 0.0 and waiting.restarting_for_s == 20.0   # ... no round runs: no pace


def test_a_job_that_never_stepped_has_no_progress_signal():
    rz = Rendezvous()
    progress_jobs.silent(rz)
    p = typed_views.progress(rz.jobs["quiet"], progress_jobs.T + 100)
    assert p == ProgressView() and not p.signal and p.ettr is None
    doc = views.job_detail(rz.jobs["quiet"], progress_jobs.T + 100)
    assert doc["progress"]["signal"] is False and doc["progress"]["ettr"] is None and doc["rate"] == []
    assert [("steps_per_s" in n, n["slow"]) for n in doc["nodes"]] == [(False, False), (False, False)]


def test_slow_nodes_are_the_current_members_named_slow():
    rz = Rendezvous()
    progress_jobs.slow(rz)
    job = rz.jobs["lagging"]
    job.progress.slow.append("gone-node")                     # no longer a member: not listed
    now = progress_jobs.T + 100
    assert typed_views.progress(job, now).slow_nodes == ["b"]
    assert {n["node_id"]: n["slow"] for n in views.job_detail(job, now)["nodes"]} == {"a": False, "b": True}
    rz.close_job("lagging", "done", now)
    assert typed_views.progress(job, now).slow_nodes == []    # an ended job has no pace


def test_a_rank_alone_is_shown_while_it_lasts_and_gone_once_the_job_steps_again():
    rz = Rendezvous()
    progress_jobs.alone(rz)
    job, now = rz.jobs["evaluating"], progress_jobs.T + 70
    p = typed_views.progress(job, now)
    assert p.stall == "rank 0 alone for 20s at train.py:41 in evaluate; ranks 1-3 waiting in all_reduce"
    assert p.stall_kind == "alone" and job.restart_count == 0
    assert views.job_detail(job, now)["progress"]["stall"] == p.stall
    progress_jobs.step(rz, "evaluating", ["a", "b"], progress_jobs.T + 10, now, 81, now)   # it steps again
    assert typed_views.progress(job, now).stall is None


def test_bad_or_missing_progress_never_breaks_a_view():
    rz = Rendezvous()
    progress_jobs.stepping(rz)
    job = rz.jobs["train"]
    old = msgspec.json.decode(msgspec.json.encode(job), type=JobRecord)
    old.progress = msgspec.json.decode(b"{}", type=JobProgress)         # as a store from before progress holds it
    assert typed_views.progress(old, NOW) == ProgressView()
    p = job.progress
    p.last_step_at, p.lost_s = 1e300, float("nan")
    p.rates["a"], p.rate_points = float("inf"), [(float("nan"), 1.0), (1e300, 2.0), (T, float("inf")), (T, 3.0)]
    view = typed_views.progress(job, NOW)
    assert view.last_step_at is None and view.lost_s == 0.0 and view.signal
    assert typed_views.rate_points(p) == [("2023-11-14T22:13:20.000Z", 3.0)]
    detail = typed_views.job_detail(job, NOW)
    assert {n.node_id: n.steps_per_s for n in detail.nodes} == {"a": None, "b": 2.0}
    assert page.job_page(rz, "train", NOW) and page.index_page(rz, NOW)


def test_an_older_servers_documents_still_read_as_views():
    """rdzv-ctl reads a server without progress: its documents lack the new fields, which then say "no signal"."""
    doc = views.job_detail(server(0, nodes=2).jobs["big"], NOW)
    for key in ("progress", "rate"):
        del doc[key]
    for n in doc["nodes"]:
        n.pop("slow", None)
        n.pop("steps_per_s", None)
    typed = msgspec.convert(doc, JobDetail)
    assert typed.progress == ProgressView() and typed.rate == [] and typed.nodes[0].slow is None
