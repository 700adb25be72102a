"""Profile the server under a scenario's load with py-spy (from the `bench` extra), and say where the time goes.

`py-spy record --format raw` writes one line per distinct stack ("frame;frame;... count"); the summary
is the share of samples whose innermost frame is each function (self time) and the share that pass
through a few frames worth naming (inclusive), e.g. the cyclic GC, aiohttp's request handling, the
rendezvous core.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from typing import Any

# Inclusive buckets: a sample counts for the first whose marker appears in its stack.
BUCKETS = (
    ("cyclic GC", ("(garbage collection)", "gc_collect")),
    ("rendezvous core (rdzv_server rules)", ("rendezvous.py", "job_rules.py", "rounds.py", "leases.py",
                                             "admission.py")),
    ("store / persistence", ("persistence.py", "store.py", "snapshots.py")),
    ("status views / metrics", ("views.py", "page.py", "metrics.py", "prometheus_client")),
    ("aiohttp request handling", ("aiohttp/web_protocol.py", "aiohttp/web_app.py", "aiohttp/web_request.py",
                                  "aiohttp/web_response.py", "aiohttp/http_", "aiohttp/web_")),
    ("asyncio loop and sockets", ("asyncio/",)),
)


def _py_spy() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else shutil.which("py-spy")


class Profile:
    """py-spy recording the server for `seconds`; `summary()` once it has ended."""

    def __init__(self, pid: int, seconds: float, out: str) -> None:
        self.out = out
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        exe = _py_spy()
        self.proc = None if exe is None else subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200", "--format", "raw",
             "--gil", "--nonblocking", "--output", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def summary(self, top: int = 12) -> dict[str, Any]:
        if self.proc is None:
            return {"error": "py-spy not installed (pip install '.[bench]')"}
        _, err = self.proc.communicate(timeout=120)
        if not os.path.exists(self.out):
            return {"error": f"py-spy wrote nothing: {err.decode(errors='replace')[-300:]}"}
        return summarise(self.out, top)


def summarise(path: str, top: int = 12) -> dict[str, Any]:
    """Shares of samples by area (first matching bucket) and by innermost function, from a raw py-spy file."""
    leaf: Counter[str] = Counter()
    buckets: Counter[str] = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            leaf[frames[-1]] += n
            for name, markers in BUCKETS:
                if any(m in stack for m in markers):
                    buckets[name] += n
                    break
            else:
                buckets["other"] += n
    def pct(n: int) -> float:
        return round(100 * n / max(total, 1), 1)

    return {"samples": total, "file": path, "by_area_pct": {k: pct(v) for k, v in buckets.most_common()},
            "top_self_pct": [[k, pct(v)] for k, v in leaf.most_common(top)]}
