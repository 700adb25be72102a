"""Smoke test of `make bench-scale`'s harness: 50 simulated nodes against a real server, tiny windows.

It checks that the harness measures what it claims (every node formed, every other node answered
after the round change, nothing lost, the client processes reported), not how fast anything is:
tests never assert times. The figures themselves come from `make bench-scale`.
"""
from __future__ import annotations

import os

import pytest

from benchmarks.scale_report import markdown_table, summary_line
from benchmarks.scale_scenarios import Settings, one_job

pytestmark = pytest.mark.e2e


def test_fifty_nodes_form_change_round_and_lose_nothing():
    r = one_job(50, Settings(clients=2, per_address=20, settle_s=0.2, steady_s=1.0, view_samples=1, view_spacing_s=0.0,
                             post_s=0.5, formation_timeout_s=60.0, nice=1))
    assert r["kind"] == "one_job"
    assert r["formation"]["complete"] and r["formation"]["assigned"] == 50
    change = r["round_change"]
    assert change["complete"] and change["accepted"]
    assert change["new_round"] == change["old_round"] + 1
    assert change["answered"] == change["expected"] == 49
    assert change["wake_p99_ms"] >= change["wake_p50_ms"] >= 0
    losses = r["losses"]
    assert losses["nodes_lost"] == 0 and losses["extra_rounds"] == 0 and losses["rejoins"] == 0
    assert losses["rounds"] == {"start": 1, "failure": 1}
    # both client processes reported, and the failing node's own (set apart to time its reply alone)
    assert len(r["steady"]["clients"]["cpu_pct"]) == 3
    assert set(r["status_views"]) >= {"/v1/status", "/v1/jobs/{job}", "/metrics"}
    assert r["load_start"] and r["load_end"]
    # --nice reaches the server and the clients; with autogroup scheduling, through sessions of their own
    assert r["priority"].startswith("server and clients at nice 1")
    if os.path.exists("/proc/self/autogroup"):
        assert r["priority"].endswith("each in its own session's autogroup")
    assert "50" in summary_line(r)
    table = markdown_table({"scenarios": [r]})
    assert table.count("\n") == 2 and "| 50 |" in table
    assert table.splitlines()[2].count("|") == 12
