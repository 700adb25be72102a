"""Unchanged `torchrun --rdzv-backend rdzv-server` agents against a real rdzv-server on 127.0.0.1.

Each test starts the server (`--port 0 --state-dir none`) and torchrun agents as the user would
(the `torchrun` console script; torch finds the plugin through its entry point), with gloo
all-reduce workers (scripts/steps.py) that log every step, so a test sees which world each worker
ran in. Waits are on a worker's log or the server's JSON status, bounded; nothing asserts a time.
Every agent and worker is killed at teardown, orphans of a SIGKILLed agent included.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import urllib.request
from collections import defaultdict

import psutil
import pytest

from tests.e2e.harness import Proc, child_env, job_events, job_view, read_jsonl, wait_until
from tests.tcpstore import tcp_store

pytestmark = pytest.mark.e2e
STEPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "steps.py")
_console = os.path.join(os.path.dirname(sys.executable), "torchrun")
TORCHRUN = [_console] if os.path.exists(_console) else [sys.executable, "-m", "torch.distributed.run"]
FAST = "lease_timeout=3,last_call_timeout=1"   # quick node loss and elastic rounds on a loaded machine
LIMIT = 90.0


def torchrun(cluster, out, node: str, *, job: str, nnodes: str, nproc: int = 1, max_restarts: int = 3,
             conf: str = FAST, env: dict[str, str] | None = None, node_id: bool = True) -> Proc:
    """A torchrun agent; its node id at the server is `node` (with node_id), else torch's HOST-PID default."""
    conf = f"{conf},node_id={node}" if node_id else conf
    argv = [*TORCHRUN, "--rdzv-backend", "rdzv-server", "--rdzv-endpoint", cluster.endpoint(), "--rdzv-id", job,
            "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.1", "--rdzv-conf", conf, STEPS]
    # torchrun makes a torchelastic_* log directory in TMPDIR at every run and never removes it
    proc = Proc(argv, child_env(OUT_DIR=str(out), NODE=node, TMPDIR=cluster.temp_dir(), **(env or {})), node)
    cluster.procs.append(proc)
    return proc


