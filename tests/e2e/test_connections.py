"""A flood of idle connections cannot lock agents or /healthz out: at the cap the longest-idle
connection makes room; a held long-poll is never the one closed."""
from __future__ import annotations

import asyncio
import http.client
import os
import socket
import ssl
import threading
import time
import urllib.request
from collections import Counter

import msgpack
import pytest

from tests.e2e.certs import make_ca, make_server_cert
from tests.e2e.harness import SCRIPTS, job_events, job_view, open_files_limit, read_jsonl, wait_until

pytestmark = pytest.mark.e2e
LOOP = os.path.join(SCRIPTS, "elastic_loop.py")


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return -1.0


def open_polls(port: int) -> float:
    return metric(port, "rdzv_open_long_polls")


def post(port: int, action: str, body: dict, timeout: float = 10) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/jobs/conn/{action}", data=msgpack.packb(body),
                                     method="POST", headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return msgpack.unpackb(resp.read())

HELD_CONFIG = {"min_nodes": 2, "max_nodes": 2, "lease_timeout_s": 60.0}   # the job of held_poll


def held_poll(port: int) -> socket.socket:
    """Node a joined a 2-node job (HELD_CONFIG: a lease of 60 s) and its long-poll held by the server: the
    connection (node b's join with HELD_CONFIG answers it)."""
    joined = post(port, "join", {"v": 1, "node_id": "a", "addr": "10.0.0.1", "local_world_size": 1,
                                 "master_port": 1, "config": HELD_CONFIG})
    held = socket.create_connection(("127.0.0.1", port))       # a's long-poll, held by the server
    body = msgpack.packb({"v": 1, "node_id": "a", "credential": joined["credential"], "known_round": -1,
                          "wait_s": 30.0})
    held.sendall(b"POST /v1/jobs/conn/poll HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(lambda: open_polls(port) == 1, 30, "the server holding a's poll")
    return held


def test_idle_connections_over_the_cap_make_room_for_healthz_and_agents(cluster):
    port = cluster.start_server("--state-dir", "none", "--max-connections", "40")
    # a lease of 60 s holds a's poll 24-30 s: it is answered by b's join, never by its hold's end (2-2.5 s at the
    # default lease, which the flood and a loaded machine can outlast before b joins)
    held = held_poll(port)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(120)]   # never send anything
    try:
        for _ in range(5):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
                assert resp.status == 200
        post(port, "join", {"v": 1, "node_id": "b", "addr": "10.0.0.2", "local_world_size": 1,
                            "master_port": 2, "config": HELD_CONFIG})
        held.settimeout(10)
        answer = held.recv(4096)                                 # the held poll is answered: round formed
        assert answer.startswith(b"HTTP/1.1 200") and b"member" in answer
        closed = 0
        for sock in idle:                                        # the server closed idle ones to make room
            sock.settimeout(0.05)
            try:
                closed += sock.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass                                             # still open: one of the newest
        assert closed >= 120 - 40
        assert metric(port, "rdzv_connections_evicted_total") >= closed    # and operators can see it
        assert metric(port, "rdzv_connections_refused_total") >= 0
    finally:
        held.close()
        for sock in idle:
            sock.close()


def test_a_keep_alive_connection_that_served_requests_outlives_a_later_idle_flood(cluster):
    """The flood's connections, which never finished a request, make room first; before, connections were closed
    in the order they were opened, an agent's keep-alive connection among the first."""
    port = cluster.start_server("--state-dir", "none", "--max-connections", "40")
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    kept.request("GET", "/metrics")                            # answered (/healthz, which anyone may ask, would not do)
    assert kept.getresponse().read() and metric(port, "rdzv_connections_evicted_total") == 0
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(120)]   # never send anything
    try:
        wait_until(lambda: metric(port, "rdzv_connections_evicted_total") >= 120 - 40, 30,
                   "the server closing idle connections down to its cap")
        kept.request("GET", "/healthz")                          # the same connection: it was not closed
        response = kept.getresponse()
        assert response.status == 200
        response.read()
    finally:
        kept.close()
        for sock in idle:
            sock.close()


