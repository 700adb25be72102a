"""Snapshot write and restore at memory speed (issue 54): per size of model + AdamW state, in one process per
measure (a restarted worker is a new process), each checkout in `--roots` alternated:
- write: the step held by `take`, and the time until the snapshot's file is complete (`take` to the rename), for
  the first snapshots (new files) and the later ones (the steady state);
- exit: a running worker (its buffers prepared, two snapshots written) that crashes right after its next snapshot
  began its write, ended as a warm worker is (the fast exit, where its rules allow it): the time from `take`
  returning to the process being gone, less the same exit with no snapshot (what a crash right after a snapshot
  adds to the restart: exit_waits_steady_s);
- restore: a new process builds the model and optimizer, then protect's restore (agree, read, checksums, load
  into the model and optimizer; every tensor then checked bit for bit against the snapshot), and its first
  training step against a steady one (what the restore left for the step: pages mapped or copied on first
  write); then its next three snapshots (`restarted_N`: a restarted worker's, with its predecessor's files in
  the directory), their pinned buffers prepared first as `protect` does after its first step (`prepare_s`: how
  long that thread took, on a GPU; the steps it needs to hide).

Run: .venv/bin/python benchmarks/bench_snapshot_speed.py [--sizes 1024] [--roots .,/tmp/old] [--rounds 6]
     [--device cuda] (on a GPU node: the state on the GPU, pinned buffers, the restore into GPU tensors)
     [--pageable-too] (each write also restored as before the ring of pinned slots: restore_pageable_s)
     [--unpacked-too] (each write measure also run copying every GPU tensor on its own, as before staging.py
     packed the small ones: steady_held_unpacked_s, steady_complete_unpacked_gb_s)
     (make bench-snapshot-speed). An old checkout for --roots: `git worktree add /tmp/old <commit>`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PAGEABLE = " (pageable)"     # a root whose restore leaves its tensors in pageable memory (no ring of pinned slots)
UNPACKED = " (unpacked)"     # a root whose snapshots copy each GPU tensor on its own (no packed runs)
BASE = "/dev/shm" if os.path.isdir("/dev/shm") else None

CHILD = r"""
import json, os, sys, time
kind, where, mb, rounds, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
import torch
from node_agent.training import rng
from node_agent.training.capture import Capture
from node_agent.training.protection import restore, training_state

sys.path.append(sys.argv[6])          # benchmarks/, for the state built (snapshot_model.py)
import snapshot_model

def build():
    return snapshot_model.build(mb, device)

def sync():
    snapshot_model.sync(device)

def step(model, opt):
    snapshot_model.step(model, opt, device)

def size(model, opt):
    tree = training_state(model, opt, {})
    from node_agent.training.trees import tensors
    return sum(t.numel() * t.element_size() for _, t in tensors(tree))

model, opt = build()
if os.environ.get("BENCH_UNPACKED"):       # every GPU tensor copied on its own, as before staging.py's runs
    from node_agent.training import staging
    staging.SOLO = 0
if kind == "write":
    step(model, opt)
    capture = Capture(where)
    held, done = [], []
    profile = os.environ.get("BENCH_PROFILE")
    for n in range(1, rounds + 1 + bool(profile)):
        step(model, opt)
        if n > rounds:                             # where a steady snapshot's held time goes: a round not counted
            import cProfile, pstats
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        capture.take(n, {"state": training_state(model, opt, {}), "rng": rng.capture()})
        if n > rounds:
            prof.disable()
            with open(profile, "a") as f:
                f.write(f"\n== {mb} MiB on {device}, snapshot {n}: held {time.perf_counter() - t0:.4f} s "
                        "(profiled)\n")
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(18)
            capture.wait()
            break
        held.append(time.perf_counter() - t0)
        capture.wait()
        done.append(time.perf_counter() - t0)
    print(json.dumps({"bytes": size(model, opt), "held": held, "done": done}))
elif kind in ("exit", "exit-plain"):
    step(model, opt)
    if kind == "exit":       # a running job's: its buffers prepared, two snapshots written, then one more taken
        capture = Capture(where)
        if hasattr(capture, "prepare"):
            capture.prepare({"state": training_state(model, opt, {}), "rng": rng.capture()})
        for n in range(rounds + 1, rounds + 4):
            step(model, opt)
            capture.wait()
            capture.take(n, {"state": training_state(model, opt, {}), "rng": rng.capture()})
    print(json.dumps({"took": time.time()}), flush=True)
    try:                           # the crash, ended as a warm worker's (the default): the fast exit where it may
        from node_agent.workers.warm.zygote import exit_at_once
    except ImportError:
        def exit_at_once(code: int) -> None:
            return None
    exit_at_once(3)
    raise SystemExit(3)            # the full exit: the interpreter's may wait for the write
