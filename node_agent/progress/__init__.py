"""Training progress, seen without the script's help. `probe.py` runs inside every worker (standard library
only, imports nothing of ours: it is loaded by file path under any interpreter); `boot/` puts it in a cold
worker before the user's code. The agent's side reads what the probes write (node_agent/workers/progress.py)."""
