"""End-to-end: `rdzv-ctl` against a real server with real agents running a job.

The command is run as a user would (the installed console script, else `python -m`), and each
test checks both what it prints and what the server's JSON then says. Waits are bounded polls of
the JSON API or process exits; nothing sleeps to synchronise.
"""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import urllib.request

import msgpack
import pytest

from tests.e2e.certs import make_ca, make_server_cert
from tests.e2e.harness import SCRIPTS, Proc, child_env, job_view, pid_gone, read_records, wait_until

pytestmark = pytest.mark.e2e
WORKER = os.path.join(SCRIPTS, "chaos_worker.py")     # plain python: records its round, idles
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")
LIMIT = 60.0
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "rdzv-ctl")
FAKE_DNS = os.path.join(SCRIPTS, "fake_dns.py")      # a name for 127.0.0.1 that is not the server's own
SERVICE = "rdzv-server.ns.svc"


def ctl(cluster, *args: str, expect: int = 0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [CONSOLE_SCRIPT] if os.access(CONSOLE_SCRIPT, os.X_OK) else [sys.executable, "-m", "rdzv_ctl.cli"]
    child = child_env(RDZV_SERVER=f"{cluster.scheme}://{cluster.endpoint()}")
    for name in ("RDZV_TOKEN_FILE", "RDZV_ADMIN_TOKEN_FILE"):    # only the token files the test gives
        child.pop(name, None)
    child.update(env or {})
    done = subprocess.run([*argv, *args], capture_output=True, text=True, env=child, timeout=60)
    assert done.returncode == expect, f"rdzv-ctl {' '.join(args)} exited {done.returncode}:\n" \
                                      f"{done.stdout}\n{done.stderr}"
    return done


def start_agents(cluster, out, job: str, names: tuple[str, ...], nnodes: str):
    return {name: cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", nnodes, "--nproc", "1",
                                "--job-id", job, "--max-restarts", "3", "--node-id", name, *FAST, WORKER,
                                name=name, env={"OUT_DIR": str(out), "NODE": name})
            for name in names}


def wait_members(cluster, job: str, members: list[str], min_round: int = 1) -> dict:
    """Wait until the job runs a round of exactly `members` (in any order: agents race to join)."""
    def ready():
        view = job_view(cluster, job, missing_ok=True)
        if not view or view["state"] != "running" or (view["round_id"] or 0) < min_round:
            return None
        if sorted(n["node_id"] for n in view["nodes"]) != sorted(members):
            return None
        return view
    return wait_until(ready, LIMIT, lambda: f"job {job} running with {members}: {job_view(cluster, job, True)}")


def test_status_events_drain_and_close_through_rdzv_ctl(cluster, tmp_path):
    cluster.start_server()
    agents = start_agents(cluster, tmp_path, "ctljob", ("node-a", "node-b", "node-c"), "2:3")
    view = wait_members(cluster, "ctljob", ["node-a", "node-b", "node-c"])
    first_round = view["round_id"]
    wait_until(lambda: len([r for r in read_records(tmp_path) if r["world"] == 3]) >= 3, LIMIT,
               "three workers of the 3-node round started")

    status = ctl(cluster, "status").stdout
    header, *rows = status.splitlines()
    assert header.split() == ["JOB", "STATE", "ROUND", "WORLD", "NODES", "RESTARTS", "SPARES", "EXCLUDED", "STEPS/S",
                              "ETTR", "REASON"]
    (row,) = [r for r in rows if r.startswith("ctljob")]
    assert row.split()[:8] == ["ctljob", "running", str(first_round), "3", "3", "(2:3)", "0/3", "0"]
    assert header.index("STATE") == row.index("running")          # columns line up

    detail = ctl(cluster, "job", "ctljob").stdout
    assert "state      running" in detail and "RANK  NODE" in detail
    ranks = {line.split()[1]: int(line.split()[0]) for line in detail.splitlines() if line[:1].isdigit()}
    assert ranks == {n["node_id"]: n["group_rank"] for n in view["nodes"]}

    drained = ctl(cluster, "drain", "ctljob", "node-c", "--reason", "bad disk").stdout
    assert drained.startswith("drained node node-c from job ctljob")
    assert sorted(line.split()[1] for line in drained.splitlines() if line[:1].isdigit()) == ["node-a", "node-b"]
    assert agents["node-c"].wait(LIMIT) == 0, agents["node-c"].output       # drained: exits 0
    for rec in [r for r in read_records(tmp_path) if r["node"] == "node-c"]:
        assert pid_gone(rec["pid"], 10), f"worker {rec['pid']} of the drained node still runs"
    places = [n["node_id"] for n in sorted(view["nodes"], key=lambda n: n["group_rank"])]
    order = [n for n in places if n != "node-c"]
    if places[-1] != "node-c":                  # the last node moves into node-c's place; the other keeps its rank
        order.insert(places.index("node-c"), order.pop())
    view = wait_members(cluster, "ctljob", ["node-a", "node-b"], min_round=first_round + 1)
    assert view["restart_count"] == 0 and view["world_size"] == 2
    assert [n["node_id"] for n in sorted(view["nodes"], key=lambda n: n["group_rank"])] == order

    events = ctl(cluster, "events", "ctljob").stdout.splitlines()
    assert events[0].split() == ["TIME", "KIND", "NODE", "ROUND", "MESSAGE"]
    (drain_line,) = [e for e in events if " node_drained " in e]
    assert "node-c" in drain_line and "bad disk" in drain_line
    assert drain_line[2] == ":" and drain_line[5] == ":" and drain_line[8] == "."     # HH:MM:SS.mmm
    last_two = ctl(cluster, "events", "ctljob", "--last", "2").stdout.splitlines()
    assert len(last_two) == 3 and last_two[1:] == events[-2:]
    refused = ctl(cluster, "job", "nosuch", expect=1)
    assert refused.stdout == "" and len(refused.stderr.strip().splitlines()) == 1
    assert cluster.endpoint() in refused.stderr and "no job 'nosuch'" in refused.stderr

    closed = ctl(cluster, "close", "ctljob", "--reason", "end of test").stdout
    assert closed.startswith("closed job ctljob") and "state      closed" in closed
    for name in ("node-a", "node-b"):
        code = agents[name].wait(LIMIT)
        assert code != 0 and "closed" in agents[name].output, agents[name].output
    final = job_view(cluster, "ctljob")
    assert final["state"] == "closed" and "end of test" in final["reason"]
    assert "job_closed" in ctl(cluster, "--json", "events", "ctljob", "--last", "1").stdout