else:
    step(model, opt)
    steady = []
    for _ in range(3):
        t0 = time.perf_counter(); step(model, opt); steady.append(time.perf_counter() - t0)
    model, opt = build()           # a new worker's model and optimizer (no state yet)
    profile = os.environ.get("BENCH_PROFILE")
    if profile:
        import cProfile, pstats
        prof = cProfile.Profile()
        prof.enable()
    if os.environ.get("BENCH_PAGEABLE"):    # the restore as before its ring of pinned slots (upload.py)
        from node_agent.training import upload
        upload.onto = lambda pairs, ring=None: [t for t, _ in pairs]
    t0 = time.perf_counter()
    got = restore(model, opt, {}, where)
    sync()
    restored = time.perf_counter() - t0
    exact = None                   # every restored tensor bit for bit the snapshot's
    if got is not None:
        import gc
        from node_agent.training import layout, snapshot, trees
        saved = layout.read(snapshot.path(got, where), got)
        if isinstance(saved, dict):
            pairs = list(zip(trees.tensors(training_state(model, opt, {})), trees.tensors(saved["state"])))
            exact = all(torch.equal(a.cpu(), b) for (_, a), (_, b) in pairs) and bool(pairs)
            del pairs
        del saved
        gc.collect()               # its mapping closed: the snapshots below may write over that file
    if profile:
        prof.disable()
        with open(profile, "a") as f:
            f.write(f"\n== {mb} MiB on {device}, restore: {restored:.4f} s\n")
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(18)
    t0 = time.perf_counter()
    step(model, opt)
    first = time.perf_counter() - t0
    assert got is not None, "nothing restored"
    capture, later = Capture(where), []     # the restarted worker's next snapshots, into its predecessor's files
    prepared = None
    if hasattr(capture, "prepare"):        # as protect does after the first step: the pinned buffers, in a thread
        t0 = time.perf_counter()
        capture.prepare({"state": training_state(model, opt, {}), "rng": rng.capture()})
        if capture._preparing is not None:
            capture._preparing.join()      # the steps before the first snapshot (how many: prepare_s / a step)
        prepared = time.perf_counter() - t0
    for n in range(rounds + 1, rounds + 4):
        step(model, opt)
        t0 = time.perf_counter()
        capture.take(n, {"state": training_state(model, opt, {}), "rng": rng.capture()})
        held = time.perf_counter() - t0
        capture.wait()
        later.append((held, time.perf_counter() - t0))
    print(json.dumps({"bytes": size(model, opt), "restore": restored, "first_step": first, "exact": exact,
                      "steady_step": min(steady), "later": later, "prepare": prepared}))
