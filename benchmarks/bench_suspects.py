"""Suspect nodes (issue 55), measured end to end with a real server and agents on 127.0.0.1 (each node its own
failure domain), benchmarks/scripts/shard_train.py (2 gloo workers per node, a snapshot every 5 steps),
examples/train_ddp.py and benchmarks/scripts/hsdp_flip.py, ddp_rate.py:
- asked: global rank 3 exits 16 (Megatron's "run this step elsewhere") with a ready spare: the time from its
  exit to every rank stepping again, the step they resumed from against the newest snapshot, restarts used,
  and where the spare stands (group rank of the suspect's place);
- every_try, no spare: rank 3 exits 16 on every attempt in a job of 1..2 nodes: restarts until the node is
  excluded and the job goes on with one node (it must not loop);
- flipped: DDP 3 x 2, one bit of a weight flipped on rank 2 after step 12, a snapshot every 5 steps of 0.25 s:
  the time from the round's start to the server's replicas_diverged event, the step resumed from, replicas
  alike at the end; hsdp_3x2, hsdp_2x2: the same under HSDP (3 or 2 replicas of 2 shards);
- slow_sleep, slow_compute: 3 x 2 + a spare, --replace-slow-nodes, node b 15 % slower from step 40 (sleeping or
  computing): from the onset to the swap, steps redone, from the swap to every rank stepping, restarts, the
  spare in b's place; slow_one_domain (sleeping): every node in one failure domain, so no peer copies (the spare
  fetches from b itself);
- solo: the same job, rank 0 computing alone for 60 s twice; jitter (not by default: --minutes): every step
  +-30 %: nodes named slow, swaps, restarts (all should be 0);
- digest_cost (not by default): DDP 3 x 2 as fast as it goes, replicas' digests on and off, alternated;
  digest_work: what digests on add, each part timed alone, as a share of the CPUs at that cadence; noflip
  (not by default): DDP 3 x 2 with digests for --minutes: alarms and restarts (should be 0).
Figures only; nothing is asserted. Run: .venv/bin/python benchmarks/bench_suspects.py [--runs 3] [--cases ...]
(make bench-suspects).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _server import ROOT, running_server  # noqa: E402

SHARDS = os.path.join(ROOT, "benchmarks", "scripts", "shard_train.py")
TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")
HSDP = os.path.join(ROOT, "benchmarks", "scripts", "hsdp_flip.py")
RATE = os.path.join(ROOT, "benchmarks", "scripts", "ddp_rate.py")
FAST = ["--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2"]


def agent(port: int, job: str, node: str, nnodes: str, nproc: int, script: list[str], env: dict[str, str],
          capture: bool = False, flags: tuple[str, ...] = ()):
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.Popen([sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{port}", "--nnodes",
                             nnodes, "--nproc", str(nproc), "--job-id", job, "--max-restarts", "3", "--node-id", node,
                             "--failure-domain", f"rack-{node}", *FAST, *flags, *script],
                            env=full, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, text=True)


def get(port: int, path: str) -> dict:
    """The server's view at `path` ({} while the job does not exist yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return {}
        raise


def until(check, limit: float = 120.0):
    deadline = time.time() + limit
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise SystemExit("timed out")


def rows(out: str, name: str) -> list[list[str]]:
    found = []
    for path in (os.path.join(out, n) for n in os.listdir(out) if n.startswith(name)):
        with open(path) as f:
            found += [ln.split() for ln in f if ln.strip()]
    return found


