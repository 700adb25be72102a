"""Smoke test of `make bench-first-step`'s harness at its smallest (a tiny model, one pair, a small
snapshot, one worker on each of two nodes), so it does not rot: every launcher that recovers (but for the cold
row, a flag) produced a run with every part, the snapshot load was measured both ways, and the JSON (and the
chart, with matplotlib) was written. torchrun's own c10d rendezvous is left to `make bench-first-step`: on a
loaded machine it may not rendezvous again after the crash, and waiting out its limit was the longest test of
the suite. Nothing here asserts how long anything took."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks.bench_first_step import LAUNCHERS
from benchmarks.first_step_report import PARTS, recovery, table

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# "node-agent cold" is the defaults' row with --warm-workers off, "node-agent (own disk)" the defaults' without
# --snapshot-every: the same harness, a flag each, that the suite runs elsewhere (~12 s of CPU each here)
RECOVERING = [name for name in LAUNCHERS if (name == "node-agent (defaults)" or "plugin" in name)]


def test_every_recovering_launcher_gives_a_run_with_every_part(tmp_path):
    assert "torchrun c10d" in LAUNCHERS and "torchrun c10d" not in RECOVERING and len(RECOVERING) == 2
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_first_step.py"), "--pairs", "1",
                           "--launchers", ",".join(RECOVERING),
                           "--width", "32", "--steps", "6", "--crash-step", "4", "--snapshot-mb", "2", "--nproc", "1",
                           "--timeout", "120", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads((tmp_path / "bench-first-step.json").read_text())
    assert [r["launcher"] for r in out["runs"]] == RECOVERING
    for run in out["runs"]:
        assert run["result"] is not None, run        # these recover every time
        parts = run["result"]["parts"]
        assert set(parts) == {name for name, _ in PARTS}
        assert abs(sum(parts.values()) - run["result"]["total"]) < 1e-6
        assert len(run["load"]) == 2
    assert set(out["snapshot_load"]["seconds"]) == {"mmap", "plain"}
    assert all(len(v) == 3 for v in out["snapshot_load"]["seconds"].values())
    assert table(out["runs"], out["launchers"]).count("\n") == 1 + len(RECOVERING)
    for launcher in RECOVERING:
        assert f"| {launcher} |" in done.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench-first-step.png").stat().st_size > 0


def test_a_recovery_is_read_along_the_last_rank_to_step_and_needs_every_rank():
    marks = [("step", 0, 1.0), ("crash", 1, 10.0)]
    for rank, delay in ((0, 0.0), (1, 2.0)):
        for k, (_, marker) in enumerate(PARTS):
            marks.append((marker, rank, 11.0 + delay + k))
    r = recovery(marks, world=2)
    assert r is not None and r["last_rank"] == 1 and r["total"] == 9.0
    assert r["parts"] == {"restart": 3.0, "import": 1.0, "CUDA": 1.0, "process group": 1.0, "model + optimizer": 1.0,
                          "snapshot load": 1.0, "first step": 1.0}
    assert recovery([m for m in marks if not (m[0] == "step" and m[1] == 1)], world=2) is None
    assert recovery([m for m in marks if m[0] != "crash"], world=2) is None
