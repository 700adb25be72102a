"""End-to-end durability: the server is killed (-9) or stopped mid-job and started again on its
state dir; the job carries on without a single worker restarting. And when the server stays away
past the agents' window, they stop their workers and exit with a clear message.

Real server and agents on 127.0.0.1; gloo all-reduce workers (scripts/elastic_loop.py) log every
step, so the test sees which processes trained and whether they kept training while the server
was gone. Waits are on files and the server's JSON status, bounded; no test asserts a duration.
"""
from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.harness import SCRIPTS, job_events, job_view, pid_gone, read_jsonl, wait_until

pytestmark = pytest.mark.e2e
LOOP = os.path.join(SCRIPTS, "elastic_loop.py")
SLEEPER = os.path.join(SCRIPTS, "sleeper.py")
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")
LIMIT = 90.0


def start_agent(cluster, out, node, job, script, *extra, nproc=2):
    return cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", str(nproc), "--job-id", job,
                         "--node-id", node, *FAST, *extra, script, name=node,
                         env={"OUT_DIR": str(out), "NODE": node, "STEP_SLEEP": "0.05"})


def steps(out) -> list[dict]:
    return [r for r in read_jsonl(out, "steps-") if r["kind"] == "step"]


def kill_server(cluster) -> None:
    cluster.server.popen.send_signal(signal.SIGKILL)
    cluster.server.popen.wait(10)