def asked(port: int, i: int) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix="bench-sus-")
    job, env = f"asked-{i}", {"OUT_DIR": out, "STATE_MB": "4", "STEP_S": "0.15", "SNAP_EVERY": "5",
                              "DISK_EVERY": "0", "EXIT_AT": "3:16"}
    procs = {n: agent(port, job, n, "2", 2, [SHARDS], {**env, "NODE": n}) for n in ("a", "b")}
    until(lambda: len({r[4] for r in rows(out, "steps-")}) == 4)
    procs["s"] = agent(port, job, "s", "2", 2, [SHARDS], {**env, "NODE": "s"})
    until(lambda: any(n["node_id"] == "s" and n.get("ready", True) for n in get(port, f"/v1/jobs/{job}")["spares"]))
    place = next(n["node_id"] for n in get(port, f"/v1/jobs/{job}")["nodes"] if n["group_rank"] == 1)
    until(lambda: next(n for n in get(port, f"/v1/jobs/{job}")["nodes"] if n["node_id"] == place)
          .get("copies", {}).get("copied_step", -1) >= 10)
    with open(os.path.join(out, "exit"), "w"):
        pass
    until(lambda: len({r[4] for r in rows(out, "steps-") if r[2] == "1"}) == 4)
    said = [r for r in rows(out, "steps-") if r[2] == "1"]
    steps0 = [r for r in rows(out, "steps-") if r[2] == "0"]
    exit_at = max(float(r[0]) for r in steps0 if r[4] == "3")
    again = max(min(float(r[0]) for r in said if r[4] == str(rank)) for rank in range(4))
    last = max(int(r[1]) for r in steps0)
    resumed = [ln.split() for ln in open(os.path.join(out, "resumed.txt")) if ln.split()[0] > f"{exit_at:.6f}"]
    view = get(port, f"/v1/jobs/{job}")
    with open(os.path.join(out, "stop"), "w"):
        pass
    for p in procs.values():
        with _quiet():
            p.wait(60)
    return {"exit_to_every_rank_stepping_s": again - exit_at, "steps_redone": last - int(resumed[0][2]),
            "from_memory": float(all(r[3] == "memory" for r in resumed)), "restarts": view["restart_count"],
            "spare_in_place": float(any(n["node_id"] == "s" and n["group_rank"] == 1 for n in view["nodes"]))}


def every_try(port: int, i: int) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix="bench-sus-")
    job, env = f"every-{i}", {"OUT_DIR": out, "STATE_MB": "1", "STEP_S": "0.1", "SNAP_EVERY": "5", "DISK_EVERY": "0",
                              "EXIT_AT": "3:16", "EXIT_EVERY_TRY": "1"}
    with open(os.path.join(out, "exit"), "w"):
        pass
    procs = {n: agent(port, job, n, "1:2", 2, [SHARDS], {**env, "NODE": n}) for n in ("a", "b")}
    view = until(lambda: (v := get(port, f"/v1/jobs/{job}")) and v.get("excluded") and v)
    until(lambda: len(get(port, f"/v1/jobs/{job}").get("nodes", [])) == 1)
    restarts = get(port, f"/v1/jobs/{job}")["restart_count"]
    with open(os.path.join(out, "stop"), "w"):
        pass
    for p in procs.values():
        p.kill()
        p.wait(30)
    return {"restarts_until_excluded": restarts, "excluded": float(bool(view["excluded"]))}


def flipped(port: int, i: int) -> dict[str, float]:
    job = f"flip-{i}"
    args = [TRAIN, "--steps", "30", "--snapshot-every", "5", "--flip-rank", "2", "--flip-step", "12", "--width", "32",
            "--depth", "2", "--step-s", "0.25", "--markers", os.path.join(tempfile.mkdtemp(), "m.txt")]
    procs = [agent(port, job, n, "3", 2, args, {}, capture=True) for n in ("a", "b", "c")]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    events = get(port, f"/v1/jobs/{job}/events")["events"]
    diverged = next(e for e in events if e["kind"] == "replicas_diverged")
    first_round = next(e for e in events if e["kind"] == "round_completed")
    out = "".join(outs)
    resumed = sorted({ln.split("step ")[1].split(" ")[0] for ln in out.splitlines() if "resumed from step" in ln
                      and "(memory)" in ln})
    # the flip happened after step 12's optimizer step: 13 steps of --step-s and more after the round formed
    return {"round_to_divergence_found_s": _t(diverged) - _t(first_round), "resumed_from": float(resumed[0]),
            "alike_at_end": float("replicas alike at the end: yes" in out)}


