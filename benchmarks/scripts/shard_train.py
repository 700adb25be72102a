"""A sharded training for benchmarks/bench_node_loss.py (issue 46). Each rank owns STATE_MB of state of its own
(a shard: every element is rank + step, so any rank can tell its own shard at a step from another's), snapshots
it every SNAP_EVERY steps into node-agent's memory directory and every DISK_EVERY steps to OUT_DIR/disk, and on
each start resumes from the newest step every rank holds in memory (snapshot.agreed_step), else from the newest
disk step every rank holds, else from scratch. A step is an all_reduce and STEP_S of sleep (about 0.2 s).
Logs: OUT_DIR/steps-NODE-LOCAL_RANK.txt ("unix_time step restart world rank" per step), OUT_DIR/resumed.txt
("unix_time rank step source ok newest" per start: ok when what it loaded is its own shard at that step; newest: the
newest snapshot it held), OUT_DIR/saves-NODE-LOCAL_RANK.txt (seconds each snapshot.save took),
OUT_DIR/pid-NODE-LOCAL_RANK. Trains until OUT_DIR/stop exists (decided together every 10 steps).
EXIT_AT=RANK:CODE: global rank RANK exits with CODE at its first step after OUT_DIR/exit appears, on the first attempt
only (EXIT_EVERY_TRY=1: on every attempt), as a worker asking for other hardware does (Megatron's exit 16).
SLOW_AT=NODE:STEP:FRACTION:HOW[:UNTIL]: on node NODE, from step STEP (to step UNTIL: it recovers), each step takes
FRACTION x STEP_S more, by sleeping (HOW=sleep, as slow storage) or computing (HOW=compute). JITTER=F: each step's
sleep is STEP_S x (1 +- F), drawn per rank and step. SOLO_AT=STEP,STEP:SECONDS: global rank 0 computes alone for
SECONDS at those steps (first attempt), as an evaluation does, while the others wait in the next all_reduce. Each
step is a beat() (the probe's steps and pace). IGNORE_TERM=1: the ranks ignore SIGTERM (a framework saving before it
stops): their agent's stop takes --stop-timeout. TERM_SAVE_S=S: on SIGTERM a rank takes S seconds (a checkpoint
saved as it stops), then exits. SNAP_LAST=STEP: no snapshot after step STEP (every node's copies then settle on
one step, whatever the host's load: a test's losses resume from it).
"""
import functools
import os
import random
import signal
import time

import torch
import torch.distributed as dist

from node_agent.training import snapshot
from node_agent.training.heartbeat import beat, resumed

env = os.environ.get
out = env("OUT_DIR", ".")
if env("IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if float(env("TERM_SAVE_S", "0")) > 0:
    def _saving(signum, _frame):
        time.sleep(float(env("TERM_SAVE_S", "0")))
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _saving)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(env("TORCHELASTIC_RESTART_COUNT", "0"))
numel = int(float(env("STATE_MB", "32")) * (1 << 18))
snap_every, disk_every, step_s = int(env("SNAP_EVERY", "5")), int(env("DISK_EVERY", "50")), float(env("STEP_S", "0.2"))
snap_last = int(env("SNAP_LAST", "0")) or None
me = f"{env('NODE', '?')}-{env('LOCAL_RANK', '0')}"
disk = os.path.join(out, "disk")
os.makedirs(disk, exist_ok=True)
with open(os.path.join(out, f"pid-{me}"), "w") as f:
    f.write(str(os.getpid()))


def reduce_min(x: int) -> int:
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def loads(step: int) -> bool:
    """This rank's snapshot of `step` loads (a damaged file refuses the step for every rank: agreed_step)."""
    try:
        torch.load(snapshot.path(step), mmap=True)
        return True
    except Exception as exc:  # noqa: BLE001  (any unreadable file is refused the same way)
        print(f"rank {rank}: snapshot of step {step} refused: {exc}", flush=True)
        return False


def resume() -> tuple[int, str, torch.Tensor]:
    step = snapshot.agreed_step(reduce_min, accept=loads)
    if step is not None:
        return step, "memory", torch.load(snapshot.path(step), mmap=True)
    held = [int(n.split("-")[1][:-3]) for n in os.listdir(disk) if n.startswith(f"{rank}-") and n.endswith(".pt")]
    step = reduce_min(max(held, default=-1))
    if step >= 0:
        return step, "disk", torch.load(os.path.join(disk, f"{rank}-{step}.pt"))
    return 0, "scratch", torch.full((numel,), float(rank))


held_before = snapshot.newest()
step, source, state = resume()
if source != "memory":
    resumed(step)             # from disk or scratch (memory says so itself): the server counts the steps redone
state = state.clone()
ok = bool(torch.all(state == float(rank + step)))
with open(os.path.join(out, "resumed.txt"), "a") as f:    # one line per rank and start, appended at once
    f.write(f"{time.time():.6f} {rank} {step} {source} {'ok' if ok else 'WRONG'} {held_before}\n")
slow_node, slow_from, slow_by, slow_how, *slow_until = (env("SLOW_AT") or "-:0:0:sleep").split(":")
jitter = float(env("JITTER", "0"))
solo_steps, solo_s = ((env("SOLO_AT") or ":0").split(":")[0], float((env("SOLO_AT") or ":0").split(":")[1]))
solo_at = {int(x) for x in solo_steps.split(",") if x}
draw = random.Random(rank * 7919 + restart)


def spin(seconds: float) -> None:
    """Compute (the CPU busy, as a slow GPU's host thread or a numpy metric is) for `seconds`."""
    end, x = time.perf_counter() + seconds, torch.ones(64, 64)
    while time.perf_counter() < end:
        x = (x @ x).clamp_(-1, 1)


log = open(os.path.join(out, f"steps-{me}.txt"), "a")  # noqa: SIM115 - the run's own log, open for its life
saves = open(os.path.join(out, f"saves-{me}.txt"), "a")  # noqa: SIM115 - how long each snapshot.save took
while True:
    if step % 10 == 0:
        stop = torch.tensor([float(os.path.exists(os.path.join(out, "stop")))])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
    state += 1
    dist.all_reduce(torch.ones(1))
    time.sleep(step_s * (1 + draw.uniform(-jitter, jitter)))
    if env("NODE") == slow_node and int(slow_from) <= step < int((slow_until or ["1000000000"])[0]):
        extra = float(slow_by) * step_s
        if slow_how == "compute":
            spin(extra)
        else:
            time.sleep(extra)
    if rank == 0 and restart == 0 and step in solo_at:
        spin(solo_s)
    step += 1
    beat()
    log.write(f"{time.time():.6f} {step} {restart} {world} {rank}\n")
    log.flush()
    exit_rank, exit_code = (int(x) for x in (env("EXIT_AT") or "-1:0").split(":"))
    if rank == exit_rank and (restart == 0 or env("EXIT_EVERY_TRY") == "1") \
            and os.path.exists(os.path.join(out, "exit")):
        print(f"rank {rank}: exits {exit_code} at step {step} (EXIT_AT)", flush=True)
        os._exit(exit_code)
    if step % snap_every == 0 and (snap_last is None or step <= snap_last):
        began = time.perf_counter()
        try:
            snapshot.save(functools.partial(torch.save, state), step)
        except snapshot.MemoryDirFull as exc:
            print(f"rank {rank}: snapshot not kept: {exc}", flush=True)
        saves.write(f"{time.perf_counter() - began:.6f}\n")
        saves.flush()
    if disk_every and step % disk_every == 0:
        torch.save(state, os.path.join(disk, f"{rank}-{step}.pt"))
log.close()
dist.destroy_process_group()
