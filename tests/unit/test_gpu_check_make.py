"""`make gpu-check` on a node without an NVIDIA GPU: one line saying so, exit 0 (nothing imported, nothing run)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_without_a_gpu_make_gpu_check_says_so_in_one_line_and_exits_0(tmp_path) -> None:
    (tmp_path / "nvidiactl").touch()                 # the control node alone is no GPU
    done = subprocess.run(["make", "-s", "--no-print-directory", "gpu-check", f"GPU_PYTHON={sys.executable}"],
                          cwd=ROOT, env={**os.environ, "GPU_CHECK_DEV": str(tmp_path)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"gpu-check: no NVIDIA GPU on this node (no {tmp_path}/nvidia*): "
                                        f"nothing to check"]
    assert done.stderr == ""
