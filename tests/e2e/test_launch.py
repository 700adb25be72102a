"""End-to-end: a real server, real agents, real gloo workers on 127.0.0.1."""
from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.harness import SCRIPTS, job_view, pid_gone, read_records
from tests.ports import free_port
from tests.tcpstore import tcp_store

pytestmark = pytest.mark.e2e
ALLREDUCE = os.path.join(SCRIPTS, "allreduce.py")
SLEEPER = os.path.join(SCRIPTS, "sleeper.py")
ECHO = os.path.join(SCRIPTS, "echo_env.py")


def two_agents(cluster, out, *, max_restarts=0, env=None, job="job", script=ALLREDUCE, nproc="2"):
    env = {"OUT_DIR": str(out), **(env or {})}
    return [cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", nproc, "--job-id", job,
                          "--max-restarts", str(max_restarts), "--node-id", name, script,
                          name=name, env=env)
            for name in ("node-a", "node-b")]


def test_two_agents_run_a_gloo_allreduce_with_torchruns_environment(cluster, tmp_path):
    cluster.start_server()
    agents = two_agents(cluster, tmp_path, env={"OMP_NUM_THREADS": None})     # unset: the agent's rule sets it
    for a in agents:
        assert a.wait() == 0, a.output
    records = read_records(tmp_path)
    assert sorted(int(r["env"]["RANK"]) for r in records) == [0, 1, 2, 3]
    assert {r["sum"] for r in records} == {10.0}          # 1+2+3+4: every rank took part
    masters = {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in records}
    assert len(masters) == 1 and next(iter(masters))[0] == "127.0.0.1"
    for r in records:
        env = r["env"]
        rank, local = int(env["RANK"]), int(env["LOCAL_RANK"])
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_WORLD_SIZE"] == "2"
        assert int(env["GROUP_RANK"]) * 2 + local == rank
        assert env["ROLE_RANK"] == env["RANK"] and env["ROLE_WORLD_SIZE"] == "4" and env["ROLE_NAME"] == "default"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        # the script imports torch: the group-rank-0 agent hosts the c10d store (workers/warm/store_host.py)
        assert env["TORCHELASTIC_RUN_ID"] == "job" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["OMP_NUM_THREADS"] == "1"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
    assert cluster.get("/v1/jobs/job")["state"] == "succeeded"


def test_worker_crashing_once_restarts_every_node_with_restart_count_one(cluster, tmp_path):
    cluster.start_server()
    agents = two_agents(cluster, tmp_path, max_restarts=2, env={"FAIL_RANK": "3", "FAIL_MODE": "once"})
    for a in agents:
        assert a.wait() == 0, a.output
    records = read_records(tmp_path)
    assert sorted(int(r["env"]["RANK"]) for r in records) == [0, 1, 2, 3]
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in records} == {"1"}
    job = cluster.get("/v1/jobs/job")
    assert job["state"] == "succeeded" and job["restart_count"] == 1


def test_always_failing_worker_fails_the_job_and_every_agent_prints_the_same_root_cause(cluster, tmp_path):
    cluster.start_server()
    agents = two_agents(cluster, tmp_path, max_restarts=1, env={"FAIL_RANK": "1", "FAIL_MODE": "always"})
    codes = [a.wait() for a in agents]
    assert all(c != 0 for c in codes), [a.output for a in agents]
    causes = []
    for a in agents:
        assert "root cause" in a.output, a.output
        causes.append([ln.split("]", 1)[1] for ln in a.output.splitlines()
                       if "rank      :" in ln or "error     :" in ln])
    assert causes[0] == causes[1] and causes[0], causes
    assert "planned failure of rank 1" in "\n".join(causes[0])
    job = cluster.get("/v1/jobs/job")
    assert job["state"] == "failed" and job["restart_count"] == 2 and job["root_cause"]["rank"] == 1


def _wait_pids(tmp_path, ranks, proc):
    for r in ranks:
        proc.wait_for_line(rf"worker {r} ready pid (\d+)")
    return {r: int(open(tmp_path / f"pid-{r}").read()) for r in ranks}


