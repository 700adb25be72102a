"""A host that comes back is back at once, and a short blip of the server's link replaces nobody
(issue 26, issue 21 item 5): each host a network namespace, the workers training across them.

- Blips of the server's link at several phases of a host's poll cycle (just after an answer, mid-hold,
  just before an answer; the server holds a 2-host job's polls 2.0-2.5 s): the same round goes on with
  the same workers. A short subset runs with the suite; the whole sweep (1, 2, 3, 5 s x 3 phases) is
  under the `soak` marker.
- One-way loss on one host (what it sends to the server, or what the server sends to it, dropped at the
  switch): the server drops the host, and once the loss ends the host joins again and the job trains
  at full size. Outcomes are asserted; how long it took is printed (benchmarks/bench_faults.py records it).
"""
from __future__ import annotations

import itertools

import pytest

from tests.multihost.scenarios import live_workers, one_way_loss, server_outage, start_training

pytestmark = pytest.mark.multihost

AFTER_ANSWER, MID_HOLD, BEFORE_ANSWER = 0.05, 1.1, 1.9     # seconds after a renewal of host a's lease
PHASES = {"after_answer": AFTER_ANSWER, "mid_hold": MID_HOLD, "before_answer": BEFORE_ANSWER}


def _blip_replaces_nobody(job, blip_s: float, phase: str) -> None:
    pids = start_training(job, ["a", "b"])
    seen = server_outage(job, ["a", "b"], outage_s=blip_s, phase_s=PHASES[phase])
    print(f"{blip_s:g} s blip, {phase}: {seen.summary()}")
    assert seen.losses == 0 and seen.rounds == 0, f"{seen.summary()}\n{job.diagnosis()}"
    assert not any(seen.restarted.values()), f"workers replaced: {seen.summary()}\n{job.diagnosis()}"
    for host, pid in pids.items():
        assert [p.pid for p in live_workers(job, host)] == [pid], job.diagnosis()


@pytest.mark.parametrize(("blip_s", "phase"), [(3.0, "after_answer"), (2.0, "before_answer")])
def test_a_server_link_blip_replaces_no_worker(multihost, blip_s, phase):
    _blip_replaces_nobody(multihost(["a", "b"]), blip_s, phase)


@pytest.mark.soak
@pytest.mark.parametrize(("blip_s", "phase"), list(itertools.product([1.0, 2.0, 3.0, 5.0], PHASES)))
def test_server_link_blips_at_every_phase_replace_no_worker(multihost, blip_s, phase):
    _blip_replaces_nobody(multihost(["a", "b"]), blip_s, phase)


def _host_joins_again_after_one_way_loss(job, direction: str, down_s: float) -> None:
    start_training(job, ["a", "b", "c"])
    seen = one_way_loss(job, "c", ["a", "b", "c"], direction=direction, down_s=down_s)
    print(seen.summary())
    assert seen.losses >= 1, f"the server never dropped host c: {seen.summary()}\n{job.diagnosis()}"
    assert seen.rejoined_s is not None, f"host c never joined again: {seen.summary()}\n{job.diagnosis()}"


@pytest.mark.parametrize("direction", ["in", "out"])
def test_a_host_joins_again_after_one_way_loss(multihost, direction):
    _host_joins_again_after_one_way_loss(multihost(["a", "b", "c"]), direction, down_s=12.0)


@pytest.mark.soak
@pytest.mark.parametrize("direction", ["in", "out"])
def test_a_host_joins_again_after_20_s_of_one_way_loss(multihost, direction):
    _host_joins_again_after_one_way_loss(multihost(["a", "b", "c"]), direction, down_s=20.0)
