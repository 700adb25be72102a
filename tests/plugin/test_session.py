"""`ServerSession` (the plugin's side of the protocol, no torch) against a real rdzv-server process:
joins, the job-wide failure report, adopting a round another node caused, leaving, refusals and an
unreachable server. Nodes are sessions in this process, each with its own loop thread."""
from __future__ import annotations

import re
import resource
import socket
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from node_agent.client.http import RdzvClient
from node_agent.plugin.session import JobFinished, JoinRefused, ServerLost, ServerSession, needs_rendezvous
from node_agent.plugin.settings import TorchLaunch, plugin_settings
from protocol.messages import Witness, WorkerFailure
from tests.e2e.harness import Cluster, job_view, wait_until

pytestmark = pytest.mark.e2e
FAILURE = [WorkerFailure(local_rank=0, rank=0, exitcode=1, message="boom")]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("session"))
    try:
        cluster.start_server("--state-dir", "none")
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def sessions() -> Iterator[list[ServerSession]]:
    made: list[ServerSession] = []
    yield made
    for s in made:
        s.close()


def start(sessions: list[ServerSession], host: str, port: int, job: str, node: str, nnodes: tuple[int, int] = (2, 2),
          say: Callable[[str], None] = lambda line: None, **conf: str) -> ServerSession:
    settings = plugin_settings(endpoint=f"{host}:{port}", run_id=job, min_nodes=nnodes[0], max_nodes=nnodes[1],
                               local_addr="127.0.0.1", launch=TorchLaunch(local_world_size=1, max_restarts=0),
                               conf={"node_id": node, "last_call_timeout": "0", "lease_timeout": "3", **conf})
    session = ServerSession(settings, RdzvClient(settings.host, settings.port, job, node), master_port=1234,
                            say=say)
    session.start()
    sessions.append(session)
    return session


def first_rounds(*nodes: ServerSession):
    with ThreadPoolExecutor(len(nodes)) as pool:
        futures = [pool.submit(n.next_assignment, -1, None) for n in nodes]
        return [f.result(60) for f in futures]


def test_a_failure_report_moves_every_node_on_and_is_counted_once(server, sessions):
    a = start(sessions, "127.0.0.1", server.port, "fail-once", "a", max_restarts="3")
    b = start(sessions, "127.0.0.1", server.port, "fail-once", "b", max_restarts="3")
    ra, rb = first_rounds(a, b)
    assert (ra.round_id, rb.round_id) == (1, 1) and {ra.group_rank, rb.group_rank} == {0, 1}
    assert {ra.master_port, rb.master_port} == {1234}   # every agent publishes its store port

    ra2 = a.next_assignment(1, FAILURE)                  # a's workers failed: it reports round 1
    assert (ra2.round_id, ra2.restart_count) == (2, 1)
    wait_until(lambda: needs_rendezvous(b.view, 1), 30, "b's long-poll to bring round 2")
    rb2 = b.next_assignment(1, None)                     # b adopts round 2: no report of its own
    assert (rb2.round_id, rb2.restart_count) == (2, 1)
    assert not needs_rendezvous(a.view, 2) and not needs_rendezvous(b.view, 2)
    job = job_view(server, "fail-once")
    assert (job["restart_count"], job["round_id"], job["last_failure"]["message"]) == (1, 2, "boom"), job


def test_a_node_that_leaves_starts_a_smaller_round_for_the_others(server, sessions):
    a = start(sessions, "127.0.0.1", server.port, "leave", "a", nnodes=(1, 2))
    b = start(sessions, "127.0.0.1", server.port, "leave", "b", nnodes=(1, 2))
    ra, rb = first_rounds(a, b)
    if ra.round_id < rb.round_id:     # the first to join formed round 1 alone: it follows into round 2
        ra = a.next_assignment(ra.round_id, None)
    if rb.round_id < ra.round_id:
        rb = b.next_assignment(rb.round_id, None)
    assert (ra.round_id, ra.group_world_size) == (rb.round_id, 2)
    b.leave("done here")
    wait_until(lambda: needs_rendezvous(a.view, ra.round_id), 30, "a to hear that b left")
    after = a.next_assignment(ra.round_id, None)
    assert (after.round_id, after.group_world_size, after.restart_count) == (ra.round_id + 1, 1, 0)


def test_a_survivor_below_min_nodes_says_it_waits_again(server, sessions):
    """A review: a node's "waiting for the next round" was said once per run, so after a peer left a 2-node job
    the survivor's torchrun sat silent until join_timeout failed the job (900 s by default)."""
    said: list[str] = []
    a = start(sessions, "127.0.0.1", server.port, "wait-again", "a", say=said.append, join_timeout="3")
    b = start(sessions, "127.0.0.1", server.port, "wait-again", "b", join_timeout="3")
    ra, _ = first_rounds(a, b)
    said.clear()
    b.leave("done here")
    wait_until(lambda: needs_rendezvous(a.view, ra.round_id), 30, "a to hear that b left")
    with pytest.raises(JobFinished, match="within join_timeout"):
        a.next_assignment(ra.round_id, None)
    assert any(line.startswith("waiting for the next round") for line in said), said


