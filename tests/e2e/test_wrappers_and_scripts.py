"""What a user meets on day one, with real processes: a wrapper that forwards Ctrl-C (`timeout`), a script
that is missing or does not compile, a server that is not there, and a crash while DataLoader worker
processes are alive (issue 37)."""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile

import pytest

from tests.e2e.harness import SCRIPTS, Proc, child_env, job_events, job_view, wait_until

pytestmark = pytest.mark.e2e
DATALOADER_CRASH = os.path.join(SCRIPTS, "dataloader_crash.py")
INTERRUPTIBLE = """
import os, sys, time
try:    # the mark made inside: a Ctrl-C as soon as it exists is this script's to handle
    open(os.path.join(os.environ["OUT_DIR"], f"started-{os.environ['RANK']}"), "w").close()
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    open(os.path.join(os.environ["OUT_DIR"], f"interrupted-{os.environ['RANK']}"), "w").close()
    sys.exit(130)
"""


def left_in(tmp: str) -> list[str]:
    """What an agent's run may leave in TMPDIR: its own run directory, multiprocessing's, torchrun's.
    (torch's own compile cache, torchinductor_USER, is made by any torch import and kept by design.)"""
    return sorted(n for n in os.listdir(tmp) if n.startswith(("node-agent_", "pymp-", "torchelastic_")))


def test_ctrl_c_through_a_wrapper_that_forwards_it_is_one_clean_stop(cluster, tmp_path):
    """A terminal's Ctrl-C reaches the whole foreground group; `timeout` in it forwards SIGINT to the
    agent once more. Both are one request: the workers get SIGINT (their KeyboardInterrupt runs), the
    node leaves, exit 130, nothing left behind, no forced exit."""
    timeout = shutil.which("timeout")
    assert timeout, "coreutils timeout is needed"
    cluster.start_server()
    script = tmp_path / "interruptible.py"
    script.write_text(INTERRUPTIBLE)
    out, tmp = tmp_path / "out", cluster.temp_dir()
    out.mkdir()
    argv = [timeout, "100", sys.executable, "-m", "node_agent", "--endpoint", cluster.endpoint(), "--nproc", "2",
            "--job-id", "ctrl-c", str(script)]
    wrapped = Proc(argv, child_env(OUT_DIR=str(out), TMPDIR=tmp), "timeout node-agent")
    cluster.procs.append(wrapped)
    wait_until(lambda: {p.name for p in out.iterdir()} >= {"started-0", "started-1"}, 60, "both workers started")
    memory = wrapped.wait_for_line(r"in-memory checkpoints: (\S+)/LOCAL_RANK", 30).group(1)
    assert os.path.isdir(memory)
    os.killpg(wrapped.pid, signal.SIGINT)          # the terminal's Ctrl-C: timeout and the agent both get it

    assert wrapped.wait(60) == 130, wrapped.output
    assert {p.name for p in out.iterdir()} >= {"interrupted-0", "interrupted-1"}, wrapped.output
    assert "forced exit" not in wrapped.output, wrapped.output
    assert "node-agent stopped by SIGINT" in wrapped.output, wrapped.output
    left = [e for e in job_events(cluster, "ctrl-c") if e["kind"] in ("node_left", "node_lost")]
    assert [e["kind"] for e in left] == ["node_left"], left
    assert left_in(tmp) == [], left_in(tmp)
    assert not os.path.exists(memory), memory


@pytest.mark.parametrize("source, said", [
    (None, "does not exist"),
    ("import os\nx = = 1\n", "does not compile, line 2: invalid syntax: x = = 1"),
])
def test_a_missing_or_broken_script_is_refused_before_the_node_joins(cluster, tmp_path, source, said):
    cluster.start_server()
    script = tmp_path / "train.py"
    if source is not None:
        script.write_text(source)
    agent = cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", "2", "--job-id", "typo",
                          str(script))
    assert agent.wait(60) == 2, agent.output
    lines = agent.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("node-agent: error: the script ") and said in lines[0], lines
    assert str(script.name) in lines[0]
    assert job_view(cluster, "typo", missing_ok=True) is None        # nothing joined, no round, no restart used


def test_an_unreachable_server_is_said_at_once(cluster, tmp_path):
    """Not 60 s of silence: the first failed try says where, and for how long it goes on trying."""
    agent = cluster.agent("--endpoint", "127.0.0.1:1", "--nnodes", "2", "--job-id", "away", "--server-wait", "600",
                          os.path.join(SCRIPTS, "sleeper.py"))
    agent.wait_for_line(r"cannot reach the rdzv-server at 127\.0\.0\.1:1; retrying for 600s \(.*; is an rdzv-server "
                        r"running there\? `rdzv-server --port PORT` on that host starts one\)", 30)
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(30) == 128 + signal.SIGTERM


def test_a_crash_with_dataloader_workers_alive_leaves_no_multiprocessing_directory(cluster, tmp_path):
    """The ranks the agent stops (SIGTERM to their process groups) die with their DataLoader workers,
    which would leave multiprocessing's pymp-* directories in TMPDIR for good; warm workers (the default).
    TMPDIR is short: a Unix socket's path (TMPDIR/pymp-X/listener-Y) must fit in 108 bytes."""
    tmp = tempfile.mkdtemp(prefix="na-", dir="/tmp")
    try:
        agent = cluster.agent("--standalone", "--nproc", "2", "--max-restarts", "1", DATALOADER_CRASH,
                              env={"HOLD": "1", "CRASH_RANK": "1", "CRASH_STEP": "3", "STEPS": "6", "TMPDIR": tmp})
        assert agent.wait(120) == 0, agent.output
        assert "crashes on purpose" in agent.output and "restart count 1/1" in agent.output, agent.output
        assert left_in(tmp) == [], left_in(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_local_rank_in_the_script_path_runs_each_ranks_script_as_torchrun(cluster, tmp_path):
    # torchrun substitutes ${local_rank} in the script's path as in its arguments; the check before joining did not
    for r in (0, 1):
        (tmp_path / f"part_{r}.py").write_text(f"import os\nprint('script {r} is rank', os.environ['RANK'])\n")
    agent = cluster.agent("--standalone", "--nproc-per-node", "2", str(tmp_path / "part_${local_rank}.py"))
    assert agent.wait(60) == 0, agent.output
    assert "script 0 is rank 0" in agent.output and "script 1 is rank 1" in agent.output, agent.output
