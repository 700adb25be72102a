"""End-to-end: a script that fails at start on every node (an ImportError, sys.exit(17) before its process group)
is the script's error, not a node's. Three real node-agents and a real server on 127.0.0.1: the first node to
report in the first rounds had no other node's report beside it yet, and was made a suspect twice or excluded
before the others' reports took that back (the job shrank meanwhile). Its judgement now waits for them
(rdzv_server/core/alone.py): the job ends on its budget, no node suspected or excluded, its end naming the
script's error."""
from __future__ import annotations

import pytest

from tests.e2e.harness import job_events, job_view, wait_until
from tests.e2e.test_elastic import FAST, LIMIT

pytestmark = pytest.mark.e2e
SCRIPTS = {"exit 17": "import sys\nsys.exit(17)\n", "import error": "import no_such_module  # noqa\n"}


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_a_script_failing_at_start_everywhere_suspects_and_excludes_no_node(cluster, tmp_path, kind):
    cluster.start_server()
    script = tmp_path / "fails_at_start.py"
    script.write_text(SCRIPTS[kind])
    agents = [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "1:3", "--nproc", "1", "--job-id", "start",
                            "--max-restarts", "5", "--exclude-after", "2", "--node-id", n, *FAST, str(script),
                            name=n) for n in ("a", "b", "c")]
    for agent in agents:
        assert agent.wait(LIMIT) != 0, agent.output
    view = wait_until(lambda: (v := job_view(cluster, "start")) and v["state"] == "failed" and v, LIMIT,
                      lambda: f"the job failed: {job_view(cluster, 'start')}")
    events = job_events(cluster, "start")
    judged = [e["message"] for e in events if e["kind"] in ("node_suspect", "node_excluded")]
    assert judged == [], judged
    assert "the script's error, not a node's" in view["reason"], view["reason"]
