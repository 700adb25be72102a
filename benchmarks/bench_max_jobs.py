"""Job creation at a full --max-jobs limit (issue 21, item 4): every new job makes room by forgetting
the finished job that ended first. In process, the rendezvous core alone (no HTTP), so the figure is
the registry's own cost per new job.

    .venv/bin/python benchmarks/bench_max_jobs.py [--limit 2000] [--jobs 3000]
"""
from __future__ import annotations

import argparse
import time

from protocol.messages import JobConfig, JoinRequest, SuccessReport
from rdzv_server.core.rendezvous import Limits, Rendezvous
from rdzv_server.core.requests import Arrival

ONE = JobConfig(min_nodes=1, max_nodes=1, last_call_s=0.0)


def one_shot_job(rz: Rendezvous, job_id: str, now: float) -> None:
    """A job that forms, succeeds and ends at once (the churn of many short jobs)."""
    status = rz.handle(job_id, JoinRequest(v=1, node_id="a", addr="10.0.0.1", local_world_size=1, master_port=1,
                                         config=ONE, instance="i"), now, Arrival(secret="secret"))
    rz.handle(job_id, SuccessReport(v=1, node_id="a", credential="secret", round_id=status.round_id), now)
    rz.take_effects()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=2000, help="--max-jobs")
    p.add_argument("--jobs", type=int, default=3000, help="jobs created once the limit is full")
    args = p.parse_args()
    rz = Rendezvous(limits=Limits(max_jobs=args.limit, retain_finished_s=3600.0))
    now = 1000.0
    for i in range(args.limit):
        one_shot_job(rz, f"fill-{i}", now + i * 1e-3)
    started = time.perf_counter()
    for i in range(args.jobs):
        one_shot_job(rz, f"new-{i}", now + (args.limit + i) * 1e-3)
    took = time.perf_counter() - started
    assert len(rz.jobs) == args.limit
    print(f"{args.jobs / took:,.0f} jobs/s created at a full {args.limit:,}-job limit "
          f"({took / args.jobs * 1e6:.0f} us per job, the oldest finished job forgotten for each)")


if __name__ == "__main__":
    main()
