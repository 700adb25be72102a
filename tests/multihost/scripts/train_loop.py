"""Worker for the multi-host tests: a gloo all-reduce loop that logs every step to its host's file.

Appends JSON lines to OUT_DIR/HOST.jsonl (HOST from the environment; every worker of that host, of
every round, writes to the same file, one whole line per write):
- {"kind": "launched"} first thing, before torch is imported, so a worker stopped while it starts
  still counts as started;
- {"kind": "start", ...} once the process group is up;
- {"kind": "step", "step": N, "sum": S, ...} after each all-reduce (S == world size when every rank
  took part);
- {"kind": "stuck", "error": ...} when a collective fails: the worker then stays alive, blocked,
  until something stops it. This is how a GPU worker behaves in a broken NCCL collective (it holds
  its memory until the collective times out, 10 min by default), so whether a dead round's workers
  go away is up to the launcher alone, never to the worker giving up by itself.
Every line carries the time, pid, RANK, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, MASTER_ADDR and
MASTER_PORT, so a test tells "restarted" (a new pid) from "kept training" (the same pid, more steps).

The collective timeout is long (COLLECTIVE_TIMEOUT_S, default 600) for the same reason. STEP_SLEEP
(default 0.2) paces the loop. Needs GLOO_SOCKET_IFNAME when the host name does not resolve to the
host's own address (in the namespaces every host shares one name that maps to 127.0.0.1).
"""
import json
import os
import threading
import time
from datetime import timedelta

base = {
    "host": os.environ["HOST"], "pid": os.getpid(), "rank": int(os.environ["RANK"]),
    "world": int(os.environ["WORLD_SIZE"]), "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
}
# O_APPEND: lines of successive workers of one host never overwrite each other.
log = os.fdopen(os.open(os.path.join(os.environ["OUT_DIR"], f"{base['host']}.jsonl"),
                        os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "w", buffering=1)


def emit(**fields) -> None:
    log.write(json.dumps({**base, **fields, "t": time.time()}) + "\n")


def stay_stuck(exc: BaseException) -> None:
    emit(kind="stuck", error=f"{type(exc).__name__}: {str(exc)[:200]}")
    threading.Event().wait()


emit(kind="launched")
import torch  # noqa: E402  (after "launched": the import takes seconds)
import torch.distributed as dist  # noqa: E402

timeout = timedelta(seconds=float(os.environ.get("COLLECTIVE_TIMEOUT_S", "600")))
pause = float(os.environ.get("STEP_SLEEP", "0.2"))
try:
    dist.init_process_group("gloo", timeout=timeout)
    emit(kind="start")
    step = 0
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        emit(kind="step", step=step, sum=t.item())
        step += 1
        time.sleep(pause)
except Exception as exc:   # a broken collective: hold on, like a hung GPU worker
    stay_stuck(exc)
