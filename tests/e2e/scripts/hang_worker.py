"""Test worker without torch for hang detection: beats once per step through node_agent.heartbeat.

Writes OUT_DIR/started-<rank>-<restart> (JSON: pid, agent pid, NODE) when it starts.
HANG_RANK=R: at restart count 0, rank R beats BEATS times (default 5), writes OUT_DIR/hung-<rank>
with its pid, then stops beating and sleeps forever (a hung collective, as the agent sees it);
with HANG_IGNORE_TERM=1 it also ignores SIGTERM, so only SIGKILL ends it.
Every other worker beats once per step; at restart count 0 it goes on until stopped, later it exits
0 after BEATS steps.
"""
import json
import os
import signal
import time

from node_agent.heartbeat import beat

out = os.environ["OUT_DIR"]
rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
beats = int(os.environ.get("BEATS", "5"))
hang_rank = int(os.environ.get("HANG_RANK", "-1"))

with open(os.path.join(out, f"started-{rank}-{restart}"), "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "node": os.environ.get("NODE", "")}, f)
step = 0
while True:
    beat()
    step += 1
    if step >= beats:
        if rank == hang_rank and restart == 0:
            if os.environ.get("HANG_IGNORE_TERM"):   # stuck for real: SIGTERM does not end it
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(os.path.join(out, f"hung-{rank}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.rename(os.path.join(out, f"hung-{rank}.tmp"), os.path.join(out, f"hung-{rank}"))
            while True:          # no more beats: hung
                time.sleep(3600)
        if restart > 0:
            break
    time.sleep(0.1)
