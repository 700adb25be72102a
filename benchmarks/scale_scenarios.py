"""The scenarios of `bench_scale.py`, each against a fresh server process.

One job of N nodes (`one_job`): all N join at once -> round formation; a steady window -> server
CPU, RSS and poll rate; the status views timed under that load; one node reports a worker failure
-> the report's own reply time and when every other node held the new round; a last window ->
spurious losses (nodes lost, rounds beyond the two expected, rejoins) from the server's metrics.
Many jobs (`many_jobs`): every job's nodes join at once, then the fleet is held for a duration
with the status views timed every few seconds, and one job's round changed at the end.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks._server import running_server
from benchmarks.scale_clients import Clients, Placement, make_specs, set_apart
from benchmarks.scale_probe import ServerSampler, load, lost_events, server_counters, time_views, window
from benchmarks.scale_profile import Profile

CLIENT_CPU_LIMIT_PCT = 80.0     # a client process busier than this may have been the bottleneck
CLIENT_LAG_LIMIT_MS = 50.0      # ... and so may one whose own event loop ran this late (p99)


@dataclass
class Settings:
    clients: int = 4
    per_address: int = 500
    settle_s: float = 5.0          # after formation, before the steady window
    steady_s: float = 60.0
    view_samples: int = 5
    view_spacing_s: float = 1.0
    post_s: float = 10.0           # after the round change, before losses are counted
    server_args: list[str] = field(default_factory=list)
    server_cpu_share: float = 1.0  # < 1: the server is held to this share of one core (cgroup)
    formation_timeout_s: float = 120.0
    round_change_timeout_s: float = 60.0
    witness_port: int = 29600        # what the nodes' joins say; 0 like a client without a witness (the plugin)
    progress: bool = False         # the nodes' polls carry progress notes (issue 39)
    nice: int = 0                  # the server's and clients' priority (negative: ahead of other work here)
    server_nice: int = 0           # the server's alone, on top (negative: ahead of the simulated fleet, as if
                                   # the server had its cores to itself, as it would beside 10,000 real hosts)
    profile_dir: str = ""          # py-spy the server through the steady window and the round change


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _clients_phase(before: list[dict], after: list[dict]) -> dict[str, Any]:
    """Each client process's CPU (% of a core) and own loop lateness in a phase; were they the limit?"""
    cpu = [round(100 * (b["cpu_s"] - a["cpu_s"]) / max(b["t"] - a["t"], 1e-9), 1)
           for a, b in zip(before, after, strict=True)]
    lag_p99 = [round(b["lag"]["p99_ms"], 1) for b in after]
    reissue = [round(b["reissue_p99_ms"], 1) for b in after]
    lag_max = [round(b["lag"]["max_ms"], 1) for b in after]
    why = []
    if max(cpu) > CLIENT_CPU_LIMIT_PCT:
        why.append(f"a client used {max(cpu):.0f}% of a core")
    if max(lag_p99) > CLIENT_LAG_LIMIT_MS:
        why.append(f"a client's loop ran {max(lag_p99):.0f} ms late (p99)")
    if max(reissue) > CLIENT_LAG_LIMIT_MS:
        why.append(f"nodes sent their next poll {max(reissue):.0f} ms after an answer (p99)")
    return {"cpu_pct": cpu, "loop_lag_p99_ms": lag_p99, "loop_lag_max_ms": lag_max, "reissue_p99_ms": reissue,
            "reissue_max_ms": [round(b["reissue_max_ms"], 1) for b in after],
            "rss_mib": [round(b["rss_mib"]) for b in after], "bottleneck": bool(why), "why": "; ".join(why)}


def _phase(ma: dict, mb: dict, ca: list[dict], cb: list[dict]) -> dict[str, Any]:
    """A phase's server and machine CPU, the clients' figures, and what the rest of the machine took."""
    win, cl = window(ma, mb), _clients_phase(ca, cb)
    win["others_pct"] = round(win["machine_busy_pct"] - win["server_cpu_pct"] - sum(cl["cpu_pct"]), 1)
    return {"window": win, "clients": cl}


def _polls(before: list[dict], after: list[dict]) -> dict[str, Any]:
    dt = max(after[0]["t"] - before[0]["t"], 1e-9)
    polls = sum(b["polls"] - a["polls"] for a, b in zip(before, after, strict=True))
    by_second: dict[int, int] = {}
    for b in after:
        for sec, n in b["polls_by_second"].items():
            by_second[sec] = by_second.get(sec, 0) + n
    inside = [n for sec, n in by_second.items() if before[0]["t"] <= sec and sec + 1 <= after[0]["t"]]
    return {"polls": polls, "polls_per_s": round(polls / dt, 1), "peak_polls_per_s": max(inside, default=0)}


