"""Soak (make soak): many leader failures in a row under a running gloo job, alternating SIGKILL and
SIGSTOP (the stopped one woken after the other has taken over, then killed and started again as
the standby). After every failover each agent renews with the new leader; at the end no worker was
ever restarted and the job succeeds. SOAK_FAILOVERS sets how many (10 by default)."""
from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.harness import wait_until
from tests.e2e.test_failover import LIMIT, finish, renewed_at, running_job, start_agent

pytestmark = [pytest.mark.e2e, pytest.mark.soak]


def test_many_failovers_restart_no_worker(replicas, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    agents = [start_agent(replicas, out, n, "soak") for n in ("node-a", "node-b")]
    leader, before, pids = running_job(replicas, out, "soak")
    for k in range(int(os.environ.get("SOAK_FAILOVERS", "10"))):
        other = 1 - leader
        how = signal.SIGKILL if k % 2 == 0 else signal.SIGSTOP
        replicas.signal(leader, how)
        view = renewed_at(replicas, other, "soak")
        assert view["round_id"] == before["round_id"] and view["restart_count"] == 0, view
        if how == signal.SIGSTOP:
            replicas.signal(leader, signal.SIGCONT)
            wait_until(lambda i=leader: not replicas.ready(i), LIMIT, "the woken leader to step down")
            replicas.signal(leader, signal.SIGKILL)
        replicas.restart(leader)
        leader = other
    finish(replicas, out, agents, pids, leader, "soak")