def worlds(out) -> dict[tuple, list[dict]]:
    """Worker lines grouped by the world they ran in: (master addr, master port, world size)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for rec in read_jsonl(out, "steps-"):
        groups[(rec["env"]["MASTER_ADDR"], rec["env"]["MASTER_PORT"], rec["world"])].append(rec)
    return groups


def wait_world(out, *, world: int, nodes: set[str], exclude=(), what: str = "") -> tuple[tuple, list[dict]]:
    """Wait until every rank 0..world-1 of one world, on exactly `nodes`, has done an all-reduce step."""
    def ready():
        for key, recs in worlds(out).items():
            steps = [r for r in recs if r["kind"] == "step"]
            if key not in exclude and key[2] == world and {r["rank"] for r in steps} == set(range(world)) \
                    and {r["node"] for r in recs} == nodes:
                return key, recs
        return None

    def state():
        seen = {k: sorted({(r["node"], r["rank"]) for r in v}) for k, v in worlds(out).items()}
        return f"a world of size {world} on {sorted(nodes)} {what}; worker worlds so far: {seen}"
    return wait_until(ready, LIMIT, state)


def assert_clean_world(recs: list[dict], world: int) -> None:
    """Every rank of the world took part in every step, and they all saw the same job-wide count."""
    assert {r["sum"] for r in recs if r["kind"] == "step"} == {float(world)}
    assert len({r["env"]["RDZV_SERVER_RESTART_COUNT"] for r in recs}) == 1, recs
    assert {r["env"]["TORCHELASTIC_USE_AGENT_STORE"] for r in recs} == {"False"}


def stop_job(out) -> None:
    (out / "stop").write_text("stop")


def proc_exit(proc: Proc) -> int:
    return proc.wait(LIMIT)


def test_two_agents_recover_from_a_worker_crash_with_the_job_wide_count(cluster, tmp_path):
    cluster.start_server("--state-dir", "none")
    out = tmp_path / "out"
    out.mkdir()
    crash = {"FAIL_RANK": "3", "FAIL_STEP": "2", "FAIL_ONCE": str(tmp_path / "crashed"), "STEPS": "8"}
    agents = [torchrun(cluster, out, node, job="crash", nnodes="2", nproc=2, max_restarts=2, env=crash,
                       node_id=False) for node in ("a", "b")]

    codes = [proc_exit(p) for p in agents]
    assert codes == [0, 0], "\n\n".join(p.output for p in agents)
    first, _ = wait_world(out, world=4, nodes={"a", "b"}, what="(before the crash)")
    second, recs = wait_world(out, world=4, nodes={"a", "b"}, exclude={first}, what="(after the crash)")
    assert_clean_world(recs, 4)
    assert {r["env"]["RDZV_SERVER_RESTART_COUNT"] for r in recs} == {"1"}
    assert sorted(r["rank"] for r in recs if r["kind"] == "done") == [0, 1, 2, 3]
    # torch's own count is per agent: the crashed node's agent restarted once
    crashed_node = next(r["node"] for r in recs if r["rank"] == 3)
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in recs if r["node"] == crashed_node} == {"1"}

    job = job_view(cluster, "crash")
    assert (job["state"], job["restart_count"], job["max_restarts"]) == ("succeeded", 1, 2), job
    assert job["world_size"] == 4 and {n["local_world_size"] for n in job["nodes"]} == {2}
    assert job["last_failure"]["exitcode"] != 0, job["last_failure"]
    causes = [e["data"]["cause"] for e in job_events(cluster, "crash") if e["kind"] == "round_completed"]
    assert causes == ["start", "failure"], causes
    with urllib.request.urlopen(f"http://{cluster.endpoint()}/", timeout=10) as resp:
        page = resp.read().decode()
    assert 'data-job="crash"' in page and re.search(r">\s*1 / 2\s*<", page), page


def test_the_agents_listeners_answer_on_its_local_addr_alone(cluster, tmp_path):
    """A review: the plugin's agent store (a TCPStore inside torchrun's own process, which authenticates nobody)
    listened on every interface, a management network's too. It listens on --local-addr where that is this host's
    address, as node-agent's store does, and so does the witness port."""
    cluster.start_server("--state-dir", "none")
    out = tmp_path / "out"
    out.mkdir()
    agent = torchrun(cluster, out, "a", job="bound", nnodes="1")
    wait_world(out, world=1, nodes={"a"})
    listening = [c.laddr for c in psutil.Process(agent.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 2 and {a.ip for a in listening} == {"127.0.0.1"}, listening
    stop_job(out)
    assert proc_exit(agent) == 0, agent.output


def test_a_node_joining_later_grows_the_job(cluster, tmp_path):
    cluster.start_server("--state-dir", "none")
    out = tmp_path / "out"
    out.mkdir()
    a = torchrun(cluster, out, "a", job="grow", nnodes="1:2")
    alone, _ = wait_world(out, world=1, nodes={"a"}, what="(a alone)")
    b = torchrun(cluster, out, "b", job="grow", nnodes="1:2")
    _, recs = wait_world(out, world=2, nodes={"a", "b"}, exclude={alone}, what="(after b joined)")
    assert_clean_world(recs, 2)
    stop_job(out)
    assert [proc_exit(a), proc_exit(b)] == [0, 0], a.output + "\n\n" + b.output

    job = job_view(cluster, "grow")
    assert (job["state"], job["restart_count"], job["world_size"]) == ("succeeded", 0, 2), job
    causes = [e["data"]["cause"] for e in job_events(cluster, "grow") if e["kind"] == "round_completed"]
    assert causes == ["start", "scale_up"], causes


def test_survivor_goes_on_when_a_torchrun_agent_is_sigkilled(cluster, tmp_path):
    cluster.start_server("--state-dir", "none")
    out = tmp_path / "out"
    out.mkdir()
    a = torchrun(cluster, out, "a", job="loss", nnodes="1:2")
    b = torchrun(cluster, out, "b", job="loss", nnodes="1:2")
    wait_world(out, world=2, nodes={"a", "b"}, what="(both nodes)")
    before = set(worlds(out))       # a may have run alone first (b's import seconds behind on a loaded machine)
    b.remember_descendants()        # its workers outlive a SIGKILLed torchrun agent: kill them at teardown
    os.kill(b.pid, signal.SIGKILL)

    _, recs = wait_world(out, world=1, nodes={"a"}, exclude=before, what="(after b's agent was killed)")
    assert_clean_world(recs, 1)
    assert [n["node_id"] for n in job_view(cluster, "loss")["nodes"]] == ["a"]
    lost = [e["node_id"] for e in job_events(cluster, "loss") if e["kind"] == "node_lost"]
    assert lost == ["b"]
    stop_job(out)
    assert proc_exit(a) == 0, a.output
    job = job_view(cluster, "loss")
    assert (job["state"], job["restart_count"], job["world_size"]) == ("succeeded", 0, 1), job


def test_exhausted_budget_fails_the_job_and_stops_every_agent(cluster, tmp_path):
    cluster.start_server("--state-dir", "none")
    out = tmp_path / "out"
    out.mkdir()
    env = {"FAIL_RANK": "1", "FAIL_ALWAYS": "1"}
    agents = [torchrun(cluster, out, node, job="doomed", nnodes="2", max_restarts=1, env=env) for node in ("a", "b")]
    codes = [p.wait(LIMIT) for p in agents]
    assert all(code != 0 for code in codes), "\n\n".join(p.output for p in agents)
    job = job_view(cluster, "doomed")
    assert (job["state"], job["restart_count"]) == ("failed", 2), job
    assert "exceeded max_restarts=1" in job["reason"], job
    assert "fails on purpose" in job["root_cause"]["message"], job["root_cause"]


def test_a_node_that_finished_leaves_when_another_fails_after_it(cluster, tmp_path):
    """torch's agent never restarts workers that succeeded: a finished node cannot join the round a
    later failure starts. It leaves at once (not after torch's 5-minute exit barrier), exits non-zero,
    and the others go on without it."""
    cluster.start_server("--state-dir", "none")
    out = tmp_path / "out"
    out.mkdir()
    env = {"FAIL_RANK": "1", "FAIL_STEP": "end", "FAIL_ONCE": str(tmp_path / "failed"), "STEPS": "4",
           "JOB_URL": f"http://{cluster.endpoint()}/v1/jobs/late"}   # fail once the other node reported success
    slow = "lease_timeout=3,last_call_timeout=15"      # both in the first round, however far apart their imports
    a = torchrun(cluster, out, "a", job="late", nnodes="1:2", env=env, conf=slow)
    b = torchrun(cluster, out, "b", job="late", nnodes="1:2", env=env, conf=slow)
    # rank 1 is whichever node joined second; its node fails after the other one's workers finished
    first, _ = wait_world(out, world=2, nodes={"a", "b"})
    failing = next(r["node"] for r in worlds(out)[first] if r["rank"] == 1)
    finishing, other = (a, b) if failing == "b" else (b, a)
    assert proc_exit(finishing) == 1, finishing.output
    assert "torchrun's agent cannot run them again, so this node left the job" in finishing.output
    assert proc_exit(other) == 0, other.output
    job = job_view(cluster, "late")
    events = [(e["kind"], e.get("node_id"), e.get("data")) for e in job_events(cluster, "late")]
    assert (job["state"], job["restart_count"], job["world_size"]) == ("succeeded", 1, 1), (job, events)
    left = [e["node_id"] for e in job_events(cluster, "late") if e["kind"] == "node_left"]
    assert left == [finishing.name]


def run_alone(args: list[str], tmp_path) -> tuple[int, str]:
    proc = Proc([*TORCHRUN, *args, STEPS], child_env(OUT_DIR=str(tmp_path), TMPDIR=str(tmp_path)), "torchrun")
    try:
        return proc.wait(LIMIT), proc.output
    finally:
        proc.kill_all()


def test_a_bad_rdzv_conf_value_is_one_clear_line(tmp_path):
    code, output = run_alone(["--rdzv-backend", "rdzv-server", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "j",
                              "--rdzv-conf", "join_timeout=soon"], tmp_path)
    assert code == 2, output
    assert "--rdzv-conf join_timeout: expected a number of seconds, got 'soon'" in output, output
    assert "Traceback" not in output, output


def test_an_endpoint_where_a_c10d_store_listens_is_one_clear_line(tmp_path):
    with tcp_store() as port:     # server_wait=600: the exit within run_alone's bound is the proof it did not wait
        code, output = run_alone(["--rdzv-backend", "rdzv-server", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                  "--rdzv-id", "j", "--rdzv-conf", "server_wait=600"], tmp_path)
    assert code != 0, output
    assert f"127.0.0.1:{port} is not an rdzv-server: a c10d TCPStore answers there" in output, output
    assert "Traceback" not in output, output


def test_an_unreachable_endpoint_is_one_clear_line(tmp_path):
    import socket
    with socket.socket() as s:    # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, output = run_alone(["--rdzv-backend", "rdzv-server", "--rdzv-endpoint", f"127.0.0.1:{port}",
                              "--rdzv-id", "j", "--rdzv-conf", "server_wait=1,lease_timeout=1"], tmp_path)
    assert code == 1, output
    assert f"cannot reach the rdzv-server at 127.0.0.1:{port}" in output, output
    assert "Traceback" not in output, output