def send_poll(port: int, node: str, credential: str, known_round: int) -> socket.socket:
    """A long-poll on its own connection, as raw HTTP: the test decides when that connection closes."""
    sock = socket.create_connection(("127.0.0.1", port))
    body = msgpack.packb({"v": 1, "node_id": node, "credential": credential, "known_round": known_round,
                          "wait_s": 60.0})
    sock.sendall(b"POST /v1/jobs/conn/poll HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def read_answer(sock: socket.socket, timeout: float) -> dict:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head
    return msgpack.unpackb(body)


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])   # each closes the socket after telling the protocol
def test_a_connection_closed_late_in_anothers_held_poll_is_a_loss_after_the_grace(cluster, event_loop):
    # A 2-node job: a's poll is held and nobody else talks. 3.5 s in, b's agent dies and its kernel
    # closes b's held poll (a FIN). That FIN, and the keepalive ACKs on a's connection, say that the
    # server's link works: b is lost and a's poll answers with the round without it. (Taken for the
    # quiet rule's "heard from nobody for 4 s", b's lease was extended 30 s: a's poll had no news.)
    port = cluster.start_server("--state-dir", "none", "--event-loop", event_loop)
    config = {"min_nodes": 1, "max_nodes": 2, "last_call_s": 0.0, "lease_timeout_s": 30.0}
    a = post(port, "join", {"v": 1, "node_id": "a", "addr": "10.0.0.1", "local_world_size": 1,
                            "master_port": 1, "config": config})
    b = post(port, "join", {"v": 1, "node_id": "b", "addr": "10.0.0.2", "local_world_size": 1,
                            "master_port": 2, "config": config})
    round_id = b["assignment"]["round_id"]
    b_poll = send_poll(port, "b", b["credential"], round_id)
    a_poll = send_poll(port, "a", a["credential"], round_id)
    try:
        wait_until(lambda: open_polls(port) == 2, 30, "the server holding both polls")
        time.sleep(3.5)          # the scenario itself: b dies 3.5 s into a silence (not a synchronisation)
        b_poll.close()
        answer = read_answer(a_poll, 20.0)
        assert answer["assignment"]["round_id"] > round_id
        assert answer["assignment"]["world_size"] == 1
        kinds = [e["kind"] for e in job_events(cluster, "conn")]
        assert "node_lost" in kinds and "leases_extended" not in kinds
    finally:
        b_poll.close()
        a_poll.close()


def test_a_client_that_asks_for_a_stream_is_refused_at_once(cluster):
    """An agent of a version that had the stream (`--transport stream`): its upgrade is answered at once
    with a 404 that says long-polls are the only transport, never held."""
    port = cluster.start_server("--state-dir", "none")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /v1/jobs/conn/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"Sec-WebSocket-Version: 13\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 404"), head
    assert b"long-polls are the only transport" in body, body


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])     # each tells a TLS connection's end its own way
def test_a_tls_poll_closed_by_its_host_is_a_restarting_agent_awaited_not_a_silent_host(cluster, tmp_path,
                                                                                      event_loop):
    """Over TLS the protocol hears of a connection's end after its socket closed (no TCP_INFO left to read): a
    FIN is still the node's host speaking, so a member of an elastic job whose held poll ends so is awaited as an
    agent restarting (awaiting.py) rather than taken for a host gone silent (the job would shrink at once)."""
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    port = cluster.start_server("--state-dir", "none", "--event-loop", event_loop, "--tls-cert", cert,
                                "--tls-key", key)
    cluster.ca = ca[0]
    context = ssl.create_default_context(cafile=ca[0])
    config = {"min_nodes": 1, "max_nodes": 2, "last_call_s": 0.0, "lease_timeout_s": 20.0}

    def join(node: str) -> dict:
        request = urllib.request.Request(
            f"https://127.0.0.1:{port}/v1/jobs/conn/join", method="POST",
            data=msgpack.packb({"v": 1, "node_id": node, "addr": "127.0.0.1", "local_world_size": 1,
                                "master_port": 1, "config": config}),
            headers={"Content-Type": "application/msgpack"})
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return dict(msgpack.unpackb(resp.read()))

    a, b = join("a"), join("b")
    round_id = b["assignment"]["round_id"]
    polls = {n: context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
             for n in "ab"}
    polls_body = {n: msgpack.packb({"v": 1, "node_id": n, "credential": joined["credential"],
                                    "known_round": round_id, "wait_s": 60.0,   # b's ranks hold a snapshot (its note)
                                    **({"copies": {"local_step": 5, "copying": False}} if n == "b" else {})})
                  for n, joined in (("a", a), ("b", b))}
    for n, body in polls_body.items():
        polls[n].sendall(poll_request(body))
    try:
        wait_until(lambda: polls_held(cluster) == 2, 30, "both polls held")
        os.close(polls["b"].detach())      # b's agent dies: its kernel closes the socket (a FIN, no TLS goodbye)
        answer = read_answer(polls["a"], 30.0)
        while answer["job_state"] == "running" and answer["round_id"] == round_id:
            # a's hold ended before the server heard of b's close (a loaded machine): a polls again, as its agent would
            polls["a"].sendall(poll_request(polls_body["a"]))
            answer = read_answer(polls["a"], 30.0)
        assert answer["assignment"] is None and answer["job_state"] == "waiting", answer
        events = [e for e in job_events(cluster, "conn") if e["kind"] in ("node_lost", "round_waiting")]
        assert [e["kind"] for e in events] == ["node_lost", "round_waiting"], events
        assert "waiting up to 20s for node b to come back" in events[1]["message"], events
    finally:
        for sock in polls.values():
            sock.close()