def test_resize_and_clear_through_rdzv_ctl_and_json_output(cluster, tmp_path):
    cluster.start_server()
    agents = start_agents(cluster, tmp_path, "rsjob", ("node-a", "node-b"), "2:2")
    view = wait_members(cluster, "rsjob", ["node-a", "node-b"])
    first, (rank0, rank1) = view["round_id"], [n["node_id"] for n in view["nodes"]]
    out = ctl(cluster, "resize", "rsjob", "--nnodes", "1:1").stdout
    assert out.startswith("resized job rsjob to nodes 1:1")
    view = wait_members(cluster, "rsjob", [rank0], min_round=first + 1)     # rank 0 stays rank 0
    assert [n["node_id"] for n in view["spares"]] == [rank1] and view["restart_count"] == 0
    back = ctl(cluster, "--json", "resize", "rsjob", "--nnodes", ":2").stdout
    assert '"max_nodes": 2' in back and '"min_nodes": 1' in back
    wait_members(cluster, "rsjob", ["node-a", "node-b"], min_round=first + 2)
    gone = ctl(cluster, "clear", "rsjob", rank1, expect=1).stderr
    assert "neither excluded nor drained" in gone
    ctl(cluster, "close", "rsjob")
    for proc in agents.values():
        assert proc.wait(LIMIT) != 0


def test_agents_and_rdzv_ctl_through_a_name_that_is_not_one_of_the_servers(cluster, tmp_path):
    """A name of the server that is not one of its own (here a Kubernetes Service's, which only the
    agent's and rdzv-ctl's processes resolve, to 127.0.0.1): an agent works through it; an admin
    action without an admin token is refused there (DNS rebinding) and works through 127.0.0.1."""
    cluster.start_server()
    service = f"{SERVICE}:{cluster.port}"
    agent = Proc([sys.executable, FAKE_DNS, f"{SERVICE}=127.0.0.1", "-m", "node_agent", "--endpoint", service,
                  "--nnodes", "1", "--nproc", "1", "--job-id", "svcjob", "--node-id", "node-a", *FAST, WORKER],
                 child_env(OUT_DIR=str(tmp_path), NODE="node-a"), "node-a")
    cluster.procs.append(agent)
    wait_members(cluster, "svcjob", ["node-a"])
    refused = subprocess.run([sys.executable, FAKE_DNS, f"{SERVICE}=127.0.0.1", "-m", "rdzv_ctl.cli",
                              "--endpoint", service, "close", "svcjob"],
                             capture_output=True, text=True, env=child_env(), timeout=60)
    assert refused.returncode == 1
    line = one_line(refused)
    assert f"Host '{service}'" in line and f"--allowed-host '{SERVICE}'" in line, line
    assert job_view(cluster, "svcjob")["state"] == "running"
    ctl(cluster, "close", "svcjob")
    assert agent.wait(LIMIT) != 0 and "closed" in agent.output, agent.output


def test_rdzv_ctl_reports_an_unreachable_server_and_bad_usage_without_a_traceback(cluster):
    cluster.port = 1          # nothing listens there
    down = ctl(cluster, "status", expect=1)
    assert "cannot reach rdzv-server at http://127.0.0.1:1" in down.stderr and "Traceback" not in down.stderr
    usage = ctl(cluster, "resize", "job", "--nnodes", "two", expect=2)
    assert "--nnodes" in usage.stderr and "Traceback" not in usage.stderr


