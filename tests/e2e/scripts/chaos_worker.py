"""Chaos-soak worker without torch: record what this round told us, then idle until told to stop.

At start it writes OUT_DIR/chaos-<pid>.json (atomically) with its RANK, WORLD_SIZE, GROUP_RANK,
TORCHELASTIC_RESTART_COUNT, MASTER_PORT, its pid and its agent's pid. Then it sleeps in small steps:
- OUT_DIR/crash-<pid> appears: remove it and exit 1 (an injected worker crash);
- OUT_DIR/stop appears: exit 0.
TERM_DELAY=S: on SIGTERM take S seconds before exiting 143, like a worker that saves a checkpoint
in its stop grace period (node-agent --stop-timeout).
"""
import json
import os
import signal
import sys
import time

out = os.environ["OUT_DIR"]
pid = os.getpid()


def agent_pid() -> int:
    """The agent's pid: the parent, or, for a warm worker, the parent of the zygote that forked it."""
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        if b"zygote.py" not in f.read():
            return parent
    with open(f"/proc/{parent}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])   # the field after the state: its ppid



if os.environ.get("TERM_DELAY"):
    def on_term(signum, frame):
        time.sleep(float(os.environ["TERM_DELAY"]))
        os._exit(143)
    signal.signal(signal.SIGTERM, on_term)
record = {
    "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
    "group_rank": int(os.environ["GROUP_RANK"]), "group_world": int(os.environ["GROUP_WORLD_SIZE"]),
    "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "master_port": int(os.environ["MASTER_PORT"]),
    "master_addr": os.environ["MASTER_ADDR"], "pid": pid, "ppid": agent_pid(),
    "node": os.environ.get("NODE", ""), "t": time.time(),
}
tmp = os.path.join(out, f".chaos-{pid}.tmp")
with open(tmp, "w") as f:
    json.dump(record, f)
os.rename(tmp, os.path.join(out, f"chaos-{pid}.json"))

crash = os.path.join(out, f"crash-{pid}")
stop = os.path.join(out, "stop")
while True:
    if os.path.exists(crash):
        os.unlink(crash)
        print(f"worker {pid} crashing on purpose", file=sys.stderr, flush=True)
        sys.exit(1)
    if os.path.exists(stop):
        sys.exit(0)
    time.sleep(0.05)