def test_a_script_failing_at_start_on_every_node_excludes_none(cluster, tmp_path):
    """An ImportError on every node is the script's error, not a node's: torch's workers carry node-agent's probe, so
    each node's report says its workers failed before their process group, as node-agent's do, and the server
    excludes no node one by one (with --exclude-after 2, 4 restarts counted on 3 nodes would exclude one). The
    budget ends the job, whose reason says so; every agent exits non-zero, its workers' error in its output.
    The first round waits for all 3 (max_nodes ends the last call): an agent slow to start must not miss the job."""
    events = fail_at_start_everywhere(cluster, tmp_path, "import no_such_module_h69\n",
                                      "ModuleNotFoundError: No module named 'no_such_module_h69'")
    assert not [e for e in events if e[0] in ("node_excluded", "node_suspect")], events


def test_a_suspect_exit_code_at_start_on_every_node_leaves_no_node_a_suspect(cluster, tmp_path):
    """sys.exit(17) (a default suspect exit code) before init_process_group on every node: round 1's first report
    comes before any other node's, so its node is made a suspect; the others' reports say it is the script's
    exit, and that suspicion is taken back (else its next real one, within the window, excluded it)."""
    events = fail_at_start_everywhere(cluster, tmp_path, "import sys\nprint('exiting 17 at start')\nsys.exit(17)\n",
                                      "exiting 17 at start")
    suspected = {m.split()[1] for k, m in events if k == "node_suspect"}
    cleared = {m.split()[1] for k, m in events if k == "node_not_excluded" and "no longer a suspect" in m}
    assert not [e for e in events if e[0] == "node_excluded"] and suspected <= cleared, events
    assert not [n for n in job_view(cluster, "broken")["nodes"] if n.get("suspicions")], events


