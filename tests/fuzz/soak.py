"""`make fuzz`: 100,000+ hostile and malformed requests against a real `rdzv-server` with a durable store.

One server process (`--state-dir` in a temp dir, log at info level to a file). While it runs:
- N client processes (soak_client.py) send hypothesis-drawn requests to every route, each checking
  its replies and its canary job (a refused request must not change it);
- this process floods malformed HTTP (socket_attacks.py), holds slow-header, slow-body and idle
  connections, runs a live job (2 nodes long-polling, one failing every few seconds: its nodes must
  never be lost nor refused), and probes /healthz every 0.2 s.
Then: the server's RSS and state dir size before and after, its log (no error of ours, every line
in the log's format), a clean SIGTERM, and a restart on the same state dir that must show every
client's canary exactly as it was. Exit 1 on any 5xx, hang (no reply within --hang-s), crash,
state change from a refused request, or any other problem listed at the end.

    python -m tests.fuzz.soak [--requests 100000] [--clients 3] [--keep]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import psutil

from tests.fuzz import known_issues
from tests.fuzz.live_traffic import HealthProbe, LiveJob
from tests.fuzz.socket_attacks import HeldConnection, RawResults, hold, raw_flood

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (debug|info|warning|error|critical) ")
# C1 controls (U+009B is a terminal escape) and the line separators some viewers break lines at.
UNQUOTED_CHARS = re.compile("[\x80-\x9f\u2028\u2029]")
UNQUOTED = "with C1 controls or U+2028/9 not escaped"


def start_server(state_dir: str, log_path: str, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", str(port),
                                 "--state-dir", state_dir, "--log-level", "info"], stdout=subprocess.PIPE,
                                stderr=log, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on http://[^:]+:(\d+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"make fuzz: the server did not start: {line!r} (log: {log_path})")
    return proc, int(match.group(1))


def stop_server(proc: subprocess.Popen[str], problems: list[str]) -> float:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        problems.append("the server did not stop within 15 s of SIGTERM")
        return time.monotonic() - started
    if code != 0:
        problems.append(f"the server exited {code} on SIGTERM")
    return time.monotonic() - started


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def canary_view(port: int, job_id: str) -> dict[str, Any] | None:
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/jobs/{job_id}", timeout=20) as resp:
            view = json.loads(resp.read())
    except OSError:
        return None
    view.pop("last_call_ends_in_s", None)
    for group in ("nodes", "waiting", "spares", "excluded"):
        for node in view.get(group, []):
            node.pop("lease_age_s", None)
    return view


def read_client(path: str, code: int | None) -> dict[str, Any]:
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {"sent": 0, "problems": {"client crashed": [f"{path}: no results (client exit {code})"]}}


async def load(port: int, pid: int, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    stop = asyncio.Event()
    raw, held = RawResults(), list[HeldConnection]()
    probe, live = HealthProbe(port, args.hang_s), LiveJob(port, args.hang_s)
    peak = [0]

    async def sample_rss() -> None:
        server = psutil.Process(pid)
        while not stop.is_set():
            peak[0] = max(peak[0], server.memory_info().rss)
            await asyncio.sleep(0.5)

    per_client = -(-args.requests // args.clients)
    clients = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.fuzz.soak_client", "--port", str(port), "--index", str(i), "--requests",
        str(per_client), "--out", os.path.join(workdir, f"client-{i}.json"), "--hang-s", str(args.hang_s),
        cwd=ROOT) for i in range(args.clients)]
    background = [asyncio.create_task(t) for t in (
        probe.run(stop), live.run(stop), raw_flood(port, stop, args.hang_s, raw), sample_rss(),
        *(hold(port, kind, stop, held) for kind, n in (("slow-headers", args.slow), ("slow-body", args.slow),
                                                      ("idle", args.idle)) for _ in range(n)))]
    codes = await asyncio.gather(*(c.wait() for c in clients))
    stop.set()
    await asyncio.gather(*background)
    results = [read_client(os.path.join(workdir, f"client-{i}.json"), code) for i, code in enumerate(codes)]
    return {"clients": results, "raw": raw, "held": held, "probe": probe, "live": live, "peak_rss": peak[0]}


def scan_log(path: str) -> tuple[Counter[str], list[str], Counter[str]]:
    """Lines by level (and how many hold a Unicode line separator), lines that are not in the log's
    format (outside a traceback), and the server's errors by known issue ("new" for the others, with
    the text in the second list)."""
    levels, odd, errors = Counter[str](), list[str](), Counter[str]()
    levels[UNQUOTED] = 0
    with open(path, errors="replace") as f:
        lines = f.read().split("\n")[:-1]      # (not splitlines: the log's lines end at \n only)
    i = 0
    while i < len(lines):
        match = LOG_LINE.match(lines[i])
        if not match:
            odd.append(lines[i][:300])
            i += 1
            continue
        levels[match.group(1)] += 1
        if UNQUOTED_CHARS.search(lines[i]):
            levels[UNQUOTED] += 1
        j = i + 1
        while j < len(lines) and lines[j].startswith("    "):         # a traceback under its line
            j += 1
        if match.group(1) in ("error", "critical"):
            text = "\n".join(lines[i:j])
            issue = known_issues.known_log(text)
            errors[issue or "new"] += 1
            if issue is None:
                odd.append("error: " + text[:1500])
        i = j
    return levels, odd, errors


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def main() -> int:
    p = argparse.ArgumentParser(prog="make fuzz")
    p.add_argument("--requests", type=int, default=100_000, help="hypothesis-drawn requests over all clients")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--hang-s", type=float, default=20.0, help="a request with no reply this long is a hang")
    p.add_argument("--slow", type=int, default=50, help="slow-header and slow-body connections (each)")
    p.add_argument("--idle", type=int, default=500, help="idle connections held open")
    p.add_argument("--keep", action="store_true", help="keep the work dir (server log, state, client results)")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    workdir = tempfile.mkdtemp(prefix="rdzv-fuzz-")
    state, log_path = os.path.join(workdir, "state"), os.path.join(workdir, "server.log")
    problems: list[str] = []
    proc, port = start_server(state, log_path)
    server = psutil.Process(proc.pid)
    rss_before, state_before = server.memory_info().rss, dir_bytes(state)
    started = time.monotonic()
    try:
        out = asyncio.run(load(port, proc.pid, args, workdir))
        seconds = time.monotonic() - started
        alive = proc.poll() is None
        if not alive:
            problems.append(f"the server died during the run (exit {proc.returncode})")
        rss_after = server.memory_info().rss if alive else 0
        canaries = {c["canary"]: canary_view(port, c["canary"]) for c in out["clients"] if c.get("canary")}
        stop_s = stop_server(proc, problems) if alive else 0.0
        state_after = dir_bytes(state)
        restarted, port2 = start_server(state, log_path)
        mismatched = [job for job, view in canaries.items() if view is None or canary_view(port2, job) != view]
        stop_server(restarted, problems)
    finally:
        if proc.poll() is None:
            proc.kill()
    if mismatched:
        problems.append(f"after a restart on the same state dir these canaries differ: {mismatched}")
    report(args, out, seconds, problems, rss_before, rss_after, state_before, state_after, stop_s, log_path)
    print(f"work dir: {workdir}" if args.keep or problems else "")
    if not args.keep and not problems:
        shutil.rmtree(workdir, ignore_errors=True)
    print("RESULT: " + ("PASS" if not problems else f"FAIL ({len(problems)} problems above)"))
    return 1 if problems else 0


def report(args: argparse.Namespace, out: dict[str, Any], seconds: float, problems: list[str], rss_before: int,
           rss_after: int, state_before: int, state_after: int, stop_s: float, log_path: str) -> None:
    clients, raw, held, probe, live = out["clients"], out["raw"], out["held"], out["probe"], out["live"]
    sent = sum(c.get("sent", 0) for c in clients)
    by_status: Counter[str] = Counter()
    known: Counter[str] = Counter()
    for c in clients:
        by_status.update({k: v for k, v in c.get("by_status", {}).items() if not k.startswith("problem:")})
        known.update(c.get("known", {}))
    total = sent + raw.sent + live.requests + probe.count
    print(f"\nmake fuzz: {total:,} requests in {seconds:.0f} s ({total / seconds:,.0f}/s) against a server with "
          f"a durable store; {sent:,} hypothesis-drawn from {args.clients} client processes, {raw.sent:,} "
          f"malformed at the socket level, {live.requests:,} of a live job, {probe.count:,} /healthz probes")
    print("  drawn requests by status: " + ", ".join(f"{k}: {v:,}" for k, v in sorted(by_status.items())))
    print("  socket-level by status:   " + ", ".join(f"{k}: {v:,}" for k, v in sorted(raw.statuses.items())))
    fivexx = sum(v for k, v in by_status.items() if k.startswith("5")) + sum(
        v for k, v in raw.statuses.items() if k.startswith("5"))
    hangs = by_status.get("hang", 0) + raw.statuses.get("hang", 0)
    print(f"  5xx: {fivexx:,}   hangs (no reply in {args.hang_s:g} s): {hangs:,}")
    credentials = any(c.get("credentials") for c in clients)
    forged = sum(c.get("forged_accepted", 0) for c in clients)
    why = "credentials handed out: each is a problem" if credentials else "the server hands out no credentials yet"
    print(f"  requests naming a live canary node without its credential and accepted: {forged:,} ({why})")
    rejoins = sum(c.get("lost_reply_rejoins", 0) for c in clients)
    print(f"  of those without it, joins from the node's own instance before its secret was used (the "
          f"lost-reply rule, not counted above): {rejoins:,}")
    canaries = sum(c.get("canaries", 0) for c in clients)
    print(f"  canaries: {canaries:,} (a new one whenever accepted requests spoiled one)")
    print(f"  server RSS: {mb(rss_before)} before, {mb(rss_after)} after, peak {mb(out['peak_rss'])}")
    print(f"  state dir: {state_before / 1e3:.1f} kB before, {state_after / 1e3:.1f} kB after")
    print(f"  /healthz: {probe.count:,} probes, {probe.failures} failed, slowest {probe.slowest_s * 1000:.0f} ms")
    print(f"  live job: {live.requests:,} requests, {live.rounds} rounds, {len(live.problems)} problems")
    for kind in ("slow-headers", "slow-body", "idle"):
        conns = [h for h in held if h.kind == kind]
        closed = [h.closed_after_s for h in conns if h.closed_after_s is not None]
        print(f"  {kind} connections: {len(conns)}, closed by the server: {len(closed)}"
              + (f" (after {min(closed):.1f}-{max(closed):.1f} s)" if closed else ""))
    levels, odd, errors = scan_log(log_path)
    lines = sum(v for k, v in levels.items() if not k.startswith("with"))
    print(f"  server log: {lines:,} lines ({', '.join(f'{k} {v:,}' for k, v in levels.items())}), "
          f"{os.path.getsize(log_path) / 1e6:.1f} MB; stopped {stop_s:.1f} s after SIGTERM")
    for issue, n in sorted((known + Counter({k: v for k, v in errors.items() if k != "new"})).items()):
        print(f"  known issue (xfail {issue}): {n:,} replies or log errors")
    if fivexx:
        problems.append(f"{fivexx} replies were 5xx")
    if levels[UNQUOTED]:
        problems.append(f"{levels[UNQUOTED]} server log lines hold C1 controls or U+2028/9 as they are")
    if hangs:
        problems.append(f"{hangs} requests got no reply within {args.hang_s:g} s")
    if sent < args.requests:
        problems.append(f"only {sent} of {args.requests} drawn requests were sent")
    if probe.failures or probe.slowest_s >= args.hang_s:
        problems.append(f"/healthz failed {probe.failures} times (slowest {probe.slowest_s:.1f} s)")
    problems += [f"live job: {p}" for p in live.problems[:10]]
    problems += [f"socket level: {p}" for p in raw.problems[:10]]
    problems += [f"server log: {line}" for line in odd[:10]]
    for c in clients:
        for kind, items in c.get("problems", {}).items():
            problems += [f"{kind}: {item}" for item in items[:5]]
    for line in problems:
        print("  PROBLEM: " + line[:2000])


if __name__ == "__main__":
    sys.exit(main())