def poll_request(body: bytes) -> bytes:
    return (b"POST /v1/jobs/conn/poll HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def polls_held(cluster) -> float:
    """rdzv_open_long_polls, from the server's /metrics (over TLS where the cluster's server uses it)."""
    with urllib.request.urlopen(f"{cluster.scheme}://127.0.0.1:{cluster.port}/metrics", timeout=10,
                                context=ssl.create_default_context(cafile=cluster.ca)) as resp:
        return next(float(line.split()[1]) for line in resp.read().decode().splitlines()
                    if line.startswith("rdzv_open_long_polls "))


FAKE_NODES, POLLS_EACH = 20, 4       # 80 held polls: past the server's 64


async def hold_polls_of_made_up_nodes(port: int, stop: threading.Event, seen: Counter) -> None:
    """What a holder of the agent token can do: made-up nodes of a job that never forms, each holding POLLS_EACH
    long-polls, polling again as each is answered or closed (at an attacker's pace), until `stop`."""
    config = {"min_nodes": 1000, "max_nodes": 1000, "lease_timeout_s": 60.0, "join_timeout_s": 600.0}
    nodes = {f"fake{i}": post(port, "join", {"v": 1, "node_id": f"fake{i}", "addr": "10.0.0.9", "local_world_size": 1,
                                             "master_port": 1, "config": config})["credential"]
             for i in range(FAKE_NODES)}

    async def slot(node: str, credential: str) -> None:
        body = msgpack.packb({"v": 1, "node_id": node, "credential": credential, "known_round": -1, "wait_s": 60.0})
        request = (b"POST /v1/jobs/conn/poll HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                seen["refused"] += 1
                await asyncio.sleep(0.2)
                continue
            try:
                while True:
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length"))
                    await reader.readexactly(length)
                    seen["answered"] += 1
            except (OSError, asyncio.IncompleteReadError):
                seen["closed"] += 1
            finally:
                writer.close()
            await asyncio.sleep(0.2)

    slots = [asyncio.ensure_future(slot(n, c)) for n, c in nodes.items() for _ in range(POLLS_EACH)]
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    for task in slots:
        task.cancel()
    await asyncio.gather(*slots, return_exceptions=True)


def metric_now(port: int, name: str) -> float:
    """A metric now; -1 while /metrics cannot be reached (the server at its connection limit: the test's own request
    is a newcomer there too, and may be the connection closed to make room)."""
    try:
        return metric(port, name)
    except OSError:
        return -1.0


def held_now(port: int) -> float:
    return metric_now(port, "rdzv_open_long_polls")


def test_held_polls_of_made_up_nodes_give_way_to_a_real_node(cluster, tmp_path):
    """A holder of the agent token fills the server's connections (64: RLIMIT_NOFILE 320) with held polls of made-up
    nodes; then a real agent joins a job of its own (lease 3 s). Before, its connections were refused (none idle, the
    hard limit) while the polls were held: it could not join, and a running node's requests failed until its lease
    ran out (a review, 2 of 2). Now a held poll of a made-up node gives way to each newcomer: the node joins, and its
    worker steps on over three leases of the flood, never lost."""
    port = cluster.start_server("--state-dir", "none", prefix=open_files_limit(320))   # 64 connections
    stop, seen = threading.Event(), Counter()
    flood = threading.Thread(target=asyncio.run, args=(hold_polls_of_made_up_nodes(port, stop, seen),))
    flood.start()
    try:
        wait_until(lambda: held_now(port) >= 60, 60, lambda: f"the made-up nodes' polls held: {seen}")
        agent = cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "1", "--nproc", "1", "--job-id", "real",
                              "--node-id", "n", "--lease-timeout", "3", "--max-restarts", "3", LOOP, name="n",
                              env={"OUT_DIR": str(tmp_path), "NODE": "n", "STEP_SLEEP": "0.1"})
        steps = lambda since: {r["pid"] for r in read_jsonl(tmp_path, "steps-")      # noqa: E731
                               if r["kind"] == "step" and r["t"] > since}
        wait_until(lambda: steps(0), 90, lambda: f"the worker stepping\n{agent.output}\n{seen}")
        worker, began = steps(0), time.time()
        wait_until(lambda: steps(began + 9.0), 60, lambda: f"the worker stepping 9 s on\n{agent.output}")
        assert steps(began + 9.0) == worker, agent.output          # the same worker: never stopped
        wait_until(lambda: held_now(port) >= 60 and metric_now(port, "rdzv_polls_gave_way_total") > 0, 30,
                   lambda: f"still flooded, and held polls gave way: {seen}")
    finally:
        stop.set()
        flood.join(30)
    real = job_view(cluster, "real")
    assert real["restart_count"] == 0 and [n["node_id"] for n in real["nodes"]] == ["n"], real
    assert "node_lost" not in [e["kind"] for e in job_events(cluster, "real")]
