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
server10 (the server's own link down 3 s / 10 s), flap (c's link 7 s down / 8 s up, --flap-duration).

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
from tests.multihost.scenarios import Observed, flap, lose_host, server_outage, start_training  # noqa: E402

FAULTS = ("cut", "partition", "server3", "server10", "flap")


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
              f"runs_restarting_a_b={sum(1 for w in worst_restarts if w)}/{len(runs)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
