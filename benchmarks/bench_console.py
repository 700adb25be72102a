"""A console nobody reads (issue 44, item 5): 2 nodes x 2 gloo workers (benchmarks/scripts/chatty_train.py)
print 100 numbered lines a second each while they train for --minutes, with --log-dir and --tee 3; node a's
stdout is a pipe nobody reads for the whole run (a wrapper that stopped reading, a stuck `tee`). A real
rdzv-server, real node-agents. Printed (RESULT lines):

  finished       both agents exited 0
  restarts       the job's restart_count (GET /v1/jobs/JOB)
  leases_lost    node_lost events (GET /v1/jobs/JOB/events)
  logs_complete  each rank's stdout.log holds every line it printed, in order
  dropped        the console lines node a said it dropped (its stderr, and its stdout once read at the end);
                 with the lines found in the pipe they must add up to what node a's ranks printed

Run: .venv/bin/python benchmarks/bench_console.py [--minutes 10]   (make bench-console)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import select
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._server import running_server  # noqa: E402
from benchmarks.bench_progress import _exists, get, wait  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "scripts", "chatty_train.py")
LINE = re.compile(r"rank (\d+) restart (\d+) line (\d+) ")
DROPPED = re.compile(r"\[node-agent a\] (\d+) console lines? dropped")


def start_agents(port: int, job: str, out: str, env: dict[str, str], stuck_w: int) -> list[subprocess.Popen[bytes]]:
    """Agents a (stdout: the unread pipe's write end) and b (stdout to a file); stderr to files."""
    agents = []
    for node in ("a", "b"):
        with open(os.path.join(out, f"agent-{node}.err"), "w") as err, \
                open(os.path.join(out, f"agent-{node}.out"), "w") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{port}", "--nnodes", "2",
                 "--nproc", "2", "--job-id", job, "--node-id", node, "--max-restarts", "2", "--last-call", "1",
                 "--stop-timeout", "2", "--log-dir", os.path.join(out, f"logs-{node}"), "--tee", "3", SCRIPT],
                env=dict(os.environ, PYTHONPATH=ROOT, OUT_DIR=out, **env), cwd=out, stdin=subprocess.DEVNULL,
                stdout=stuck_w if node == "a" else log, stderr=err))
        if node == "a":
            wait(lambda: _exists(port, job), 60)
    return agents


def drain(fd: int) -> bytes:
    """What the unread pipe holds at the end (every writer has exited by then; a straggler: 5 s)."""
    data = b""
    while select.select([fd], [], [], 5)[0] and (chunk := os.read(fd, 1 << 16)):
        data += chunk
    return data


def logs_complete(out: str) -> tuple[bool, dict[str, int]]:
    """Whether each rank's stdout.log of each attempt holds lines 0..N-1 in order, N as it wrote at its end."""
    printed = {}
    for path in glob.glob(os.path.join(out, "printed-*-*.txt")):
        rank, restart = os.path.basename(path)[8:-4].split("-")
        with open(path) as f:
            printed[(int(rank), int(restart))] = int(f.read())
    logged: dict[tuple[int, int], list[int]] = {}
    for path in glob.glob(os.path.join(out, "logs-*", "*", "attempt_*", "*", "stdout.log")):
        with open(path, errors="replace") as f:
            for line in f:
                m = LINE.match(line)
                if m:
                    logged.setdefault((int(m.group(1)), int(m.group(2))), []).append(int(m.group(3)))
    ok = bool(printed) and all(logged.get(key) == list(range(n)) for key, n in printed.items())
    return ok, {f"rank {r} restart {c}": n for (r, c), n in sorted(printed.items())}


def run(minutes: float, line_bytes: int, job: str = "console") -> dict[str, Any]:
    stuck_r, stuck_w = os.pipe()
    env = {"DURATION_S": str(minutes * 60), "LINE_BYTES": str(line_bytes)}
    try:
        with running_server() as port, tempfile.TemporaryDirectory(prefix="bench-console-") as out:
            agents = start_agents(port, job, out, env, stuck_w)
            os.close(stuck_w)
            stuck_w = -1
            try:
                for a in agents:
                    a.wait(minutes * 60 + 300)
            except subprocess.TimeoutExpired:
                pass
            finally:
                for a in agents:
                    if a.poll() is None:
                        a.kill()
                    a.wait()
            codes = [a.returncode for a in agents]
            shown = drain(stuck_r).decode(errors="replace").splitlines()   # read only now
            view, events = get(port, f"/v1/jobs/{job}"), get(port, f"/v1/jobs/{job}/events")["events"]
            with open(os.path.join(out, "agent-a.err")) as f:
                said = f.read()
            complete, printed = logs_complete(out)
            a_ranks = {int(m.group(1)) for m in map(LINE.search, shown) if m}   # node a's ranks, as the pipe shows
            for path in glob.glob(os.path.join(out, "logs-a", "*", "attempt_*", "*", "stdout.log")):
                with open(path, errors="replace") as f:
                    m = LINE.match(f.readline())
                    if m:
                        a_ranks.add(int(m.group(1)))
    finally:
        os.close(stuck_r)
        if stuck_w >= 0:
            os.close(stuck_w)
    dropped = sum(int(m.group(1)) for m in DROPPED.finditer(said + "\n".join(shown)))
    a_printed = sum(n for key, n in printed.items() if int(key.split()[1]) in a_ranks)
    worker_lines = sum(1 for line in shown if LINE.search(line))
    whole = all(LINE.search(line) or line.startswith("[node-agent ") for line in shown)
    row = {"minutes": minutes, "exit_codes": codes, "finished": codes == [0, 0], "state": view["state"],
           "restarts": view["restart_count"], "leases_lost": sum(1 for e in events if e["kind"] == "node_lost"),
           "logs_complete": complete, "printed": printed, "node_a_ranks": sorted(a_ranks),
           "node_a_printed": a_printed, "console_lines_shown": worker_lines, "dropped_said": dropped,
           "accounted": worker_lines + dropped == a_printed, "console_whole_lines": whole,
           "said": [line for line in said.splitlines() if "dropped" in line]}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the workers train and print")
    p.add_argument("--line-bytes", type=int, default=200, help="bytes per printed line (newline included)")
    p.add_argument("--out", help="write the result as JSON there")
    args = p.parse_args()
    row = run(args.minutes, args.line_bytes)
    print(json.dumps(row), flush=True)
    print(f"RESULT minutes={args.minutes:g} finished={row['finished']} exit_codes={row['exit_codes']} "
          f"state={row['state']} restarts={row['restarts']} leases_lost={row['leases_lost']}", flush=True)
    print(f"RESULT logs_complete={row['logs_complete']} node_a_printed={row['node_a_printed']} "
          f"console_lines_shown={row['console_lines_shown']} dropped_said={row['dropped_said']} "
          f"accounted={row['accounted']} console_whole_lines={row['console_whole_lines']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