def one_line(done: subprocess.CompletedProcess) -> str:
    """The single line rdzv-ctl printed on stderr (no traceback, nothing on stdout)."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_rdzv_ctl_presents_tokens_and_verifies_tls(cluster, tmp_path):
    agent_token, admin_token = "ctl-agent-token-0123456789abcdef", "ctl-admin-token-0123456789abcdef"
    files = {}
    for name, value in (("agent", agent_token), ("admin", admin_token), ("wrong", "not-the-token-0123456789")):
        files[name] = str(tmp_path / f"{name}.token")
        (tmp_path / f"{name}.token").write_text(value + "\n")
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    other_ca = make_ca(str(tmp_path), "other-ca")[0]
    cluster.start_server("--token-file", files["agent"], "--admin-token-file", files["admin"],
                         "--tls-cert", cert, "--tls-key", key, "--state-dir", "none")
    assert cluster.scheme == "https"
    cluster.token, cluster.ca = agent_token, ca[0]
    # a job for the views and the admin actions: one join on the wire, with the agent token
    join = {"v": 1, "node_id": "n1", "addr": "127.0.0.1", "local_world_size": 1, "master_port": 1,
            "config": {"min_nodes": 2, "max_nodes": 2}}
    request = urllib.request.Request(f"https://{cluster.endpoint()}/v1/jobs/tokjob/join", data=msgpack.packb(join),
                                     headers={"Content-Type": "application/msgpack",
                                              "Authorization": f"Bearer {agent_token}"})
    with urllib.request.urlopen(request, timeout=10, context=ssl.create_default_context(cafile=ca[0])) as resp:
        assert resp.status == 200
    tls = ("--tls-ca", ca[0])

    line = one_line(ctl(cluster, "status", *tls, expect=1))
    assert "needs its token" in line and "--token-file" in line and cluster.endpoint() in line, line
    line = one_line(ctl(cluster, "status", *tls, "--token-file", files["wrong"], expect=1))
    assert f"--token-file {files['wrong']}" in line and "not one of this server's tokens" in line, line
    assert "not-the-token" not in line                                  # a token is never printed
    rows = ctl(cluster, "status", *tls, "--token-file", files["agent"]).stdout.splitlines()
    assert rows[1].split()[:2] == ["tokjob", "waiting"], rows
    by_env = ctl(cluster, "job", "tokjob", *tls, env={"RDZV_TOKEN_FILE": files["agent"]}).stdout
    assert "state      waiting" in by_env and "waiting:" in by_env and "n1" in by_env, by_env
    by_admin = ctl(cluster, "--json", "job", "tokjob", *tls, env={"RDZV_ADMIN_TOKEN_FILE": files["admin"]}).stdout
    assert '"counts"' in by_admin                                       # the admin token reads too

    for args in ((), ("--tls-ca", other_ca)):
        line = one_line(ctl(cluster, "status", "--token-file", files["agent"], *args, expect=1))
        assert "cannot verify the TLS certificate" in line and "--tls-ca" in line, line

    line = one_line(ctl(cluster, "close", "tokjob", *tls, "--token-file", files["agent"], expect=1))
    assert "--admin-token-file" in line and "admin token" in line, line
    line = one_line(ctl(cluster, "close", "tokjob", *tls, "--admin-token-file", files["wrong"], expect=1))
    assert f"--admin-token-file {files['wrong']}" in line and "not this server's admin token" in line, line
    assert job_view(cluster, "tokjob")["state"] == "waiting"            # refused: nothing changed
    closed = ctl(cluster, "close", "tokjob", "--reason", "tokens work", *tls,
                 env={"RDZV_ADMIN_TOKEN_FILE": files["admin"]}).stdout
    assert closed.startswith("closed job tokjob") and "state      closed" in closed
    assert job_view(cluster, "tokjob")["state"] == "closed"

    # unusable files and options: one line, exit 2, before any request
    line = one_line(ctl(cluster, "status", *tls, "--token-file", str(tmp_path / "missing"), expect=2))
    assert line.startswith(f"rdzv-ctl: --token-file {tmp_path / 'missing'}: No such file"), line
    line = one_line(ctl(cluster, "status", *tls, expect=2, env={"RDZV_ADMIN_TOKEN_FILE": files["admin"] + "x"}))
    assert "$RDZV_ADMIN_TOKEN_FILE" in line, line
    line = one_line(ctl(cluster, "status", "--tls-ca", ca[0], "--server", f"http://{cluster.endpoint()}", expect=2))
    assert "--tls-ca needs an https:// server" in line, line
    line = one_line(ctl(cluster, "status", "--tls-ca", str(tmp_path / "nope.pem"), expect=2))
    assert "--tls-ca" in line and "nope.pem" in line, line