def _wait_holding(clients: Clients, min_round: dict[str, int], want: int, timeout: float) -> bool:
    """Until `want` nodes hold at least their job's `min_round` (a progress poll of the clients)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        progress = clients.ask({"cmd": "progress", "min_round": min_round})
        crashes = [c for r in progress for c in r["crashes"]]
        if crashes:
            raise RuntimeError("a simulated node failed (a harness bug):\n" + crashes[0])
        got = sum(r["holding"] for r in progress)
        if got >= want:
            return True
        time.sleep(0.1)         # the controller's polling pace; the figures come from the nodes' own clocks
    return False


def _tallies(after: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"rejoins": 0, "exited": 0, "unreachable": {}, "refused": {}}
    gone = [g for b in after for g in b["gone"]]
    if gone:    # a node told gone: its own gap before the poll that learnt it, and how long that poll took
        gaps, rtts = sorted(g[0] for g in gone), sorted(g[1] for g in gone)
        out["gone_evidence"] = {"count": len(gone), "own_gap_median_s": round(statistics.median(gaps), 3),
                                "own_gap_max_s": round(gaps[-1], 3),
                                "poll_rtt_median_s": round(statistics.median(rtts), 3),
                                "poll_rtt_max_s": round(rtts[-1], 3)}
    for b in after:
        out["rejoins"] += b["rejoins"]
        out["exited"] += b["exited"]
        for kind in ("unreachable", "refused"):
            for k, v in b[kind].items():
                out[kind][k] = out[kind].get(k, 0) + v
    return out


@contextlib.contextmanager
def _cpu_share(pid: int, share: float) -> Iterator[str]:
    """Hold `pid` to `share` of one core (a cgroup-v1 CPU quota); yields a note of what was done."""
    if share >= 1.0:
        yield ""
        return
    group = f"/sys/fs/cgroup/cpu/rdzv-bench-{os.getpid()}"
    try:
        os.makedirs(group, exist_ok=True)
        with open(f"{group}/cpu.cfs_quota_us", "w") as f:
            f.write(str(int(share * 100_000)))
        with open(f"{group}/cgroup.procs", "w") as f:
            f.write(str(pid))
    except OSError as exc:
        yield f"could not hold the server to {share:.2f} of a core: {exc}"
        return
    try:
        yield f"server held to {share:.2f} of one core (cgroup cpu quota)"
    finally:
        with contextlib.suppress(OSError):
            with open("/sys/fs/cgroup/cpu/cgroup.procs", "w") as f:
                f.write(str(pid))
        with contextlib.suppress(OSError):
            os.rmdir(group)


def _prioritise(pids: list[int], nice: int) -> str:
    """Run the server and the clients at `nice` (as root, < 0 puts them ahead of the machine's other work).

    With the kernel's autogroup scheduling (sched_autogroup_enabled=1, as here) a thread's nice value
    ranks it only within its own session: a session's threads together get the CPU share of one
    weight-0 autogroup, whatever their nice, so other sessions' work still takes its fair share of the
    cores from them. The server and each client therefore run in sessions of their own (Settings.nice
    starts them so), and each session's autogroup gets `nice` too. Returns what was done."""
    if not nice:
        return ""
    failed = []
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):       # nice is per thread on Linux
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(nice))
        except OSError as exc:       # no autogroup support, or not allowed
            failed.append(f"{pid}: {exc.strerror or exc}")
    where = f"autogroup nice not set ({'; '.join(failed)})" if failed else "each in its own session's autogroup"
    return f"server and clients at nice {nice}, {where}"


def _formation(times: list[dict], first_sent: float) -> dict[str, Any]:
    sent = [t["join_sent"] for t in times if t["join_sent"] is not None]
    answered = [t["join_answered"] for t in times if t["join_answered"] is not None]
    assigned = [min(t["seen"].values()) for t in times if t["seen"]]
    done = max(assigned) if assigned else float("nan")
    return {"first_join_to_all_assigned_s": round(done - min(sent, default=first_sent), 3),
            "last_join_to_all_assigned_s": round(done - max(answered), 3) if answered else None,
            "joins_took_s": round(max(answered) - min(sent), 3) if answered else None,
            "assigned": len(assigned)}


