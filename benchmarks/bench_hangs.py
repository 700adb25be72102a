"""Issue 44's targets on this machine: hang detection that never kills a healthy job and finds the deadlocks that
matter. 2 nodes x 2 gloo workers (4 x 2 for the all-gather), benchmarks/scripts/progress_train.py unchanged,
a real rdzv-server and real node-agents with their defaults unless said.

  --solo http,poll,metrics,torchops,numpy,save,dataloader,eval [--solo-s 60]
        legitimate work alone on rank 0 (rank 1's DataLoader) for SOLO_S at steps 20 and 40 of every attempt:
        restarts (must be 0), the job's end, and how long after each spell began the status showed it alone
  --certain stop,exit0,deadlock --runs 20
        a rank stopped / exited 0 / a deadlock (ranks 0-2 in a barrier, rank 3 in a recv): fault -> decided,
        fault -> every rank stepping again, and whether rank 3 was named
  --ambiguous sleep,spin --runs 3 [--alone-timeout 30]
        a rank asleep or spinning for ever in its own code: decided at --hang-alone-timeout, rank 3 named
  --gather
        4 x 2: every rank in five all-gathers of 128 MB chunks (about 40 s, data moving): decisions (must be 0)

Run: .venv/bin/python benchmarks/bench_hangs.py [options] [--out FILE]   (make bench-hangs)
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._server import running_server  # noqa: E402
from benchmarks.bench_progress import get, hangs, pair, steps_of  # noqa: E402


@contextmanager
def slow_service(delay_s: float) -> Iterator[str]:
    """An HTTP service on loopback that answers each request after `delay_s` (an object store that answers late)."""
    class Late(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            time.sleep(delay_s)         # the service's own slowness: what the rank waits on
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Late)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/checkpoint"
    finally:
        server.shutdown()


class Watcher:
    """Polls the job's view every 0.25 s (what an operator's page sees), keeping each new stall line and when."""

    def __init__(self, port: int, job: str) -> None:
        self.port, self.job = port, job
        self.shown: list[tuple[float, str]] = []       # (unix time, the line) whenever the line changed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = ""
        while not self._stop.wait(0.25):    # a poll, as a browser's refresh would be
            try:
                stall = (get(self.port, f"/v1/jobs/{self.job}").get("progress") or {}).get("stall") or ""
            except OSError:
                continue
            if stall != last:
                self.shown.append((time.time(), stall))
            last = stall

    def first_shown(self, start: float, within: float) -> float | None:
        """Seconds from `start` until a line told of the spell that began then ("alone for N s" with N no more
        than the time since it began, give or take 2 s: not a line left over from the spell before)."""
        for t, line in self.shown:
            said = re.search(r"for (\d+)s", line)
            if start <= t <= start + within and said and int(said.group(1)) <= t - start + 2:
                return round(t - start, 2)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def solo_run(port: int, case: str, solo_s: float) -> dict:
    job = f"solo-{case}"
    rank = 1 if case == "dataloader" else 0
    with tempfile.TemporaryDirectory(prefix="bench-hangs-") as out, slow_service(solo_s) as url:
        env = {"SOLO": case, "SOLO_RANK": str(rank), "SOLO_AT": "20,40", "SOLO_S": str(solo_s), "SOLO_URL": url,
               "STEPS": "60", "WORK": "6"}
        with pair(port, job, out, env) as agents:
            watcher = Watcher(port, job)
            for a in agents:
                a.wait(solo_s * 2 + 600)
            watcher.stop()
            codes = [a.returncode for a in agents]
        began = sorted(float(open(os.path.join(out, n)).read()) for n in os.listdir(out)
                       if n.startswith(f"solo-{rank}-"))
        steps = steps_of(out)
    view, events = get(port, f"/v1/jobs/{job}"), get(port, f"/v1/jobs/{job}/events")["events"]
    shown_after = [watcher.first_shown(start, solo_s) for start in began]
    alone = [e["message"] for e in events if e["kind"] == "ranks_alone"]
    row = {"case": case, "exit_codes": codes, "state": view["state"], "restarts": view["restart_count"],
           "hangs": sum(e["kind"] == "hang_detected" for e in events), "spells": len(began),
           "shown_after_s": shown_after, "alone_events": len(alone), "said": alone[:1],
           "steps": max((s for r in steps.values() for _, s, _ in r), default=0)}
    print(json.dumps(row), flush=True)
    return row


def solos(cases: list[str], solo_s: float) -> list[dict]:
    with running_server() as port:
        rows = [solo_run(port, case, solo_s) for case in cases]
    ok = [r for r in rows if r["restarts"] == 0 and r["state"] == "succeeded" and r["spells"] == 2
          and all(s is not None and s <= 10 for s in r["shown_after_s"])]
    worst = max((s for r in rows for s in r["shown_after_s"] if s is not None), default=None)
    print(f"RESULT solo work {solo_s:g}s twice per job: {len(ok)}/{len(rows)} jobs with 0 restarts, succeeded and "
          f"every spell shown as alone within 10 s (slowest shown after {worst} s)", flush=True)
    return rows


def gather_run() -> dict:
    job = "gather"
    with running_server() as port, tempfile.TemporaryDirectory(prefix="bench-hangs-") as out:
        env = {"GATHERS": "5", "GATHER_MB": "128", "STEPS": "20", "WORK": "2"}
        with pair(port, job, out, env, nodes=("a", "b", "c", "d")) as agents:
            watcher = Watcher(port, job)
            for a in agents:
                a.wait(900)
            watcher.stop()
            codes = [a.returncode for a in agents]
        began = [float(open(os.path.join(out, n)).read()) for n in os.listdir(out) if n.startswith("solo-")]
        ended = [float(open(os.path.join(out, n)).read()) for n in os.listdir(out) if n.startswith("gathered-")]
        view, events = get(port, f"/v1/jobs/{job}"), get(port, f"/v1/jobs/{job}/events")["events"]
    row = {"exit_codes": codes, "state": view["state"], "restarts": view["restart_count"],
           "hangs": sum(e["kind"] == "hang_detected" for e in events),
           "gather_s": round(max(ended) - min(began), 1) if began and ended else None,
           "long_collective_events": [e["message"] for e in events if e["kind"] == "long_collective"][:1],
           "shown": [line for _, line in watcher.shown if line][:1]}
    print(json.dumps(row), flush=True)
    print(f"RESULT 4 x 2 in all-gathers for {row['gather_s']} s, data moving: {row['hangs']} hang decisions, "
          f"{row['restarts']} restarts, job {row['state']}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--solo", default="", help="solo cases, comma-separated")
    p.add_argument("--solo-s", type=float, default=60.0)
    p.add_argument("--certain", default="", help="certain hang cases: stop,exit0,deadlock")
    p.add_argument("--ambiguous", default="", help="sleep,spin: decided at --alone-timeout")
    p.add_argument("--alone-timeout", type=float, default=30.0)
    p.add_argument("--runs", type=int, default=3, help="runs of each certain or ambiguous case")
    p.add_argument("--gather", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench-hangs.json"))
    args = p.parse_args()
    report: dict = {}
    if args.solo:
        report["solo"] = solos(args.solo.split(","), args.solo_s)
    if args.certain:
        report["certain"] = hangs(args.certain.split(","), args.runs)
    if args.ambiguous:
        report["ambiguous"] = hangs(args.ambiguous.split(","), args.runs, "--hang-alone-timeout",
                                    f"{args.alone_timeout:g}")
    if args.gather:
        report["gather"] = gather_run()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