"""


def child(arm: str, kind: str, where: str, mb: int, rounds: int, device: str,
          profile: str = "") -> dict[str, float]:
    root = arm.removesuffix(PAGEABLE).removesuffix(UNPACKED)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NODE_AGENT_MEMORY_DIR=where, BENCH_PROFILE=profile, BENCH_PAGEABLE="1" if arm.endswith(PAGEABLE) else "",
               BENCH_UNPACKED="1" if arm.endswith(UNPACKED) else "")
    env.pop("NODE_AGENT_MEMORY_LIMIT", None)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, kind, where, str(mb), str(rounds), device, HERE], env=env,
                         cwd=root,
                         capture_output=True, text=True, timeout=900)
    gone = time.time()
    print(f"  ({kind}, {mb} MiB, {os.path.basename(arm)}: {gone - t0:.1f} s)", file=sys.stderr, flush=True)  # how far
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines or (not kind.startswith("exit") and out.returncode != 0):
        raise SystemExit(f"{kind} in {root} failed ({out.returncode}): {out.stderr[-2000:]}")
    figures = json.loads(lines[-1])
    if figures.get("exact") is False:
        raise SystemExit(f"the restore in {arm} did not give back the snapshot's tensors bit for bit")
    if kind.startswith("exit"):
        return {"exit_after_take": gone - figures["took"], "wall": gone - t0}
    return figures


def measure(roots: list[str], mb: int, rounds: int, repeat: int, device: str,
            profile: str = "", pageable: bool = False, unpacked: bool = False,
            exits: bool = True) -> dict[str, dict[str, object]]:
    raw: dict[str, dict[str, list[float]]] = {r: {} for r in roots}
    for n in range(repeat):
        for root in roots:                          # alternated: old, new, old, new ...
            where = tempfile.mkdtemp(prefix="bench-snap-", dir=BASE)
            apart = tempfile.mkdtemp(prefix="bench-snap-", dir=BASE)     # the unpacked write's own directory
            try:
                if unpacked and n % 2:      # the unpacked write first every other time: alternated
                    wu = child(root + UNPACKED, "write", apart, mb, rounds, device)
                w = child(root, "write", where, mb, rounds, device, profile)
                if unpacked and not n % 2:
                    wu = child(root + UNPACKED, "write", apart, mb, rounds, device)
                if pageable and n % 2:      # the pageable restore first every other time: alternated
                    rp = child(root + PAGEABLE, "restore", where, mb, rounds, device)
                r = child(root, "restore", where, mb, rounds, device)
                if profile:                 # profiled in a child of its own: cProfile slows the restore it times
                    child(root, "restore", where, mb, rounds, device, profile)
                if pageable and not n % 2:
                    rp = child(root + PAGEABLE, "restore", where, mb, rounds, device)
                if exits:
                    e = child(root, "exit", where, mb, rounds, device)
                    e0 = child(root, "exit-plain", where, mb, rounds, device)
            finally:
                shutil.rmtree(where, ignore_errors=True)
                shutil.rmtree(apart, ignore_errors=True)
            gb = w["bytes"] / 1e9
            got = raw[root]
            got.setdefault("bytes", []).append(w["bytes"])
            got.setdefault("first_complete_gb_s", []).append(gb / w["done"][0])
            got.setdefault("steady_complete_gb_s", []).extend(gb / d for d in w["done"][2:])
            got.setdefault("steady_held_s", []).extend(w["held"][2:])
            if unpacked:
                got.setdefault("steady_held_unpacked_s", []).extend(wu["held"][2:])
                got.setdefault("steady_complete_unpacked_gb_s", []).extend(gb / d for d in wu["done"][2:])
            got.setdefault("restore_gb_s", []).append(gb / r["restore"])
            got.setdefault("restore_s", []).append(r["restore"])
            if pageable:
                got.setdefault("restore_pageable_s", []).append(rp["restore"])
            got.setdefault("first_step_extra_s", []).append(r["first_step"] - r["steady_step"])
            if exits:
                got.setdefault("exit_waits_steady_s", []).append(e["exit_after_take"] - e0["exit_after_take"])
            if r.get("prepare") is not None:
                got.setdefault("prepare_s", []).append(r["prepare"])
            for k, (held, done) in enumerate(r.get("later", [])):      # an old checkout's child tells none
                got.setdefault(f"restarted_{k + 1}_complete_gb_s", []).append(gb / done)
                got.setdefault(f"restarted_{k + 1}_held_s", []).append(held)
    return {root: {k: (round(statistics.median(v), 3) if k != "bytes" else int(v[0])) for k, v in got.items()
                   if v} for root, got in raw.items()}     # too few rounds for a steady figure: none


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024", help="MiB of model + optimizer state, comma-separated")
    p.add_argument("--roots", default=os.path.dirname(HERE), help="checkouts to run, comma-separated (alternated)")
    p.add_argument("--rounds", type=int, default=6, help="snapshots per write measure (the first two: new files)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model and optimizer live")
    p.add_argument("--json", default="", help="also write the figures to this file")
    p.add_argument("--profile", default="", help="append profiles of a steady snapshot's `take` (its held time) "
                                                 "and of a restore to this file (a round and a child of their own: "
                                                 "not in the figures)")
    p.add_argument("--pageable-too", action="store_true", help="also restore each write without the ring of pinned "
                                                                "slots (restore_pageable_s; alternated)")
    p.add_argument("--unpacked-too", action="store_true", help="also write with every GPU tensor copied on its own "
                                                                "(steady_held_unpacked_s; alternated)")
    p.add_argument("--no-exit", action="store_true", help="leave out the exit measures (write and restore only)")
    args = p.parse_args()
    roots = [os.path.abspath(r) for r in args.roots.split(",")]
    figures = {}
    for mb in (int(s) for s in args.sizes.split(",")):
        figures[mb] = measure(roots, mb, args.rounds, args.repeat, args.device, os.path.abspath(args.profile)
                              if args.profile else "", args.pageable_too, args.unpacked_too, not args.no_exit)
        for root, f in figures[mb].items():
            print(f"{mb} MiB  {root}: " + ", ".join(f"{k} {v}" for k, v in f.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
