"""A flood of idle connections cannot lock agents or /healthz out: at the cap the longest-idle
connection makes room; a held long-poll is never the one closed."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
import urllib.request

import msgpack
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as connect_async
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.e2e.certs import make_ca, make_server_cert
from tests.e2e.harness import job_events, wait_until

pytestmark = pytest.mark.e2e


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


def test_idle_connections_over_the_cap_make_room_for_healthz_and_agents(cluster):
    port = cluster.start_server("--state-dir", "none", "--max-connections", "40")
    joined = post(port, "join", {"v": 1, "node_id": "a", "addr": "10.0.0.1", "local_world_size": 1,
                                 "master_port": 1, "config": {"min_nodes": 2, "max_nodes": 2}})
    held = socket.create_connection(("127.0.0.1", port))       # a's long-poll, held by the server
    body = msgpack.packb({"v": 1, "node_id": "a", "credential": joined["credential"], "known_round": -1,
                          "wait_s": 30.0})
    held.sendall(b"POST /v1/jobs/conn/poll HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(lambda: open_polls(port) == 1, 30, "the server holding a's poll")
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(120)]   # never send anything
    try:
        for _ in range(5):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
                assert resp.status == 200
        post(port, "join", {"v": 1, "node_id": "b", "addr": "10.0.0.2", "local_world_size": 1,
                            "master_port": 2, "config": {"min_nodes": 2, "max_nodes": 2}})
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


def test_a_stream_counts_against_the_cap_and_is_never_closed_to_make_room(cluster):
    """A stream is a connection aiohttp no longer holds (web/stream_connection.py): the guard still
    counts it, and as a held poll it is never the idle one closed."""
    port = cluster.start_server("--state-dir", "none", "--max-connections", "40")
    body = {"v": 1, "node_id": "a", "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1,
            "config": {"min_nodes": 2, "max_nodes": 2}}
    with connect(f"ws://127.0.0.1:{port}/v1/jobs/conn/stream", open_timeout=10) as ws:
        ws.send(msgpack.packb({"t": "hello", "v": 1, "node_id": "a"}))
        ws.send(msgpack.packb({"t": "request", "id": 1, "action": "join", "body": body}))
        credential = msgpack.unpackb(ws.recv(timeout=10))["status"]["credential"]
        ws.send(msgpack.packb({"t": "subscribe", "credential": credential, "known_round": -1}))
        assert msgpack.unpackb(ws.recv(timeout=10))["status"]["node_state"] == "waiting"
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]   # never send anything
        try:
            wait_until(lambda: metric(port, "rdzv_connections_evicted_total") >= 80 + 1 - 40, 30,
                       "the idle connections over the cap closed, the stream counted among the 40")
            post(port, "join", dict(body, node_id="b", addr="10.0.0.2", master_port=2))
            pushed = msgpack.unpackb(ws.recv(timeout=10))       # the stream is still open: the round comes
            assert pushed["t"] == "status" and pushed["status"]["node_state"] == "member", pushed
        finally:
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


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_stream_over_tls_is_taken_over_like_a_plain_one(cluster, tmp_path, loop):
    """The stream's protocol takes over the TLS transport (asyncio's and uvloop's): the round is
    pushed over it, a ping is answered, a bad frame gets its error frame before the close.

    The client is websockets' asyncio one: its threaded (sync) client reads TLS in one thread while
    it sends the upgrade in another, and one connect in about 2,000 then lost its request when the
    server's TLS 1.3 session tickets were being read (the server waited on, the client timed out)."""
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    port = cluster.start_server("--tls-cert", cert, "--tls-key", key, "--state-dir", "none", "--event-loop", loop)
    context = ssl.create_default_context(cafile=ca[0])
    url = f"wss://127.0.0.1:{port}/v1/jobs/tls/stream"

    async def frame(ws: ClientConnection) -> dict:
        return msgpack.unpackb(await asyncio.wait_for(ws.recv(), 10))

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as opened:
            streams = [await opened.enter_async_context(connect_async(url, ssl=context, open_timeout=10))
                       for _ in range(2)]
            for i, ws in enumerate(streams):
                node = f"n{i}"
                await ws.send(msgpack.packb({"t": "hello", "v": 1, "node_id": node}))
                await ws.send(msgpack.packb({"t": "request", "id": 1, "action": "join", "body": {
                    "v": 1, "node_id": node, "addr": f"10.0.0.{i + 1}", "local_world_size": 1, "master_port": 1,
                    "config": {"min_nodes": 2, "max_nodes": 2, "lease_timeout_s": 30.0}}}))
                credential = (await frame(ws))["status"]["credential"]
                await ws.send(msgpack.packb({"t": "subscribe", "credential": credential, "known_round": -1}))
            first = await frame(streams[0])          # its own view, waiting for n1
            while first["status"]["node_state"] != "member":
                first = await frame(streams[0])
            assert first["status"]["assignment"]["world_size"] == 2
            await asyncio.wait_for(await streams[0].ping(b"x"), 10)        # answered
            await streams[1].send(b"\xc1garbage")
            while (last := await frame(streams[1]))["t"] == "status":
                pass
            assert last["t"] == "error" and last["code"] == "bad_request", last
            with pytest.raises(ConnectionClosed) as closed:
                await frame(streams[1])
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008

    asyncio.run(scenario())
