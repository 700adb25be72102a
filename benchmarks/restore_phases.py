"""Where a GPU (or CPU) restore's time goes, phase by phase (issue 54): one process writes a snapshot of
`--mb` MiB of Linear(1024) layers + AdamW, a new one builds the model, steps it, builds it again and runs protect's
restore with each phase timed (read: header, views, checksums; the weights' and optimizer's uploads and loads),
then the raw figures beside it (on a GPU): the file's bytes read into one pinned buffer by threads and copied to
the GPU, from the pageable mapping to the GPU, a ring's fill by torch's copy_ and by memmove, page-locking by
torch's allocator against cudaHostRegister by 8 threads, and small kernels' latency beside a pinning thread.

Run: PYTHONPATH=. python benchmarks/restore_phases.py --device cuda --mb 805 [--repeat 2]"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
kind, where, mb, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import torch
from node_agent.training import layout, protection, resume, restored, rng, snapshot, upload
from node_agent.training.capture import Capture

sys.path.append(sys.argv[5])          # benchmarks/, for the state built (snapshot_model.py)
from snapshot_model import build as build_state, step as train_step, sync as synchronise

build = lambda: build_state(mb, device)
sync = lambda: synchronise(device)
step = lambda model, opt: train_step(model, opt, device)

model, opt = build()
step(model, opt)
if kind == "write":
    c = Capture(where)
    c.take(1, {"state": protection.training_state(model, opt, {}), "rng": rng.capture()})
    c.wait()
    print(json.dumps({"ok": 1}))
    raise SystemExit(0)
for _ in range(3):
    step(model, opt)
model, opt = build()
times = {}
def timed(mod, name, key=None):
    f = getattr(mod, name)
    def w(*a, **k):
        sync(); t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            sync(); times[key or name] = times.get(key or name, 0.0) + time.perf_counter() - t0
    setattr(mod, name, w)
timed(resume, "agree")
timed(rng, "restore", "rng.restore")
timed(protection, "_fits")
timed(layout, "digests")
timed(layout, "_assemble")
timed(layout, "read")
timed(upload, "weights_onto")
timed(upload, "optimizer_state_onto")
timed(upload, "freed")
timed(restored, "settle_optimizers")
timed(model, "load_state_dict", "model.load_state_dict")
timed(opt, "load_state_dict", "opt.load_state_dict")
t0 = time.perf_counter()
got = protection.restore(model, opt, {}, where)
sync()
times["restore"] = time.perf_counter() - t0
assert got == 1, got
path = snapshot.path(1, where)
size = os.path.getsize(path)
times["bytes"] = size
if device == "cuda":
    t0 = time.perf_counter()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    times["raw_pin_alloc"] = time.perf_counter() - t0
    fd = os.open(path, os.O_RDONLY)
    piece = 32 << 20
    def fill(at):
        os.preadv(fd, [pinned[at:at + piece].numpy().data], at)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fill, range(0, size, piece)))
    times["raw_pread_pinned_8"] = time.perf_counter() - t0
    gpu = torch.empty(size, dtype=torch.uint8, device=device)
    sync(); t0 = time.perf_counter()
    gpu.copy_(pinned, non_blocking=True); sync()
    times["raw_h2d_pinned"] = time.perf_counter() - t0
    import mmap
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    host = torch.frombuffer(m, dtype=torch.uint8)
    sync(); t0 = time.perf_counter()
    gpu.copy_(host); sync()
    times["raw_h2d_pageable_mmap"] = time.perf_counter() - t0
    sync(); t0 = time.perf_counter()
    gpu.copy_(host); sync()
    times["raw_h2d_pageable_mmap_again"] = time.perf_counter() - t0
    # The ring's fill, from the (now mapped) file into 8 MiB pinned slots by 8 threads: torch's copy_ (an OpenMP
    # team per calling thread?) against a plain memmove per piece.
    import ctypes
    slot, ring = 8 << 20, pinned[:64 << 20]
    def by_copy(i):
        ring[(i % 8) * slot:(i % 8 + 1) * slot].copy_(host[i * slot:(i + 1) * slot])
    def by_memmove(i):
        ctypes.memmove(ring.data_ptr() + (i % 8) * slot, host.data_ptr() + i * slot, slot)
    for fill in (by_copy, by_memmove, by_copy, by_memmove):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(fill, range(size // slot)))
        times[f"raw_fill_{fill.__name__}_8"] = time.perf_counter() - t0
    # Page-locking, as capture.prepare does it (torch's pinned allocator: one cudaHostAlloc per buffer) against
    # plain memory registered in pieces by 8 threads at once (cudaHostRegister), and whether a pinning thread
    # holds up the training thread's CUDA calls (the first step after a restore runs beside prepare's thread):
    # 200 small kernels and a synchronize, alone and while another thread pins twice the file's size.
    def tried(name, f):
        try:
            t0 = time.perf_counter()
            f()
            times[name] = time.perf_counter() - t0
        except Exception as exc:   # a figure missing, said; the others still come
            times[name] = f"{type(exc).__name__}: {exc}"[:120]
    del pinned, ring
    getattr(torch._C, "_host_emptyCache", lambda: None)()      # the pinned blocks back to the driver
    cudart = torch.cuda.cudart()
    def register(threads):
        plain = torch.empty(size + 4096, dtype=torch.uint8)
        base = -(-plain.data_ptr() // 4096) * 4096           # pieces of whole pages: none shares one
        step = -(-size // threads // 4096) * 4096
        def one(at):
            n = min(step, size - at)
            assert int(cudart.cudaHostRegister(base + at, n, 0)) == 0
            return at, n
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = list(pool.map(one, range(0, size, step)))
        took = time.perf_counter() - t0
        for at, _ in done:
            cudart.cudaHostUnregister(base + at)
        return took
    for threads in (1, 8):
        tried(f"raw_pin_register_{threads}_total", lambda: times.__setitem__(f"raw_pin_register_{threads}",
                                                                               register(threads)))
    small = torch.ones(1024, device=device)
    def launches():
        for _ in range(200):
            small.mul_(1.0)
        sync()
    launches()
    tried("raw_launches_alone", launches)
    import threading
    def pin_beside():
        # twice the file's size: a block of the allocator's cache (a power of two) cannot serve it
        pinning = threading.Thread(target=lambda: torch.empty(2 * size, dtype=torch.uint8, pin_memory=True))
        pinning.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        launches()
        times["raw_launches_beside_pinning"] = time.perf_counter() - t0
        pinning.join()
    tried("raw_pin_beside_total", pin_beside)
print(json.dumps(times))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mb", type=int, default=805)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    env = dict(os.environ)
    env.pop("NODE_AGENT_MEMORY_LIMIT", None)
    for _ in range(args.repeat):
        where = tempfile.mkdtemp(prefix="phases-", dir="/dev/shm")
        try:
            for kind in ("write", "restore"):
                out = subprocess.run([sys.executable, "-c", CHILD, kind, where, str(args.mb), args.device, HERE],
                                     env=dict(env, NODE_AGENT_MEMORY_DIR=where), capture_output=True, text=True,
                                     timeout=300)
                if out.returncode:
                    raise SystemExit(out.stderr[-3000:])
            got = json.loads(out.stdout.splitlines()[-1])
            print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()),
                  flush=True)
        finally:
            shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
