"""The fault table (issue 12): network faults on a job spread over real hosts, and how long each
takes to be handled. Needs root and `ip netns` (and nft for the partition: `make netns-tools`).

Each host is a network namespace with its own address on one switch (tests/multihost/netns.py):
the server on its own host, agents on hosts a, b (and c), 1 gloo worker each running an all-reduce
loop (tests/multihost/scripts/train_loop.py), default job settings (lease 5 s, last call 3 s).
For each fault, from the moment it is injected:
- detection: the server's `node_lost` event for the host;
- survivors training again: the last survivor's first full all-reduce step at the smaller world;
- fencing: the cut-off host's old workers gone (watched up to --fence-wait seconds);
- for the server's own outage: the workers restarted, and when the job trained again if it did;
- for the flapping host: rounds and restarts of the healthy hosts over the whole schedule.

Faults: cut (host c's link down, no FIN), partition (c from the server only, by firewall), server3 and
server10 (the server's own link down 3 s / 10 s), flap (c's link 7 s down / 8 s up, --flap-duration),
oneway_in / oneway_out (what the server sends to c, or c sends to the server, dropped at the switch
for --oneway-s, 20 s: issue 26), and blips (the server's link down 1, 2, 3 and 5 s, each at three
phases of host a's poll cycle: 0.05 s after an answer, mid-hold, just before an answer; a fresh
2-host cluster per blip).
For one-way loss, measured from the heal: joined_s (c's next join), full_size_s (every host's first
step at world 3). For blips: per blip, the workers replaced and the nodes lost (targets: 0).

Run: sudo .venv/bin/python benchmarks/bench_faults.py [--repeat 3] [--only cut,partition,...]
Prints one line per run, then one RESULT line per fault: medians over the runs (`-` = never seen,
`(k/n)` = seen in k of n runs); for the server's outages, detection is the first node dropped and
survivors_training_s the job training again at full size; restarts_a_b = the most worker starts on
host a or b after the fault, runs_restarting_a_b = in how many runs they restarted at all.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.multihost import netns  # noqa: E402
from tests.multihost.job import LEASE_S, MultiHostJob  # noqa: E402
from tests.multihost.scenarios import (  # noqa: E402
    Observed,
    flap,
    lose_host,
    one_way_loss,
    server_outage,
    start_training,
)

FAULTS = ("cut", "partition", "server3", "server10", "flap", "oneway_in", "oneway_out", "blips")
BLIPS_S = (1.0, 2.0, 3.0, 5.0)
PHASES = {"after_answer": 0.05, "mid_hold": 1.1, "before_answer": 1.9}   # s after a renewal of a's lease


def on_cluster(hosts: list[str], run: Callable[[MultiHostJob], Observed]) -> Observed:
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as out:
        net = netns.Network(["server", *hosts])
        job = MultiHostJob(net, Path(out), f"bench-{uuid.uuid4().hex[:8]}")
        try:
            start_training(job, hosts)
            return run(job)
        finally:
            job.close()
            net.close()


def scenario(name: str, args: argparse.Namespace) -> Observed:
    three = ["a", "b", "c"]
    if name in ("cut", "partition"):
        return on_cluster(three, lambda job: lose_host(job, name, "c", ["a", "b"], fence_wait_s=args.fence_wait,
                                                       limit_s=args.fence_wait + 30))
    if name.startswith("server"):
        outage = float(name[len("server"):])
        return on_cluster(["a", "b"], lambda job: server_outage(job, ["a", "b"], outage, measure_recovery=True))
    if name.startswith("oneway_"):
        return on_cluster(three, lambda job: one_way_loss(job, "c", three, direction=name[len("oneway_"):],
                                                          down_s=args.oneway_s))
    if name == "flap":
        return on_cluster(three, lambda job: flap(job, "c", ["a", "b"], duration_s=args.flap_duration,
                                                  down_s=LEASE_S + 2, up_s=8.0))
    raise ValueError(name)


def median(values: list[float | None]) -> str:
    seen = [v for v in values if v is not None]
    if not seen:
        return "-"
    text = f"{statistics.median(seen):.2f}"
    return text if len(seen) == len(values) else f"{text}({len(seen)}/{len(values)})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--only", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--fence-wait", type=float, default=120.0,
                   help="how long to watch a cut-off host's workers (default 120 s)")
    p.add_argument("--flap-duration", type=float, default=120.0)
    p.add_argument("--oneway-s", type=float, default=20.0, help="how long one-way loss lasts (default 20 s)")
    args = p.parse_args()
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"bench_faults: {reason}", file=sys.stderr)
        return 1
    netns.sweep_abandoned()
    chosen = [f for f in args.only.split(",") if f]
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        print(f"bench_faults: unknown fault(s) {unknown}; choose from {','.join(FAULTS)}", file=sys.stderr)
        return 2
    for name in chosen:
        if name == "blips":
            blip_sweep(args)
            continue
        runs = []
        for _ in range(args.repeat):
            seen = scenario(name, args)
            print(seen.summary(), flush=True)
            runs.append(seen)
        # the hosts that were not at fault: a and b (c is the one cut off, partitioned or flapping)
        worst_restarts = [max(n for h, n in s.restarted.items() if h != "c") for s in runs]
        print(f"RESULT fault={name} detection_s={median([s.detection_s for s in runs])} "
              f"survivors_training_s={median([s.survivors_training_s for s in runs])} "
              f"fencing_s={median([s.fencing_s for s in runs])} rounds={median([float(s.rounds) for s in runs])} "
              f"losses={median([float(s.losses) for s in runs])} "
              f"restarts_a_b={median([float(w) for w in worst_restarts])} "
              f"runs_restarting_a_b={sum(1 for w in worst_restarts if w)}/{len(runs)}"
              + (f" joined_s={median([s.rejoined_s for s in runs])} full_size_s={median([s.full_size_s for s in runs])}"
                 if name.startswith("oneway_") else ""), flush=True)
    return 0


def blip_sweep(args: argparse.Namespace) -> None:
    """Every blip length at every phase, `--repeat` times each: workers replaced and nodes lost."""
    total_replaced = total_lost = runs = 0
    for blip in BLIPS_S:
        replaced, lost = [], []
        for phase, offset in PHASES.items():
            for _ in range(args.repeat):
                seen = on_cluster(["a", "b"], lambda job, b=blip, o=offset: server_outage(job, ["a", "b"], b,
                                                                                          phase_s=o))
                print(f"blip {blip:g} s {phase}: {seen.summary()}", flush=True)
                replaced.append(sum(seen.restarted.values()))
                lost.append(seen.losses)
        total_replaced, total_lost, runs = total_replaced + sum(replaced), total_lost + sum(lost), runs + len(lost)
        print(f"RESULT fault=blip{blip:g} phases={len(PHASES)} runs={len(lost)} workers_replaced={sum(replaced)} "
              f"nodes_lost={sum(lost)}", flush=True)
    print(f"RESULT fault=blips runs={runs} workers_replaced={total_replaced} nodes_lost={total_lost}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
