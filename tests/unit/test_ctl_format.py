"""rdzv-ctl's tables from the server's real documents (views.py on a hand-built core): counts, not
list lengths, and a line saying how to see what a cut list left out."""
from __future__ import annotations

from rdzv_ctl import cli as ctl
from rdzv_server.web import views
from tests.unit.test_views import NOW, server


def test_status_counts_every_node_and_says_where_the_next_page_is():
    rz = server(120, nodes=300, spares=12)
    text = ctl.format_status(views.server_status(rz, NOW, 0, 50))
    header, first, *rest = text.splitlines()
    assert header.split()[:5] == ["JOB", "STATE", "ROUND", "WORLD", "NODES"]
    assert first.split()[:8] == ["big", "running", "1", "600", "300", "(300:300)", "0/0", "12"], first
    assert len(rest) == 50 and rest[-1] == "jobs 1-50 of 121; next page: rdzv-ctl status --offset 50"
    last = ctl.format_status(views.server_status(rz, NOW, 100, 50)).splitlines()
    assert len(last) == 1 + 21 + 1 and last[-1] == "jobs 101-121 of 121"
    beyond = ctl.format_status(views.server_status(rz, NOW, 500, 50))
    assert beyond == "no jobs from offset 500 (the server holds 121 jobs)"
    whole = ctl.format_status(views.server_status(server(3), NOW))
    assert len(whole.splitlines()) == 4 and "of 3" not in whole


def test_job_says_how_many_nodes_each_cut_list_left_out():
    rz = server(0, nodes=300, spares=12)
    text = ctl.format_job(views.job_detail(rz.jobs["big"], NOW, 0, 10))
    lines = text.splitlines()
    ranks = [line.split()[0] for line in lines if line[:1].isdigit()]
    assert ranks == [str(r) for r in range(10)]
    assert "... 290 more members (rdzv-ctl job big --node-offset 10)" in lines
    assert "... 2 more spares (rdzv-ctl job big --node-offset 10)" in lines
    later = ctl.format_job(views.job_detail(rz.jobs["big"], NOW, 295, 10)).splitlines()
    assert [line.split()[0] for line in later if line[:1].isdigit()] == ["295", "296", "297", "298", "299"]
    assert "(no spares from 295: 12 in all)" in later and not [x for x in later if x.startswith("...")]
    small = ctl.format_job(views.job_detail(server(0, nodes=3).jobs["big"], NOW))
    assert "more" not in small and "no spares" not in small
