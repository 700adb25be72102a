"""The operators' JSON API, field by field, against a live server with real agents and workers.

One job, nodes 2:2, exclusion after one failure: node b's worker fails at start, so b is excluded;
c takes its place, d waits as a spare. Then every field the API promises is checked.
"""
from __future__ import annotations

import datetime as dt

import pytest

from tests.e2e.harness import job_events, job_view, wait_until
from tests.e2e.test_elastic import LIMIT, start_agent

pytestmark = pytest.mark.e2e


def parse_time(text: str) -> dt.datetime:
    assert text.endswith("Z"), text
    return dt.datetime.fromisoformat(text[:-1] + "+00:00")


def test_job_status_and_events_show_every_field(cluster, tmp_path):
    cluster.start_server()
    fail_file = tmp_path / "fail-b"
    fail_file.write_text("fail")
    excl = ("--exclude-after", "1", "--exclude-cooldown", "600")
    start = dict(job="api", nnodes="2", max_restarts=3, extra=excl)
    start_agent(cluster, tmp_path, "a", **start)
    wait_until(lambda: (v := job_view(cluster, "api", missing_ok=True)) and v["waiting"], LIMIT, "a to wait")
    b = start_agent(cluster, tmp_path, "b", **start, env={"FAIL_FILE": str(fail_file)})
    b.wait_for_line(r"node is excluded for", LIMIT)
    start_agent(cluster, tmp_path, "c", **start)
    wait_until(lambda: job_view(cluster, "api")["state"] == "running", LIMIT, "a and c to run")
    start_agent(cluster, tmp_path, "d", **start)
    job = wait_until(lambda: (v := job_view(cluster, "api"))["spares"] and v, LIMIT, "d to be a spare")

    assert job["state"] == "running" and job["round_id"] == 2 and job["world_size"] == 2
    assert (job["min_nodes"], job["max_nodes"], job["restart_count"], job["max_restarts"]) == (2, 2, 1, 3)
    assert job["config"]["exclude_after"] == 1 and job["config"]["exclude_cooldown_s"] == 600
    members = job["nodes"]
    assert [(n["node_id"], n["group_rank"], n["rank_offset"]) for n in members] == [("a", 0, 0), ("c", 1, 1)]
    for n in members:
        assert n["state"] == "member" and n["addr"] == "127.0.0.1" and n["local_world_size"] == 1
        assert n["worker_state"] == "running" and 0 <= n["lease_age_s"] < 10.0     # a loaded machine's re-poll
        parse_time(n["joined_at"])
    assert [(s["node_id"], s["spare_position"], s["state"]) for s in job["spares"]] == [("d", 0, "spare")]
    (excluded,) = job["excluded"]
    assert excluded["node_id"] == "b" and excluded["exclusions"] == 1 and 500 < excluded["excluded_for_s"] <= 600
    failure = job["last_failure"]
    assert (failure["node_id"], failure["rank"], failure["local_rank"], failure["exitcode"]) == ("b", 1, 0, 3)
    assert failure["host"] and failure["signal"] in ("", None)
    assert job["root_cause"] == failure and job["drained"] == []
    assert parse_time(job["created_at"]) <= dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)

    events = job_events(cluster, "api")
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    times = [parse_time(e["time"]) for e in events]
    assert times == sorted(times)
    (failed,) = [e for e in events if e["kind"] == "worker_failed"]
    assert failed["node_id"] == "b" and failed["round_id"] == 1
    assert (failed["data"]["rank"], failed["data"]["exitcode"], failed["data"]["host"]) == (1, 3, failure["host"])
    rounds = [e for e in events if e["kind"] == "round_completed"]
    assert [(e["round_id"], e["data"]["cause"]) for e in rounds] == [(1, "start"), (2, "scale_up")]
    assert all(e["data"]["formation_s"] >= 0 and e["data"]["reason"] for e in rounds)
    kinds = {e["kind"] for e in events}
    assert {"job_created", "node_joined", "round_opened", "node_excluded", "round_waiting", "node_spare"} <= kinds

    status = cluster.get("/v1/status")
    (summary,) = [j for j in status["jobs"] if j["job_id"] == "api"]
    assert {k: summary[k] for k in ("state", "round_id", "restart_count")} == \
        {"state": "running", "round_id": 2, "restart_count": 1}
    assert [n["node_id"] for n in summary["nodes"]] == ["a", "c"]