def fail_at_start_everywhere(cluster, tmp_path, source: str, said: str) -> list[tuple[str, str]]:
    """3 torchrun agents (2 workers each, --nnodes 1:3) run a script failing at start (`source`) until the budget
    (4 restarts) ends the job, which says why; each exits non-zero, `said` in its output. Returns the job's events."""
    cluster.start_server("--state-dir", "none")
    script = tmp_path / "broken.py"
    script.write_text(source)
    conf = "lease_timeout=3,last_call_timeout=15,exclude_after=2"
    agents = []
    for node in ("a", "b", "c"):
        argv = [*TORCHRUN, "--rdzv-backend", "rdzv-server", "--rdzv-endpoint", cluster.endpoint(), "--rdzv-id",
                "broken", "--nnodes", "1:3", "--nproc-per-node", "2", "--max-restarts", "4", "--monitor-interval",
                "0.1", "--rdzv-conf", f"{conf},node_id={node}", str(script)]
        agents.append(Proc(argv, child_env(NODE=node, TMPDIR=cluster.temp_dir()), node))
        cluster.procs.append(agents[-1])

    codes = [proc_exit(p) for p in agents]
    job = job_view(cluster, "broken")
    events = [(e["kind"], e["message"]) for e in job_events(cluster, "broken")]
    assert job["state"] == "failed", job
    assert "exceeded max_restarts=4 (the workers failed at start, before their process group, on " in job["reason"], \
        job["reason"]
    for code, p in zip(codes, agents, strict=True):
        assert code != 0 and said in p.output, p.output
    return events


def test_a_job_failing_while_torch_would_restart_is_one_line_on_every_agent(cluster, tmp_path):
    """A review: torch's agent, with restarts of its own left (--max-restarts 2), asked for a new round; the server's
    budget (max_restarts=1) had ended the job, and next_rendezvous raised RendezvousClosedError, which torchrun
    prints in full: a traceback through handler.py on every agent. Each now says the job's end in one line, exit 1."""
    cluster.start_server("--state-dir", "none")
    script = tmp_path / "exit17.py"
    script.write_text("import sys\nsys.exit(17)\n")
    agents = []
    for node in ("a", "b"):
        argv = [*TORCHRUN, "--rdzv-backend", "rdzv-server", "--rdzv-endpoint", cluster.endpoint(), "--rdzv-id",
                "over", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2", "--monitor-interval", "0.1",
                "--rdzv-conf", f"{FAST},max_restarts=1,node_id={node}", str(script)]
        agents.append(Proc(argv, child_env(NODE=node, TMPDIR=cluster.temp_dir()), node))
        cluster.procs.append(agents[-1])
    codes = [proc_exit(p) for p in agents]
    assert job_view(cluster, "over")["state"] == "failed"
    for code, p in zip(codes, agents, strict=True):
        assert code == 1, p.output
        assert "Traceback" not in p.output and "RendezvousClosedError" not in p.output, p.output
        # the second report of round 2 may find the job failed by the first: its reply names the cause too
        said = f"[rdzv-server plugin {p.name}] job 'over' failed"
        line = next(x for x in p.output.splitlines() if x.startswith(said))
        assert "worker failures exceeded max_restarts=1" in line, p.output