def test_an_exhausted_budget_ends_the_job_for_every_node(server, sessions):
    a = start(sessions, "127.0.0.1", server.port, "budget", "a", max_restarts="0")
    b = start(sessions, "127.0.0.1", server.port, "budget", "b", max_restarts="0")
    first_rounds(a, b)
    with pytest.raises(JobFinished, match="failed: worker failures exceeded max_restarts=0"):
        a.next_assignment(1, FAILURE)
    wait_until(lambda: b.view is not None and b.view.job_state.finished, 30, "b to hear that the job failed")
    assert needs_rendezvous(b.view, 1)
    with pytest.raises(JobFinished):
        b.next_assignment(1, None)


def test_a_join_with_other_settings_is_refused(server, sessions):
    start(sessions, "127.0.0.1", server.port, "conflict", "a", nnodes=(1, 1))
    sessions[0].next_assignment(-1, None)
    b = start(sessions, "127.0.0.1", server.port, "conflict", "b", nnodes=(1, 2))
    with pytest.raises(JoinRefused, match="config_conflict|max_nodes") as info:
        b.next_assignment(-1, None)
    assert info.value.code == "config_conflict"


@pytest.mark.parametrize(("family", "host", "named"), [(socket.AF_INET, "127.0.0.1", "127.0.0.1"),
                                                       (socket.AF_INET6, "::1", "[::1]")])
def test_an_unreachable_server_ends_the_session_with_the_endpoint_named(sessions, family, host, named):
    with socket.socket(family) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    endpoint = f"[{host}]" if ":" in host else host      # an IPv6 address is named as the user writes it
    said: list[str] = []
    a = start(sessions, endpoint, port, "nowhere", "a", say=said.append, server_wait="0.3", lease_timeout="0.3")
    with pytest.raises(ServerLost, match=re.escape(f"cannot reach the rdzv-server at {named}:{port} ")):
        a.next_assignment(-1, None)
    assert any(f" {named}:{port}" in line for line in said), said      # the line said as contact was lost too


def admin(server: Cluster, path: str) -> None:
    request = urllib.request.Request(f"http://{server.endpoint()}/v1/admin/jobs/{path}", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10):
        pass


def test_a_drained_node_is_refused_when_it_rejoins(server, sessions):
    a = start(sessions, "127.0.0.1", server.port, "drain", "a", nnodes=(1, 2))
    a.next_assignment(-1, None)
    admin(server, "drain/nodes/a/drain")
    wait_until(lambda: a.ended is not None, 30, "a to be refused after the drain")
    assert isinstance(a.ended, JoinRefused) and a.ended.code == "node_drained"


def test_a_job_closed_by_an_operator_ends_for_every_node(server, sessions):
    a = start(sessions, "127.0.0.1", server.port, "close", "a", nnodes=(1, 2))
    ra = a.next_assignment(-1, None)
    admin(server, "close/close")
    wait_until(lambda: needs_rendezvous(a.view, ra.round_id), 30, "a to hear that the job was closed")
    with pytest.raises(JobFinished, match="job 'close' closed: closed by operator"):
        a.next_assignment(ra.round_id, None)


def ask(witness: Witness, round_id: int) -> bytes:
    """The witness question, asked as another agent would (witness.py's wire, by hand)."""
    with socket.create_connection((witness.addr, witness.port), timeout=10) as conn:
        conn.sendall(b"rdzv-agent ask round=%d\n" % round_id)
        return conn.makefile("rb").readline()


def test_plugin_nodes_are_witnesses_answering_with_the_round_torch_runs(tmp_path, sessions):
    """Issue 23: the plugin's nodes answer witness probes, so the members of a job get witnesses on them;
    one that no longer hears the server says so."""
    cluster = Cluster(tmp_path)
    try:
        cluster.start_server("--state-dir", "none")
        a = start(sessions, "127.0.0.1", cluster.port, "witness", "a", server_wait="600")
        b = start(sessions, "127.0.0.1", cluster.port, "witness", "b", server_wait="600")
        assert a.witness.port > 0 and b.witness.port > 0
        ra, rb = first_rounds(a, b)
        assert ra.witnesses == (Witness(addr="127.0.0.1", port=b.witness.port),)   # the server named them
        assert rb.witnesses == (Witness(addr="127.0.0.1", port=a.witness.port),)
        assert ask(ra.witnesses[0], ra.round_id) == b"rdzv-agent in-contact round=%d\n" % rb.round_id
        cluster.server.kill_all()                     # the server is gone: b's long-poll fails
        wait_until(lambda: ask(ra.witnesses[0], ra.round_id) == b"rdzv-agent alone round=%d\n" % rb.round_id,
                   30, "b to say it no longer hears the server")
    finally:
        cluster.close()


def test_the_witness_port_is_capped_by_torchruns_descriptor_limit_and_says_so(monkeypatch):
    """A review: the plugin's witness port held up to 512 connections whatever torchrun's open-file limit, and said
    nothing when a flood met its caps. Its caps leave three quarters of torchrun's descriptors to torchrun (its limit
    is not raised: its workers inherit it), and what it says goes to the plugin's lines."""
    said: list[str] = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    settings = plugin_settings(endpoint="127.0.0.1:1", run_id="caps", min_nodes=1, max_nodes=1,
                               local_addr="127.0.0.1", launch=TorchLaunch(local_world_size=1, max_restarts=0),
                               conf={"node_id": "a"})
    session = ServerSession(settings, RdzvClient(settings.host, settings.port, "caps", "a"), master_port=1,
                            say=said.append)
    try:
        listener = session.witness._listener
        assert listener.caps.total == 64
        listener._say("the witness port is full")
        assert said == ["the witness port is full"]
    finally:
        session._loop.close()        # never started: nothing to leave
