"""End-to-end: `GET /metrics` of a real server process after real agents ran a job with one restart."""
from __future__ import annotations

import textwrap
import urllib.request

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e

# No torch: global rank 1 fails on the first attempt only.
FAIL_ONCE = textwrap.dedent("""
    import os, sys
    sys.exit(3 if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
""")


def test_metrics_of_a_job_that_restarted_once_then_succeeded(cluster, tmp_path):
    script = tmp_path / "fail_once.py"
    script.write_text(FAIL_ONCE)
    cluster.start_server()
    agents = [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", "1", "--job-id", "mjob",
                            "--max-restarts", "2", "--node-id", name, str(script), name=name)
              for name in ("node-a", "node-b")]
    for a in agents:
        assert a.wait() == 0, a.output
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
        text = resp.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("rdzv_jobs", state="succeeded") == 1 and value("rdzv_jobs", state="running") == 0
    assert value("rdzv_rounds_total", cause="start") == 1 and value("rdzv_rounds_total", cause="failure") == 1
    assert value("rdzv_restarts_total") == 1
    assert value("rdzv_worker_failures_total", reason="exited") == 1
    assert value("rdzv_failure_to_round_seconds_count", cause="failure") == 1
    assert value("rdzv_round_formation_seconds_count") == 2
    assert value("rdzv_nodes", state="member") == 0            # the job finished: no live nodes
    assert value("rdzv_open_long_polls") == 0
    joins = samples.get(("rdzv_http_requests_total", (("method", "POST"), ("route", "/v1/jobs/{job_id}/join"),
                                                      ("status", "200"))), 0.0)
    assert joins >= 2
    assert not any("mjob" in dict(labels).get("route", "") for _, labels in samples)
