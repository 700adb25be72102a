"""Test worker without torch: says hello on stdout and stderr, records its environment and arguments.

OUT_DIR: where rank<RANK>.json goes ({"env": the launcher's variables, "argv": ..., "tty": stdin/stdout
are terminals}). EXIT_RANK=R EXIT_CODE=C: rank R exits with C (after writing torch's error file when
TORCHELASTIC_ERROR_FILE is set, as @record would), once every rank's record is in OUT_DIR.
SLEEP_RANK=R: rank R waits until SIGTERM (or the signal in WAIT_SIGNAL), then writes signal-<RANK>
and exits after GRACE seconds. WAIT_FILE=F: every rank waits until F exists, then exits 0.
"""
import json
import os
import signal
import sys
import time

VARS = ["RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
        "TORCHELASTIC_SIGNALS_TO_HANDLE", "RDZV_TOKEN", "RDZV_TOKEN_FILE", "CUDA_VISIBLE_DEVICES"]

rank = os.environ["RANK"]
# One write per line: ranks writing to one terminal at once then never split each other's lines.
sys.stdout.write(f"hello stdout from rank {rank}\n")
sys.stdout.flush()
sys.stderr.write(f"hello stderr from rank {rank}\n")
sys.stderr.flush()
out = os.environ.get("OUT_DIR")
if out:
    record = {"env": {k: os.environ.get(k) for k in VARS}, "argv": sys.argv[1:],
              "tty": [os.isatty(0), os.isatty(1)]}
    with open(os.path.join(out, f".rank{rank}.json"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(out, f".rank{rank}.json"), os.path.join(out, f"rank{rank}.json"))   # whole or absent
if os.environ.get("WAIT_FILE"):
    print(f"rank {rank} waiting for {os.environ['WAIT_FILE']}", flush=True)
    while not os.path.exists(os.environ["WAIT_FILE"]):
        time.sleep(0.05)   # the worker's own wait for the test's go
if os.environ.get("SLEEP_RANK") == rank:
    got = []
    sig = getattr(signal, os.environ.get("WAIT_SIGNAL", "SIGTERM"))
    signal.signal(sig, lambda s, _: got.append(s))
    print(f"rank {rank} waiting for {sig.name}", flush=True)
    while not got:
        time.sleep(0.05)   # the worker's own wait for a signal
    with open(os.path.join(out or ".", f"signal-{rank}"), "w") as f:
        f.write(signal.Signals(got[0]).name)
    time.sleep(float(os.environ.get("GRACE", "0")))
    with open(os.path.join(out or ".", f"done-{rank}"), "w") as f:
        f.write("saved")
    sys.exit(0)
if os.environ.get("EXIT_RANK") == rank:
    code = int(os.environ.get("EXIT_CODE", "1"))
    # the launcher stops the other ranks when this one fails: first let every rank write its record
    deadline = time.monotonic() + 60
    while out and time.monotonic() < deadline and \
            len([n for n in os.listdir(out) if n.startswith("rank")]) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.02)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": {"message": f"ValueError: rank {rank} gives up",
                                   "extraInfo": {"py_callstack": "Traceback: echo_env.py", "timestamp": "1700000000"}}},
                      f)
    sys.exit(code)
