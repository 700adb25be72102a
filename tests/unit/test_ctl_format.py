"""rdzv-ctl's tables from the server's real documents (views.py on a hand-built core): counts, not
list lengths, a line saying how to see what a cut list left out, and each job's training progress."""
from __future__ import annotations

import json

from protocol.messages import JobState
from protocol.views import StatusView, to_json
from rdzv_ctl import cli
from rdzv_ctl import tables as ctl
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.web import views
from tests.unit import progress_jobs
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


def test_status_shows_pace_and_ratio_per_job_and_names_slow_nodes():
    rz = Rendezvous()
    progress_jobs.stepping(rz)
    progress_jobs.silent(rz)
    progress_jobs.slow(rz)
    text = ctl.format_status(cli.typed(json.loads(to_json(views.server_status(rz, progress_jobs.T + 200))),
                                       StatusView))
    header, *rows = text.splitlines()
    assert header.split()[8:] == ["STEPS/S", "ETTR", "REASON"]
    cells = {row.split()[0]: row.split()[9:11] for row in rows if not row.startswith("slow")}   # NODES: 2 words
    # lagging: first step T+5, stepped ever since; quiet: never stepped (a dash, not 0); train: one 31 s restart
    assert cells == {"lagging": ["2", "100.0%"], "quiet": ["-", "-"], "train": ["2", "83.7%"]}, text
    assert rows[-1] == "slow nodes in job lagging: b"


def test_a_job_that_has_ended_shows_no_pace_not_zero_steps_per_s():
    rz = Rendezvous()
    progress_jobs.succeeded(rz)
    assert rz.jobs["done"].state == JobState.SUCCEEDED
    now = progress_jobs.T + 200
    header, row = ctl.format_status(cli.typed(json.loads(to_json(views.server_status(rz, now))),
                                              StatusView)).splitlines()
    assert row.split()[1] == "succeeded" and row.split()[9] == "-", row     # STEPS/S (NODES takes 2 words)
    lines = ctl.format_job(views.job_detail(rz.jobs["done"], now)).splitlines()
    assert [line for line in lines if line.startswith("progress")] == [
        "progress   40 steps, effective training time ratio 100.0% (first step 2023-11-14T22:13:21.000Z)"], lines


def test_ranks_not_stepping_are_said_in_the_status_and_the_job_view():
    rz = Rendezvous()
    progress_jobs.alone(rz)
    now = progress_jobs.T + 70
    status = ctl.format_status(cli.typed(json.loads(to_json(views.server_status(rz, now))), StatusView))
    line = "rank 0 alone for 20s at train.py:41 in evaluate; ranks 1-3 waiting in all_reduce"
    assert status.splitlines()[-1] == f"not stepping in job evaluating: {line}"
    assert f"stall      {line}" in ctl.format_job(views.job_detail(rz.jobs["evaluating"], now)).splitlines()


def test_the_job_view_has_progress_and_each_restarts_cost():
    rz = Rendezvous()
    progress_jobs.stepping(rz)
    lines = ctl.format_job(views.job_detail(rz.jobs["train"], progress_jobs.T + 200)).splitlines()
    assert "progress   200 steps, 2 steps/s, effective training time ratio 83.7% " \
           "(first step 2023-11-14T22:13:30.000Z)" in lines
    assert "lost       31.0s to 1 restart, 30 steps redone" in lines
    at = lines.index("restarts since the first step (cost: from the last step before to the first after):")
    assert [line.split() for line in lines[at + 1:at + 3]] == [["ROUND", "CAUSE", "COST", "REDONE"],
                                                               ["#2", "failure", "31.0s", "30"]]
    assert lines[at + 3] == ("#2 took 31.00 s: stop 0.50 · rendezvous 20.00 · start 0.50 · set-up 5.00 · "
                             "process group 2.00 · restore 1.50 · first step 1.50 (rank 3) on b")
    members = [line.split() for line in lines if line[:1].isdigit()]     # still only the members start with one
    assert [m[-2:] for m in members] == [["2", "-"], ["2", "-"]]         # STEPS/S and PACE


