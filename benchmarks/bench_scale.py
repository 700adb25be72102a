"""Fleet scale (issue 14): N simulated agents against one real server, figures and plots against N.

Scenarios (each on a fresh `rdzv-server` process with its durable store in a temporary folder):
- one job of N nodes, for every N in --nodes: round formation (first join -> all assigned, last
  join -> all assigned), steady-state server CPU (% of one core), RSS and poll rate, the status
  views' response times under that load, a round change (one node reports a worker failure: the
  report's own reply, then when every other node held the new round, p50/p99), and spurious losses
  (nodes lost and rounds beyond the expected ones, from the server's /metrics; rejoins seen by the
  nodes);
- many jobs: --jobs x --nodes-per-job held for --duration seconds (10 minutes only with --full),
  the status views timed every 10 s, one job's round changed at the end;
- overload: one job at 2x the largest N that the sweep kept up with (or --overload-nodes). Where
  that many connections do not fit in the open-file limit, the server is also held to a share of
  one core (cgroup CPU quota) so that the load per unit of server CPU is still doubled.
The simulated nodes (benchmarks/scale_fleet.py) behave like the agent and run in --clients
processes; every phase reports the clients' CPU and their own event-loop lateness, and flags a
phase where they may have been the bottleneck. Every figure carries the load average around it.

Writes docs/bench-scale.json (scenarios merged by kind and N, so a partial re-run updates its rows)
and docs/bench-scale-*.png, and prints a markdown table for docs/benchmarks.md.

Run: make bench-scale                        (the full sweep, the 100-job case for 60 s, overload)
     .venv/bin/python benchmarks/bench_scale.py --quick            (N = 100, 1,000; ~2 min)
     .venv/bin/python benchmarks/bench_scale.py --nodes 10000 --no-many --no-overload
     .venv/bin/python benchmarks/bench_scale.py --only-many --full  (100 x 1,000 for 10 minutes)
     .venv/bin/python benchmarks/bench_scale.py --nodes 10000 --blip 5   (issue 26: a 5 s server blip)
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._server import ROOT  # noqa: E402
from benchmarks.scale_blip import blip  # noqa: E402
from benchmarks.scale_clients import max_nodes_per_process  # noqa: E402
from benchmarks.scale_report import markdown_table, summary_line  # noqa: E402
from benchmarks.scale_scenarios import Settings, many_jobs, one_job  # noqa: E402

DOCS = os.path.join(ROOT, "docs")
FULL_NODES = (100, 1000, 2000, 5000, 10000)
QUICK_NODES = (100, 1000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="comma-separated node counts for the one-job sweep (default 100,1000,2000,5000,10000)")
    p.add_argument("--quick", action="store_true",
                   help="a fast subset: N = 100,1000, short windows, 5 jobs x 200 nodes for 20 s, no overload")
    p.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    p.add_argument("--per-address", type=int, default=500, help="simulated nodes per loopback source address")
    p.add_argument("--steady", type=float, default=60.0, help="seconds of the steady-state window")
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--nodes-per-job", type=int, default=1000)
    p.add_argument("--duration", type=float, default=60.0, help="seconds the many-job fleet is held (default 60)")
    p.add_argument("--full", action="store_true", help="hold the many-job fleet the issue's 10 minutes")
    p.add_argument("--no-many", action="store_true", help="skip the many-job case")
    p.add_argument("--only-many", action="store_true", help="run only the many-job case")
    p.add_argument("--no-overload", action="store_true", help="skip the overload case")
    p.add_argument("--overload-nodes", type=int, default=0,
                   help="nodes of the overload case (default: 2x the largest N the sweep kept up with)")
    p.add_argument("--kept-up", type=int, default=0,
                   help="the node count the server keeps up with, when the sweep is not run")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra rdzv-server flag, e.g. --server-arg=--max-polls-per-peer=0 (repeatable)")
    p.add_argument("--server-nice", type=int, default=0,
                   help="the server's nice value on top of --nice, in a session of its own (root: -10 puts it ahead of "
                        "the simulated fleet on the same cores, as if it had its own machine; the figures say so)")
    p.add_argument("--nice", type=int, default=0,
                   help="run the server and the clients at this nice value, each in a session of its own whose "
                        "scheduler autogroup gets it too (root: -20 puts them ahead of other work on a shared "
                        "machine; the figures say so)")
    p.add_argument("--progress", action="store_true",
                   help="the nodes' polls carry progress notes, as agents whose workers step (issue 39)")
    p.add_argument("--no-probe-port", action="store_true",
                   help="nodes join without a witness port (witness_port 0), as a client without one does")
    p.add_argument("--profile", default="", metavar="DIR",
                   help="py-spy the server through each one-job run's steady window and round change (raw "
                        "stacks into DIR, a summary into the JSON)")
    p.add_argument("--blip", type=float, default=0.0, metavar="S",
                   help="run only the server-blip scenario (issue 26) for each --nodes: the server's port "
                        "silent for S seconds (nftables, root), then healed")
    p.add_argument("--out", default=os.path.join(DOCS, "bench-scale.json"))
    p.add_argument("--plots", default=DOCS, help="folder for the PNG plots ('' for none)")
    p.add_argument("--fresh", action="store_true", help="replace the JSON instead of merging into it")
    args = p.parse_args(argv)
    if args.nodes is None:
        args.nodes = list(QUICK_NODES if args.quick else FULL_NODES)
    if args.full:
        args.duration = 600.0
    return args


def _kept_up(r: dict[str, Any]) -> bool:
    """The server kept up with a one-job run: formed, every node answered, nothing lost, CPU to spare."""
    return (r["formation"]["complete"] and r["round_change"]["complete"] and r["losses"]["spurious"] == 0
            and r["losses"]["rejoins"] == 0 and r["steady"]["server_cpu_pct"] < 90)


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    quick = args.quick
    s = Settings(clients=args.clients, per_address=args.per_address, server_args=args.server_arg, nice=args.nice,
                 server_nice=args.server_nice,
                 profile_dir=args.profile, witness_port=0 if args.no_probe_port else 29600, progress=args.progress,
                 steady_s=10.0 if quick else args.steady, settle_s=2.0 if quick else 5.0,
                 post_s=3.0 if quick else 10.0, view_samples=3 if quick else 5)
    cap = max_nodes_per_process()
    results: list[dict[str, Any]] = []
    if args.blip > 0:
        for n in args.nodes:
            r = _note_cap(blip(min(n, cap), s, args.blip), n, cap)
            print(json.dumps({k: r[k] for k in ("nodes", "blip_s", "return", "losses")}, indent=1), flush=True)
            save(r)
            results.append(r)
        return results
    if not args.only_many:
        for n in args.nodes:
            r = _note_cap(one_job(min(n, cap), s), n, cap)
            print(summary_line(r), flush=True)
            save(r)
            results.append(r)
    if not args.no_many and not quick or args.only_many:
        jobs = min(args.jobs, cap // args.nodes_per_job)
        ms = Settings(**{**s.__dict__, "clients": max(s.clients, -(-jobs * args.nodes_per_job // cap))})
        r = _note_cap(many_jobs(jobs, args.nodes_per_job, args.duration, ms), args.jobs * args.nodes_per_job, cap)
        print(summary_line(r), flush=True)
        save(r)
        results.append(r)
    elif quick and not args.no_many:
        r = many_jobs(5, 200, 20.0, s, view_every_s=5.0)
        print(summary_line(r), flush=True)
        save(r)
        results.append(r)
    if not args.no_overload and not quick and not args.only_many:
        kept = args.kept_up or max((r["nodes"] for r in results
                                    if r["kind"].startswith("one_job") and _kept_up(r)), default=0)
        want = args.overload_nodes or 2 * kept
        if want:
            n = min(want, cap)
            share = n / want if args.overload_nodes == 0 else 1.0
            os_ = Settings(**{**s.__dict__, "server_cpu_share": share})
            r = one_job(n, os_, label="overload")
            r.update(kept_up_with=kept, overload_of=want, load_factor=round(want / kept, 2) if kept else None)
            r = _note_cap(r, want, cap)
            print(summary_line(r), flush=True)
            save(r)
            results.append(r)
    return results


def _note_cap(r: dict[str, Any], wanted: int, cap: int) -> dict[str, Any]:
    if r["nodes"] < wanted:
        r["capped"] = (f"{wanted} nodes asked, {r['nodes']} run: one process here may hold {cap + 300} open files "
                       f"(RLIMIT_NOFILE hard limit, not raisable without CAP_SYS_RESOURCE) and the server needs one "
                       f"per held long-poll")
    return r


def _key(r: dict[str, Any]) -> tuple[str, int]:
    return r["kind"], r["nodes"]


def write(results: list[dict[str, Any]], args: argparse.Namespace, fresh: bool) -> dict[str, Any]:
    meta = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
            "server_commit": _commit("rdzv_server", "protocol"),
            "event_loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",   # the server's `auto`
            "python": platform.python_version(), "cores": os.cpu_count(), "command": " ".join(sys.argv)}
    for r in results:
        r["meta"] = meta
    doc: dict[str, Any] = {"scenarios": []}
    if not fresh and os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    keep = {_key(r): r for r in doc.get("scenarios", [])}
    keep.update({_key(r): r for r in results})
    doc["scenarios"] = sorted(keep.values(), key=lambda r: (r["kind"], r["nodes"]))
    doc["about"] = ("bench_scale.py: simulated agents against one rdzv-server; times in ms or s, CPU in % of one "
                    "core, RSS in MiB, load = os.getloadavg() (1, 5, 15 min) of the 2-core machine")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return doc


def _commit(*paths: str) -> str:
    """The checkout's commit, or the last one that changed `paths` (the server measured)."""
    try:
        return subprocess.run(["git", "log", "-1", "--format=%h", "--", *paths], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A stop by signal unwinds like Ctrl-C, so the server and client processes are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    saved: list[dict[str, Any]] = []

    def save(r: dict[str, Any]) -> None:        # after every scenario: a later failure loses nothing
        saved.append(r)
        write([r], args, fresh=args.fresh and len(saved) == 1)

    run(args, save)
    if not saved:
        return 1
    if args.blip > 0:
        return 0
    doc = write([], args, fresh=False)
    if args.plots:
        from benchmarks.scale_plots import plot_all
        for path in plot_all(doc, args.plots):
            print(f"wrote {path}")
    print(f"wrote {args.out}\n")
    print(markdown_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