def test_sigkilled_agent_leaves_no_worker_behind(cluster, tmp_path):
    cluster.start_server()
    agent = cluster.agent("--endpoint", cluster.endpoint(), "--nproc", "2", "--job-id", "k", SLEEPER,
                          env={"OUT_DIR": str(tmp_path)})
    pids = _wait_pids(tmp_path, [0, 1], agent)
    os.kill(agent.pid, signal.SIGKILL)
    for pid in pids.values():
        assert pid_gone(pid, timeout=10), f"worker {pid} outlived its SIGKILLed agent"


def test_sigterm_to_agent_is_forwarded_to_workers_and_the_agent_leaves(cluster, tmp_path):
    cluster.start_server()
    agent = cluster.agent("--endpoint", cluster.endpoint(), "--nproc", "2", "--job-id", "t", SLEEPER,
                          env={"OUT_DIR": str(tmp_path)})
    pids = _wait_pids(tmp_path, [0, 1], agent)
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(30) == 128 + signal.SIGTERM
    for rank, pid in pids.items():
        assert (tmp_path / f"sigterm-{rank}").read_text() == str(pid)
        assert pid_gone(pid, timeout=10)
    events = cluster.get("/v1/jobs/t/events")["events"]
    assert any(e["kind"] == "node_left" for e in events)


def test_standalone_runs_a_single_node_job_without_a_server(cluster, tmp_path):
    agent = cluster.agent("--standalone", "--nproc", "2", ALLREDUCE, env={"OUT_DIR": str(tmp_path)})
    assert agent.wait() == 0, agent.output
    assert sorted(int(r["env"]["RANK"]) for r in read_records(tmp_path)) == [0, 1]


def test_bad_flags_and_unreachable_server_give_one_clear_line(cluster, tmp_path):
    bad = cluster.agent("--nproc", "zero", "--endpoint", "127.0.0.1:1", SLEEPER)
    assert bad.wait() == 2
    assert "--nproc" in bad.output and "Traceback" not in bad.output
    gone = cluster.agent("--endpoint", "127.0.0.1:1", "--server-wait", "1", "--lease-timeout", "1", SLEEPER)
    assert gone.wait() == 1
    assert "unreachable" in gone.output and "Traceback" not in gone.output


def test_an_endpoint_where_a_c10d_store_listens_is_one_clear_line_at_once(cluster, tmp_path):
    """A torchrun-style line whose endpoint is a c10d TCPStore: refused as such, not waited on for
    --server-wait (600 s here: the agent's exit within the bound is the proof) as "unreachable"."""
    with tcp_store() as port:
        agent = cluster.agent("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "2",
                              "--server-wait", "600", "--job-id", "store", SLEEPER)
        assert agent.wait(60) == 1, agent.output
    lines = [line for line in agent.output.splitlines() if "TCPStore" in line]
    assert len(lines) == 1 and f"127.0.0.1:{port} is not an rdzv-server: a c10d TCPStore" in lines[0], agent.output
    assert "unreachable" not in agent.output and "Traceback" not in agent.output


def test_log_dir_holds_torchruns_layout_fresh_for_every_run(cluster, tmp_path):
    logs = tmp_path / "logs"
    out = tmp_path / "out"
    out.mkdir()
    runs = []
    for _ in range(2):      # the same command twice: a directory of its own each time
        agent = cluster.agent("--standalone", "--nproc", "2", "--job-id", "logjob", "--node-id", "n1",
                              "--log-dir", str(logs), "--redirects", "3", "--max-restarts", "1", ALLREDUCE,
                              env={"OUT_DIR": str(out), "FAIL_RANK": "1", "FAIL_MODE": "once"})
        assert agent.wait() == 0, agent.output
        assert "planned failure" not in agent.output   # redirected (-r 3): it stayed off the console
        runs.append(agent)
        for f in out.iterdir():
            f.unlink()
    run_dirs = sorted(logs.iterdir())
    assert len(run_dirs) == 2 and all(d.name.startswith("logjob_") for d in run_dirs)
    # each run says which directory is its own (torchrun's failure summary names the error file's path)
    said = sorted(agent.wait_for_line(r"worker logs and error files are in (\S+)").group(1) for agent in runs)
    assert said == [str(d) for d in run_dirs]
    for run in run_dirs:     # LOG_DIR/ID_XXXXXXXX/attempt_RESTART_COUNT/LOCAL_RANK/
        # and store/attempt_N/: the agent's c10d store host (the script imports torch), not among the ranks
        assert sorted(p.name for p in run.iterdir()) == ["attempt_0", "attempt_1", "store"]
        for attempt in ("attempt_0", "attempt_1"):
            assert sorted(p.name for p in (run / attempt).iterdir()) == ["0", "1"]
            for local_rank in ("0", "1"):
                rank_dir = run / attempt / local_rank
                assert (rank_dir / "stdout.log").exists() and (rank_dir / "stderr.log").exists()
        error = (run / "attempt_0" / "1" / "error.json").read_text()
        assert "planned failure of rank 1" in error                      # torch's @record wrote it
        assert "planned failure" in (run / "attempt_0" / "1" / "stderr.log").read_text()
        assert "planned failure" not in (run / "attempt_1" / "1" / "stderr.log").read_text()