def slowed(port: int, i: int, how: str, one_domain: bool = False) -> dict[str, float]:
    """3 x 2 + spare s, --replace-slow-nodes; node b 15 % slower from step 40 (`how`: sleep or compute).
    `one_domain`: every node in one failure domain, so no peer copies: the spare resumes from b itself."""
    out = tempfile.mkdtemp(prefix="bench-sus-")
    job = f"slow-{how}-{'one-' if one_domain else ''}{i}"
    env = {"OUT_DIR": out, "STATE_MB": "4", "STEP_S": "0.2", "SNAP_EVERY": "5", "DISK_EVERY": "0",
           "SLOW_AT": f"b:40:0.15:{how}"}
    flags = ("--replace-slow-nodes", *(("--failure-domain", "one-rack") if one_domain else ()))
    procs = {n: agent(port, job, n, "3", 2, [SHARDS], {**env, "NODE": n}, flags=flags) for n in ("a", "b", "c")}
    until(lambda: len({r[4] for r in rows(out, "steps-")}) == 6)
    place = next(n["group_rank"] for n in get(port, f"/v1/jobs/{job}")["nodes"] if n["node_id"] == "b")
    procs["s"] = agent(port, job, "s", "3", 2, [SHARDS], {**env, "NODE": "s"}, flags=flags)
    events = lambda: get(port, f"/v1/jobs/{job}/events")["events"]  # noqa: E731
    swapped = until(lambda: next((e for e in events() if e["kind"] == "node_suspect"
                                  and "swapped for spare" in e["message"]), None), limit=240)
    until(lambda: len({r[4] for r in rows(out, "steps-") if float(r[0]) > _t(swapped)}) == 6, limit=60)
    steps = rows(out, "steps-")
    onset = min(float(r[0]) for r in rows(out, "steps-b") if int(r[1]) >= 40)
    before = [r for r in steps if float(r[0]) <= _t(swapped)]
    after = [r for r in steps if float(r[0]) > _t(swapped)]
    again = max(min(float(r[0]) for r in after if r[4] == str(rank)) for rank in range(6))
    resumed = [ln.split() for ln in open(os.path.join(out, "resumed.txt")) if float(ln.split()[0]) > _t(swapped)]
    view = get(port, f"/v1/jobs/{job}")
    held = next(n for n in view["nodes"] if n["node_id"] == "s")
    stop(out, procs)
    return {"onset_to_swap_s": _t(swapped) - onset, "swap_to_every_rank_stepping_s": again - _t(swapped),
            "steps_redone": max(int(r[1]) for r in before) - int(resumed[0][2]),
            "resumed_step": float(resumed[0][2]), "from_memory": float(all(r[3] == "memory" for r in resumed)),
            "restarts": view["restart_count"],
            "spare_in_place": float(held["group_rank"] == place)}


def stop(out: str, procs: dict[str, subprocess.Popen]) -> None:
    """shard_train's ranks stop together (OUT_DIR/stop); agents not done within a minute are killed."""
    with open(os.path.join(out, "stop"), "w"):
        pass
    for p in procs.values():
        with _quiet():
            p.wait(60)
    for p in procs.values():
        p.kill()


def slowed_sleep(port: int, i: int) -> dict[str, float]:
    return slowed(port, i, "sleep")


def slowed_compute(port: int, i: int) -> dict[str, float]:
    return slowed(port, i, "compute")


def slowed_one_domain(port: int, i: int) -> dict[str, float]:
    return slowed(port, i, "sleep", one_domain=True)


def quiet_job(port: int, i: int, name: str, env: dict[str, str], done) -> dict[str, float]:
    """3 x 2 + spare s, --replace-slow-nodes, a healthy job that runs until `done(out, started_at)`: the nodes
    named slow, the swaps and the restarts meanwhile (all should be 0)."""
    out = tempfile.mkdtemp(prefix="bench-sus-")
    job = f"{name}-{i}"
    env = {"OUT_DIR": out, "STATE_MB": "4", "STEP_S": "0.2", "SNAP_EVERY": "5", "DISK_EVERY": "0", **env}
    flags = ("--replace-slow-nodes",)
    procs = {n: agent(port, job, n, "3", 2, [SHARDS], {**env, "NODE": n}, flags=flags) for n in ("a", "b", "c", "s")}
    until(lambda: len({r[4] for r in rows(out, "steps-")}) == 6)
    started = time.time()
    until(lambda: done(out, started), limit=7200)
    events = get(port, f"/v1/jobs/{job}/events")["events"]
    view = get(port, f"/v1/jobs/{job}")
    steps = max(int(r[1]) for r in rows(out, "steps-"))
    stop(out, procs)
    return {"minutes": (time.time() - started) / 60, "steps": steps,
            "named_slow": sum(e["kind"] == "node_slow" for e in events),
            "swaps": sum(e["kind"] == "node_suspect" for e in events), "restarts": view["restart_count"]}


