"""Smoke test of `make bench-stream-memory`: a real server, 40 stream nodes that form their round.
It checks the harness measures what it says (the server's RSS before and with the streams, per
stream), not how much: the figures come from the make target."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_stream_memory.py")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_forty_streams_form_and_their_memory_is_reported(loop):
    out = subprocess.run([sys.executable, BENCH, "--nodes", "40", "--settle", "1",
                          "--loop", loop], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.splitlines()[0])
    assert figures["nodes"] == 40 and figures["loop"] == loop
    assert figures["rss_streams_mib"] >= figures["rss_before_mib"] > 10
    assert "40 subscribed streams" in out.stdout
