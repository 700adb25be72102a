"""Where does a restart go? One run of the first-step scenario (2 agents x 2 torch DDP ranks on gloo,
rank 3 crashing once at step 20), every launcher line and worker marker printed with its time from
the crash. Extra arguments go to both agents, e.g. `--warm-workers off`.

Run: .venv/bin/python benchmarks/restart_probe.py [AGENT ARGS...]
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOWN_S = (-0.05, 6.0)         # the window around the crash that is printed


def main(extra: list[str]) -> int:
    work = tempfile.mkdtemp(prefix="restart-probe-")
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=work, PYTHONUNBUFFERED="1")
    markers = os.path.join(work, "markers")
    script = [os.path.join(ROOT, "examples", "train_ddp.py"), "--steps", "30", "--crash-rank", "3", "--crash-step",
              "20", "--optimizer", "adamw", "--snapshot-every", "5", "--markers", markers]
    lines: list[tuple[float, str, str]] = []

    def read(node: str, stream: object) -> None:
        for line in stream:       # type: ignore[attr-defined]
            lines.append((time.time(), node, line.rstrip()))

    server = subprocess.Popen([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0",
                               "--state-dir", os.path.join(work, "state")],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    agents: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None
        match = re.search(r":(\d+)\s*$", server.stdout.readline())
        if not match:
            print("the server did not start", file=sys.stderr)
            return 1
        for node in ("node-a", "node-b"):
            agent = subprocess.Popen([sys.executable, "-m", "node_agent.main", "--endpoint",
                                      f"127.0.0.1:{match.group(1)}", "--nnodes", "2", "--nproc", "2", "--job-id", "j",
                                      "--max-restarts", "3", "--node-id", node, *extra, *script],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work,
                                     start_new_session=True)
            threading.Thread(target=read, args=(node, agent.stdout), daemon=True).start()
            agents.append(agent)
        codes = [a.wait(180) for a in agents]
    finally:
        for p in (*agents, server):
            if p.poll() is None:
                p.kill()
                p.wait()
    marks = [line.split() for line in open(markers)]
    crash = float(next(m for m in marks if m[0] == "crash")[3])
    events = [(t, f"{node}: {text[:140]}") for t, node, text in lines
              if "node-agent" in text or "Traceback" in text or "Connection closed" in text]
    events += [(float(m[3]), f"marker {m[0]} of rank {m[1]} (restart {m[2]})") for m in marks]
    for t, what in sorted(events):
        if SHOWN_S[0] <= t - crash <= SHOWN_S[1]:
            print(f"{t - crash:+.3f} s  {what}")
    print(f"agents exited {codes}")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