def jitter(port: int, i: int) -> dict[str, float]:
    """Every rank's step +-30 % at random, for --minutes."""
    return quiet_job(port, i, "jitter", {"JITTER": "0.3"}, lambda out, t0: time.time() - t0 >= MINUTES[0] * 60)


def solo(port: int, i: int) -> dict[str, float]:
    """Rank 0 computes alone for 60 s at steps 30 and 80 (an evaluation, a numpy metric), then 40 more steps."""
    return quiet_job(port, i, "solo", {"SOLO_AT": "30,80:60"},
                     lambda out, t0: max((int(r[1]) for r in rows(out, "steps-")), default=0) >= 120)


MINUTES = [30.0]
DIGEST_RUNS = [4, 300]      # digest_cost: turns of each (on, off), steps a run


def flipped_hsdp(port: int, i: int, nodes: int) -> dict[str, float]:
    """HSDP, `nodes` x 2 ranks on a (nodes x 2) mesh: each shard's replicas one per node; one bit of a weight
    flipped on rank 2 after step 12, a snapshot every 5 steps of 0.25 s."""
    job = f"hsdp{nodes}-{i}"
    env = {"REPLICAS": str(nodes), "STEPS": "30", "STEP_S": "0.25", "FLIP": "2:12"}
    names = "abc"[:nodes]
    procs = [agent(port, job, n, str(nodes), 2, [HSDP], env, capture=True) for n in names]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    events = get(port, f"/v1/jobs/{job}/events")["events"]
    diverged = next(e for e in events if e["kind"] == "replicas_diverged")
    out = "".join(outs)
    resumed = sorted({int(ln.split("step ")[1].split(" ")[0]) for ln in out.splitlines()
                      if "resumed from step" in ln and "(memory)" in ln})
    return {"flip_named": float("rank(s) 2 hold other parameters" in diverged["message"]),
            "resumed_from": float(resumed[0]), "alike_at_end": float("replicas alike at the end: yes" in out)}


def flipped_hsdp_3x2(port: int, i: int) -> dict[str, float]:
    return flipped_hsdp(port, i, 3)


def flipped_hsdp_2x2(port: int, i: int) -> dict[str, float]:
    return flipped_hsdp(port, i, 2)


def noflip(port: int, i: int) -> dict[str, float]:
    """DDP 3 x 2, protect(every=5) with the replicas' digests, steps of ~0.1 s for --minutes and no flip: the
    alarms (replicas_diverged) and restarts (both should be 0)."""
    job = f"noflip-{i}"
    steps = int(MINUTES[0] * 60 / 0.13)
    args = [TRAIN, "--steps", str(steps), "--snapshot-every", "5", "--width", "32", "--depth", "2", "--step-s", "0.1",
            "--flip-rank", "99"]       # no such rank: nothing flipped, the replicas compared at the end
    began = time.time()
    procs = [agent(port, job, n, "3", 2, args, {}, capture=True) for n in ("a", "b", "c")]
    out = "".join(p.communicate(timeout=int(MINUTES[0] * 60 * 3) + 300)[0] for p in procs)
    events = get(port, f"/v1/jobs/{job}/events")["events"]
    view = get(port, f"/v1/jobs/{job}")
    return {"minutes": (time.time() - began) / 60, "steps": steps,
            "alarms": sum(e["kind"] == "replicas_diverged" for e in events), "restarts": view["restart_count"],
            "alike_step": (view.get("progress") or {}).get("alike_step") or -1,
            "alike_at_end": float("replicas alike at the end: yes" in out)}


def digest_cost(port: int, i: int) -> dict[str, float]:
    """DDP 3 x 2 as fast as it goes, protect(every=5) with the replicas' digests and without (protect on the inner
    module: the same snapshots), alternated --digest-turns times each, --digest-steps steps a run: steps per second
    of each (every run printed)."""
    rates: dict[str, list[float]] = {"1": [], "0": []}
    for turn in range(2 * DIGEST_RUNS[0]):
        on = "1" if turn % 2 == 0 else "0"
        job = f"rate-{i}-{turn}"
        procs = [agent(port, job, n, "3", 2, [RATE], {"DIGESTS": on, "STEPS": str(DIGEST_RUNS[1])}, capture=True)
                 for n in "abc"]
        out = "".join(p.communicate(timeout=600)[0] for p in procs)
        rates[on] += [float(ln.split("rate ")[1].split()[0]) for ln in out.splitlines()
                      if "rate " in ln and ln.endswith("steps/s")]
        print(f"digest_cost turn {turn}: digests {'on' if on == '1' else 'off'}: {rates[on][-1]:.2f} steps/s",
              flush=True)
    on, off = statistics.median(rates["1"]), statistics.median(rates["0"])
    mean_on, mean_off = statistics.mean(rates["1"]), statistics.mean(rates["0"])
    return {"steps_per_s_digests_on": on, "steps_per_s_off": off, "on_vs_off_pct": 100 * (on - off) / off,
            "means_on_vs_off_pct": 100 * (mean_on - mean_off) / mean_off}


