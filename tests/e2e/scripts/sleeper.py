"""Test worker without torch: writes its pid, then sleeps; on SIGTERM writes a marker and exits."""
import os
import signal
import sys
import time

out = os.environ["OUT_DIR"]
rank = os.environ["RANK"]


def on_term(signum, frame):
    with open(os.path.join(out, f"sigterm-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out, f"pid-{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(out, f"pid-{rank}.tmp"), os.path.join(out, f"pid-{rank}"))
print(f"worker {rank} ready pid {os.getpid()}", flush=True)
while True:
    time.sleep(3600)