def test_the_job_view_says_a_restart_is_under_way_no_signal_and_slow():
    rz = Rendezvous()
    progress_jobs.restarting(rz)
    progress_jobs.silent(rz)
    progress_jobs.slow(rz)
    now = progress_jobs.T + 200
    again = ctl.format_job(views.job_detail(rz.jobs["again"], now)).splitlines()
    assert "restarting 2m30s lost so far" in again and "#2     failure  not stepped since  -" in again
    quiet = ctl.format_job(views.job_detail(rz.jobs["quiet"], now))
    assert "progress   no progress signal (no worker reported a training step)" in quiet.splitlines()
    assert "steps/s" not in quiet and "restarts since" not in quiet
    lagging = ctl.format_job(views.job_detail(rz.jobs["lagging"], now)).splitlines()
    assert "slow       b" in lagging
    assert [line.split()[-1] for line in lagging if line[:1].isdigit()] == ["-", "slow"]


def test_a_drain_that_leaves_the_job_below_its_minimum_says_what_it_costs():
    # A review drained a 2:2 job's member with no spare: "drained node b" and nothing of the job now running
    # nothing, to fail in its join timeout if no node comes.
    from tests.unit.test_operator_rules import JOB, running

    class Answers:
        def __init__(self, rz: Rendezvous) -> None:
            self.rz = rz

        def post(self, path: str, body: dict) -> object:
            node = path.split("/")[-2]
            return json.loads(to_json(views.job_detail(self.rz.drain_node(JOB, node, "", 5.0), 5.0)))

        def get(self, path: str) -> object:
            return json.loads(to_json(views.job_detail(self.rz.jobs[JOB], 5.0)))

    def drain(node: str) -> str:
        args = cli.build_parser().parse_args(["drain", JOB, node])
        args.json = False         # (main's default)
        return cli.run(args, Answers(rz)).splitlines()[0]  # type: ignore[arg-type]

    rz = running(("a", "b", "c"))
    rz.resize(JOB, 2, 3, 3.0)
    said = drain("c")
    assert said == f"drained node c from job {JOB}"          # still 2 of min 2: nothing more to say
    said = drain("b")
    assert said.startswith(f"drained node b from job {JOB}; the job has 1 of its minimum 2 nodes: it runs nothing")
    assert "join timeout" in said and "not in the job" not in said
    assert drain("zz") == (f"drained node zz from job {JOB} (it is not in the job now: it will be kept out if it "
                           f"comes; a mistyped id? undo with `rdzv-ctl clear {JOB} zz`); the job has 1 of its "
                           f"minimum 2 nodes: it runs nothing until nodes join, and fails if too few are ready "
                           f"within its join timeout (600s)")
    # drained already: said so, with the reason that stands (a second drain changes nothing)
    assert drain("zz").startswith(f"node zz was drained already from job {JOB} (its reason stands: no reason "
                                  f"given); the job has")


def test_a_resize_answered_in_another_shape_is_one_line_not_a_traceback():
    # A review pointed rdzv-ctl resize at a server answering `{}` (another version, a proxy): KeyError 'min_nodes'.
    import pytest

    from rdzv_ctl.client import CtlError

    class Answers:
        def post(self, path: str, body: dict) -> object:
            return {}

    args = cli.build_parser().parse_args(["resize", "j", "--nnodes", "1:2"])
    args.json = False
    with pytest.raises(CtlError, match="not the JobDetail this rdzv-ctl reads"):
        cli.run(args, Answers())  # type: ignore[arg-type]


def test_a_resize_whose_min_is_above_its_max_is_refused_before_it_is_sent(capsys):
    # A review: `resize --nnodes 2:1` went to the server to be refused there; the numbers alone say it is wrong.
    import pytest

    with pytest.raises(SystemExit) as stop:
        cli.build_parser().parse_args(["resize", "j", "--nnodes", "2:1"])
    assert stop.value.code == 2 and "MIN is larger than MAX in '2:1'" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["resize", "j", "--nnodes", "2:"]).nnodes == {"min_nodes": 2}


def test_an_id_that_breaks_the_rule_is_refused_before_any_request(capsys):
    # A review: `rdzv-ctl drain JOB "$NODE"` with NODE empty answered "refused POST .../nodes//drain: 404 not_found:
    # no route", and `drain "" b` "refused GET /v1/jobs/...: no route": nothing said the id was wrong. Bad usage.
    import pytest

    for argv, said in ((["drain", "j", ""], "argument NODE: node id must be"),
                       (["drain", "", "b"], "argument JOB: job id must be"),
                       (["clear", "j", "../a"], "argument NODE: node id must be"),
                       (["events", "a b"], "argument JOB: job id must be")):
        with pytest.raises(SystemExit) as stop:
            cli.build_parser().parse_args(argv)
        assert stop.value.code == 2 and said in capsys.readouterr().err, argv
    assert cli.build_parser().parse_args(["drain", "team/run-1", "node-b.1"]).job == "team/run-1"
