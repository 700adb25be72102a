"""Test worker without torch: fails (exit 1) until it is started warm (its parent is the agent's zygote,
not the agent), then prints its pid and sleeps."""
import os
import time

with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
    parent = f.read().split(b"\0")
if not any(arg.endswith(b"zygote.py") for arg in parent):
    raise SystemExit(1)
print(f"warm worker pid {os.getpid()} parent {os.getppid()}", flush=True)
while True:
    time.sleep(3600)