def test_kill_9_and_restart_keeps_every_worker_and_the_round(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = cluster.start_server()
    agents = [start_agent(cluster, out, n, "durable", LOOP) for n in ("node-a", "node-b")]
    starts = wait_until(lambda: len(s := [r for r in read_jsonl(out, "steps-") if r["kind"] == "start"]) == 4 and s,
                        LIMIT, "4 workers up")
    pids = {r["pid"] for r in starts}
    before = job_view(cluster, "durable")
    assert before["state"] == "running" and len(before["nodes"]) == 2

    kill_server(cluster)
    # training goes on while the server is away: new all-reduce steps by all four workers
    seen = len(steps(out))
    wait_until(lambda: len(steps(out)) >= seen + 20, LIMIT, "training to go on while the server is down")

    cluster.start_server(port=port)
    after = wait_until(lambda: (v := job_view(cluster, "durable"))["nodes"] and
                       all(n["lease_age_s"] < 1.0 for n in v["nodes"]) and v, LIMIT, "both agents to reconnect")
    assert after["round_id"] == before["round_id"] and after["restart_count"] == before["restart_count"] == 0
    assert [n["node_id"] for n in after["nodes"]] == [n["node_id"] for n in before["nodes"]]
    restarted = [e for e in job_events(cluster, "durable") if e["kind"] == "server_restarted"]
    assert len(restarted) == 1 and "without a clean shutdown" in restarted[0]["message"]

    (out / "stop").touch()
    assert [a.wait(LIMIT) for a in agents] == [0, 0], "\n".join(a.output for a in agents)
    records = read_jsonl(out, "steps-")
    assert {r["pid"] for r in records} == pids, "a worker was restarted"
    assert sorted(r["rank"] for r in records if r["kind"] == "done") == [0, 1, 2, 3]
    assert job_view(cluster, "durable")["state"] == "succeeded"


def test_graceful_stop_and_a_failure_while_away_reported_on_return(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = cluster.start_server()
    agents = [start_agent(cluster, out, n, "away", SLEEPER, "--max-restarts", "3", nproc=1)
              for n in ("node-a", "node-b")]
    wait_until(lambda: all((out / f"pid-{r}").exists() for r in (0, 1)), LIMIT, "both workers up")
    before = job_view(cluster, "away")

    cluster.server.popen.send_signal(signal.SIGTERM)
    assert cluster.server.wait(30) == 0, cluster.server.output
    victim = int((out / "pid-1").read_text())
    os.kill(victim, signal.SIGKILL)            # a worker dies while nobody can be told
    assert pid_gone(victim, 10)

    cluster.start_server(port=port)
    view = wait_until(lambda: (v := job_view(cluster, "away"))["restart_count"] == 1 and v["state"] == "running"
                      and v, LIMIT, lambda: f"the failure to be reported: {job_view(cluster, 'away')}")
    assert view["round_id"] > before["round_id"]
    kinds = [e["kind"] for e in job_events(cluster, "away")]
    assert "server_restarted" in kinds and kinds.index("server_restarted") < kinds.index("worker_failed")
    restarted = next(e for e in job_events(cluster, "away") if e["kind"] == "server_restarted")
    assert "after a clean shutdown" in restarted["message"]
    failed = next(e for e in job_events(cluster, "away") if e["kind"] == "worker_failed")
    assert failed["data"]["signal"] == "SIGKILL" and failed["data"]["rank"] == 1
    for a in agents:
        a.popen.send_signal(signal.SIGTERM)
    assert all(a.wait(LIMIT) != 0 for a in agents)


def test_agents_give_up_when_the_server_stays_away_past_their_window(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cluster.start_server()
    agents = [start_agent(cluster, out, n, "gone", SLEEPER, "--server-wait", "4", nproc=1)
              for n in ("node-a", "node-b")]
    wait_until(lambda: all((out / f"pid-{r}").exists() for r in (0, 1)), LIMIT, "both workers up")
    workers = [int((out / f"pid-{r}").read_text()) for r in (0, 1)]
    kill_server(cluster)
    codes = [a.wait(LIMIT) for a in agents]
    assert all(code != 0 for code in codes), codes
    for a in agents:
        assert "rendezvous server unreachable for" in a.output and "limit 4s" in a.output, a.output
    assert all(pid_gone(pid, 10) for pid in workers), "workers outlived their agent"
    assert all((out / f"sigterm-{r}").exists() for r in (0, 1)), "workers were not stopped with SIGTERM"


@pytest.mark.parametrize("bad", ["corrupt", "not_a_dir"])
def test_server_refuses_a_bad_state_dir_with_one_clear_line(tmp_path, bad):
    import subprocess
    import sys

    from tests.e2e.harness import child_env
    if bad == "corrupt":
        state = tmp_path / "state"
        state.mkdir()
        (state / "rdzv-state.sqlite3").write_bytes(b"garbage" * 1000)
        expect = "file is not a database"
    else:
        (tmp_path / "file").write_text("x")
        state = tmp_path / "file" / "state"
        expect = "cannot use --state-dir"
    run = subprocess.run([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0",
                          "--state-dir", str(state)], capture_output=True, text=True, env=child_env(), timeout=60)
    assert run.returncode == 1 and expect in run.stderr, run.stderr
    assert "Traceback" not in run.stderr + run.stdout and "listening" not in run.stdout
    if bad == "corrupt":
        assert (state / "rdzv-state.sqlite3").read_bytes() == b"garbage" * 1000


def test_a_second_server_on_a_port_in_use_leaves_its_state_dir_untouched(tmp_path):
    # A review started a second server on a port in use: it loaded its state dir, logged the restored jobs,
    # recorded a server restart in them and marked a clean stop, and only then said the port was in use.
    import socket
    import subprocess
    import sys

    from rdzv_server.store.sqlite import SqliteStore
    from tests.e2e.harness import child_env
    from tests.unit.test_store import _save, every_state

    state = tmp_path / "state"
    store = SqliteStore(str(state))
    _save(store, every_state())
    store.release()
    before = {j: len(job.events) for j, job in SqliteStore(str(state)).load().jobs.items()}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port",
                              str(port), "--state-dir", str(state)],
                             capture_output=True, text=True, env=child_env(), timeout=60)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        f"rdzv-server: cannot listen on 127.0.0.1:{port}: Address already in use"], run.stderr
    loaded = SqliteStore(str(state)).load()
    assert {j: len(job.events) for j, job in loaded.jobs.items()} == before and not loaded.clean_shutdown
