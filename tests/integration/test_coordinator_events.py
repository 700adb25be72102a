"""Every new event of a job reaches the coordinator's effect listeners once, also after its id is reused."""
from __future__ import annotations

from protocol.messages import FailureReport, JobConfig, JoinRequest, WorkerFailure
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.rendezvous import REUSE_FINISHED_AFTER_S


async def test_listeners_see_each_event_once_and_the_events_of_a_reused_job_id():
    now = [1.0]
    coord = Coordinator(clock=lambda: now[0])
    seen: list[tuple[int, str]] = []
    coord.effect_listeners.append(lambda effects: seen.extend((ev.seq, ev.kind) for _, ev in effects.events))
    cfg = JobConfig(max_restarts=0, lease_timeout_s=1e4)
    joined = await coord.handle("j", JoinRequest(v=1, node_id="a", addr="x", local_world_size=1,
                                                         master_port=1, config=cfg, instance="a1"))
    failure = WorkerFailure(local_rank=0, rank=0, exitcode=1)
    await coord.handle("j", FailureReport(v=1, node_id="a", credential=joined.credential, round_id=1,
                                                     failures=[failure]))
    first_run = list(seen)
    assert [s for s, _ in first_run] == list(range(1, len(first_run) + 1)) and first_run[-1][1] == "job_failed"
    now[0] += REUSE_FINISHED_AFTER_S + 1
    await coord.handle("j", JoinRequest(v=1, node_id="a", addr="x", local_world_size=1, master_port=1,
                                                config=cfg, instance="a2"))
    second_run = seen[len(first_run):]
    assert second_run[:2] == [(1, "job_created"), (2, "job_reused")]