def digest_work(port: int, i: int) -> dict[str, float]:
    """What digests on add, timed alone in this process (digest_cost's job measures it end to end, within its
    noise): per snapshot a rank digests its tensors' hashes, which the snapshot computes anyway (one xxh3 over 8
    bytes a tensor) and writes 16 bytes to its probe record; the server judges each step once every rank told its
    digest. The agent reads the record's digest slots either way. ddp_rate.py's model (8 tensors), 6 ranks, 8
    snapshots a second (digest_cost's cadence): that work's share of this machine's CPUs. Which tensors are compared
    is asked per snapshot too (a set lookup each)."""
    import torch

    from node_agent.training import layout, probe
    from protocol.notes import RankDigest
    from rdzv_server.core import divergence
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    sums = layout.digests([t.detach() for t in model.parameters()])
    names = {f"/state/model/{name}" for name, _ in model.named_parameters()}     # protect's, for a DDP model
    paths = sorted(names) + [f"/state/optimizer/{k}" for k in range(8)]
    with tempfile.NamedTemporaryFile() as record:
        probe._record = probe.Record(record.name)
        n, began = 20_000, time.perf_counter()
        for step in range(n):
            alike = [names.__contains__(path) for path in paths]      # Capture.take: which tensors are compared
            probe.digest(step, layout.digest_of([s for s, a in zip(sums, alike, strict=False) if a]))
        rank_us = (time.perf_counter() - began) / n * 1e6
        probe._record = None
    judged, world, n = divergence.Digests(), 6, 5_000
    began = time.perf_counter()
    for step in range(n):
        divergence.note(judged, 1, world, [RankDigest(rank=r, step=step, digest=12345) for r in range(world)])
    server_us = (time.perf_counter() - began) / n * 1e6
    per_s = 8 * (world * rank_us + server_us) / 1e6
    return {"rank_us_per_snapshot": rank_us, "server_us_per_snapshot": server_us,
            "cpu_share_pct": 100 * per_s / (os.cpu_count() or 1)}


def _t(event: dict) -> float:
    return dt.datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return isinstance(exc[1], subprocess.TimeoutExpired)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cases", default="asked,every_try,flipped,hsdp_3x2,hsdp_2x2,slow_sleep,slow_one_domain,"
                                      "slow_compute,solo")
    p.add_argument("--minutes", type=float, default=30.0, help="of the jitter case (not run by default)")
    p.add_argument("--digest-turns", type=int, default=4, help="digest_cost: runs with digests on, and as many off")
    p.add_argument("--digest-steps", type=int, default=300, help="digest_cost: steps a run")
    args = p.parse_args()
    MINUTES[0] = args.minutes
    DIGEST_RUNS[:] = [args.digest_turns, args.digest_steps]
    cases = {"asked": asked, "every_try": every_try, "flipped": flipped, "slow_sleep": slowed_sleep,
             "slow_one_domain": slowed_one_domain,
             "slow_compute": slowed_compute, "solo": solo, "jitter": jitter, "hsdp_3x2": flipped_hsdp_3x2,
             "hsdp_2x2": flipped_hsdp_2x2, "digest_cost": digest_cost, "digest_work": digest_work, "noflip": noflip}
    with running_server() as port:
        for name in args.cases.split(","):
            runs = [cases[name](port, i) for i in range(args.runs)]
            for i, r in enumerate(runs):
                print(f"{name} run {i}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)
            print(f"{name} (median of {args.runs}): " + ", ".join(
                f"{k} {statistics.median(r[k] for r in runs):.3g}" for k in runs[0]), flush=True)


if __name__ == "__main__":
    main()