def _round_change(clients: Clients, failer: Placement, job: str, n: int, timeout: float) -> dict[str, Any]:
    """One node reports a worker failure; how soon is it answered, and every other node on the new round?"""
    reply = clients.ask_one(failer.client, {"cmd": "fail", "key": failer.key})
    new_round = reply["new_round"]
    complete = _wait_holding(clients, {job: new_round}, n, timeout)
    waits = []
    for per_client in clients.ask({"cmd": "times", "job": job}):
        for t in per_client:
            if t["key"] != failer.key and new_round in t["seen"]:
                waits.append(t["seen"][new_round] - reply["sent"])
    out = {"failure_reply_ms": round(1000 * (reply["answered"] - reply["sent"]), 1), "accepted": reply["accepted"],
           "old_round": reply["old_round"], "new_round": new_round, "answered": len(waits), "expected": n - 1,
           "complete": complete}
    if waits:
        out.update(wake_p50_ms=round(1000 * _pct(waits, 0.5), 1), wake_p99_ms=round(1000 * _pct(waits, 0.99), 1),
                   wake_max_ms=round(1000 * max(waits), 1))
    return out


def _losses(port: int, jobs: list[str], expected_rounds: int, tallies: dict[str, Any]) -> dict[str, Any]:
    c = server_counters(port)
    total = sum(c["rounds"].values())
    out = {"nodes_lost": c["nodes_lost"], "rounds": c["rounds"], "expected_rounds": expected_rounds,
           "extra_rounds": total - expected_rounds, "rejoins": tallies["rejoins"], "nodes_exited": tallies["exited"],
           "spurious": c["nodes_lost"] + max(0, total - expected_rounds),
           "server_loop_lag_max_ms": round(1000 * c["loop_lag_max_s"], 1), "store_commits": c["store"],
           "client_unreachable": tallies["unreachable"], "client_refused": tallies["refused"],
           "gone_evidence": tallies.get("gone_evidence")}
    if c["nodes_lost"]:
        out["lost_examples"] = [m for job in jobs[:3] for m in lost_events(port, job)][:5]
    return out


