"""Test worker without torch that imports json (the test's --warm-preload): exits 1 unless it was started
warm (its parent is the agent's zygote), else prints its parent and exits 0."""
import json
import os

with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
    parent = f.read().split(b"\0")
if not any(arg.endswith(b"zygote.py") for arg in parent):
    raise SystemExit(1)
print(json.dumps({"warm": True, "rank": os.environ["RANK"]}), flush=True)