def test_a_temporary_run_directory_goes_at_exit_unless_it_holds_an_error_file(cluster, tmp_path):
    """Without --log-dir the agent makes its run directory in TMPDIR: removed when the agent exits
    (done, or stopped by SIGTERM) with nothing in it to read; kept, and its path said, with a worker's
    error file. (The harness points every agent's TMPDIR into its test's tmp_path, where one killed
    at teardown leaves its directory: this test is what checks the agent's own clean-up.)"""
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    out.mkdir()
    env = {"OUT_DIR": str(out), "TMPDIR": str(tmp)}
    done = cluster.agent("--standalone", "--nproc-per-node", "2", ECHO, env=env)
    assert done.wait() == 0, done.output
    assert list(tmp.iterdir()) == [] and "kept in" not in done.output, done.output
    go = out / "go"
    stopped = cluster.agent("--standalone", "--nproc-per-node", "1", ECHO, env={**env, "WAIT_FILE": str(go)})
    stopped.wait_for_line("rank 0 waiting for", 60)
    assert [p.name.startswith("node-agent_") for p in tmp.iterdir()] == [True]      # while it runs
    stopped.popen.send_signal(signal.SIGTERM)
    assert stopped.wait() != 0
    assert list(tmp.iterdir()) == [], stopped.output
    failed = cluster.agent("--standalone", "--nproc-per-node", "2", "--max-restarts", "0", ECHO,
                           env={**env, "EXIT_RANK": "1", "EXIT_CODE": "3"})
    assert failed.wait() != 0
    kept = failed.wait_for_line(r"worker logs and error files are kept in (\S+)").group(1)
    assert [str(p) for p in tmp.iterdir()] == [os.path.dirname(kept)], kept
    with open(os.path.join(kept, "attempt_0", "1", "error.json")) as f:
        assert "rank 1 gives up" in f.read()


def test_redirects_without_a_log_dir_hide_the_output_in_a_kept_temporary_directory(cluster, tmp_path):
    agent = cluster.agent("--nproc-per-node", "2", "-r", "3", ECHO,
                          env={"OUT_DIR": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert agent.wait() == 0, agent.output
    kept = agent.wait_for_line(r"worker logs and error files are kept in (\S+)").group(1)
    assert "hello" not in agent.output                                # no worker line reached the console
    assert len(read_records(tmp_path)) == 2
    assert kept.startswith(str(tmp_path))                          # torchrun's place: TMPDIR
    with open(os.path.join(kept, "attempt_0", "1", "stdout.log")) as f:
        assert f.read() == "hello stdout from rank 1\n"


def test_the_tutorials_one_node_c10d_line_runs_in_process_when_nothing_listens(cluster, tmp_path):
    """`--nnodes 1 --rdzv-backend c10d --rdzv-endpoint localhost:PORT`: torchrun's agent hosts that rendezvous
    itself; where nothing listens there, so does node-agent (said once), not 60 s of retries and an exit 1. With
    an rdzv-server there, the job is the server's."""
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    line = ["--nnodes", "1", "--nproc", "2", "--rdzv-backend", "c10d", "--rdzv-id", "tutorial"]
    alone = cluster.agent(*line, "--rdzv-endpoint", f"localhost:{free_port()}", str(script))
    assert alone.wait(60) == 0, alone.output
    assert "the job has one node: the rendezvous runs in this agent" in alone.output
    assert "cannot reach" not in alone.output
    cluster.start_server()
    served = cluster.agent(*line, "--rdzv-endpoint", cluster.endpoint(), str(script))
    assert served.wait(60) == 0, served.output
    assert "runs in this agent" not in served.output
    assert job_view(cluster, "tutorial")["state"] == "succeeded"