def one_job(n: int, s: Settings, label: str = "one_job") -> dict[str, Any]:
    job = f"scale-{n}"
    per_client, where = make_specs({job: n}, s.clients, s.per_address, s.witness_port, s.progress)
    failer = set_apart(per_client, where[job][n // 2])     # the node that fails times its reply alone
    out: dict[str, Any] = {"kind": label, "nodes": n, "jobs": 1, "clients": s.clients,
                           "server_args": s.server_args, "load_start": load()}
    pids: list[int] = []
    with running_server(*s.server_args, pids=pids, new_session=bool(s.nice or s.server_nice)) as port, \
            ServerSampler(pids[0]) as sampler, _cpu_share(pids[0], s.server_cpu_share) as note, \
            Clients(port, per_client, new_session=bool(s.nice)) as clients:
        if note:
            out["server_cpu_note"] = note
        out["priority"] = _prioritise(pids + clients.pids(), s.nice)
        if s.server_nice:
            out["server_priority"] = "the server alone: " + _prioritise(pids, s.nice + s.server_nice)
        out["nice"], out["probe_port"], out["progress"] = s.nice, s.witness_port, s.progress
        m0, c0 = sampler.mark(), clients.ask({"cmd": "window"})
        clients.ask({"cmd": "start"})
        formed = _wait_holding(clients, {job: 1}, n, s.formation_timeout_s)
        m1, c1 = sampler.mark(), clients.ask({"cmd": "window"})
        out["formation"] = {"complete": formed, **_formation(_all_times(clients, job), m0["t"]),
                            **_phase(m0, m1, c0, c1)}
        time.sleep(s.settle_s)                   # let the join storm's aftermath pass
        prof = Profile(pids[0], s.steady_s + 10, os.path.join(s.profile_dir, f"{label}-{n}.pyspy.txt")) \
            if s.profile_dir else None
        m2, c2 = sampler.mark(), clients.ask({"cmd": "window"})
        time.sleep(s.steady_s)                   # the measured window
        m3, c3 = sampler.mark(), clients.ask({"cmd": "window"})
        out["steady"] = _steady(m2, m3, c2, c3)
        out["status_views"] = {**time_views(port, job, s.view_samples, s.view_spacing_s), "load": load()}
        m4, c4 = sampler.mark(), clients.ask({"cmd": "window"})
        out["round_change"] = _round_change(clients, failer, job, n, s.round_change_timeout_s)
        m5, c5 = sampler.mark(), clients.ask({"cmd": "window"})
        out["round_change"].update(_phase(m4, m5, c4, c5))
        if prof is not None:
            out["profile"] = prof.summary()
        time.sleep(s.post_s)                     # room for a late loss to show
        c6 = clients.ask({"cmd": "window"})
        out["losses"] = _losses(port, [job], 2, _tallies(c6))
        out["server_rss_peak_mib"] = round(sampler.peak_rss / 2 ** 20, 1)
    out["load_end"] = load()
    return out


def _steady(ma: dict, mb: dict, ca: list[dict], cb: list[dict]) -> dict[str, Any]:
    phase, polls = _phase(ma, mb, ca, cb), _polls(ca, cb)
    win = phase["window"]
    return {**win, **polls, "server_rss_mib": round(mb["rss"] / 2 ** 20, 1),
            "server_cpu_us_per_poll": round(win["server_cpu_pct"] * 1e4 / polls["polls_per_s"])
            if polls["polls_per_s"] >= 1 else None,
            "clients": phase["clients"],
            # long-polls all held since the formation: a window shorter than one hold sees none answered
            **({"note": "no poll ended in the window: it is shorter than one hold (the replies' poll_hold_s)"}
               if polls["polls"] == 0 and polls["peak_polls_per_s"] == 0 else {})}


def _merge_views(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [v for v in samples if v["median_ms"] is not None]
    out = {"median_ms": statistics.median(v["median_ms"] for v in ok) if ok else None,
           "max_ms": max((v["max_ms"] for v in samples if v["max_ms"] is not None), default=None),
           "bytes": ok[-1]["bytes"] if ok else None, "samples": len(samples)}
    failed = [v for v in samples if v.get("failed")]
    if failed:
        out.update(failed=sum(v["failed"] for v in failed), error=failed[0]["error"])
    return out


def _all_times(clients: Clients, job: str) -> list[dict]:
    return [t for per_client in clients.ask({"cmd": "times", "job": job}) for t in per_client]


def many_jobs(jobs: int, per_job: int, duration_s: float, s: Settings, view_every_s: float = 10.0) -> dict[str, Any]:
    names = [f"fleet-{j:03d}" for j in range(jobs)]
    per_client, where = make_specs({name: per_job for name in names}, s.clients, s.per_address, s.witness_port,
                                   s.progress)
    total = jobs * per_job
    out: dict[str, Any] = {"kind": "many_jobs", "nodes": total, "jobs": jobs, "nodes_per_job": per_job,
                           "clients": s.clients, "duration_s": duration_s, "server_args": s.server_args,
                           "load_start": load()}
    pids: list[int] = []
    with running_server(*s.server_args, pids=pids, new_session=bool(s.nice)) as port, \
            ServerSampler(pids[0]) as sampler, Clients(port, per_client, new_session=bool(s.nice)) as clients:
        out["priority"] = _prioritise(pids + clients.pids(), s.nice)
        out["nice"], out["probe_port"], out["progress"] = s.nice, s.witness_port, s.progress
        m0, c0 = sampler.mark(), clients.ask({"cmd": "window"})
        clients.ask({"cmd": "start"})
        formed = _wait_holding(clients, {name: 1 for name in names}, total, s.formation_timeout_s)
        m1, c1 = sampler.mark(), clients.ask({"cmd": "window"})
        times = [t for name in names[:1] for t in _all_times(clients, name)]
        out["formation"] = {"complete": formed, "all_jobs_s": round(m1["t"] - m0["t"], 2),
                            "first_job": _formation(times, m0["t"]), **_phase(m0, m1, c0, c1)}
        time.sleep(s.settle_s)
        m2, c2 = sampler.mark(), clients.ask({"cmd": "window"})
        views: list[dict[str, Any]] = []
        end = m2["t"] + duration_s
        while time.monotonic() < end:
            views.append({**time_views(port, names[0], 1, 0.0), "load": load()})
            time.sleep(max(0.0, min(view_every_s, end - time.monotonic())))   # the hold's pace
        m3, c3 = sampler.mark(), clients.ask({"cmd": "window"})
        out["steady"] = _steady(m2, m3, c2, c3)
        out["status_views"] = {view: _merge_views([v[view] for v in views]) for view in views[0] if view != "load"} \
            if views else {}
        out["round_change"] = _round_change(clients, where[names[0]][per_job // 2], names[0], per_job,
                                            s.round_change_timeout_s)
        time.sleep(s.post_s)
        c6 = clients.ask({"cmd": "window"})
        out["losses"] = _losses(port, names, jobs + 1, _tallies(c6))
        out["server_rss_peak_mib"] = round(sampler.peak_rss / 2 ** 20, 1)
    out["load_end"] = load()
    return out
