"""Hypothesis fuzzes the stream (`GET /v1/jobs/{job_id}/stream`) of the real app (in-process, durable
store): hostile frame sequences from a client that does not hold the job's node credentials.

Each example opens a stream and sends a drawn sequence: garbage bytes, MessagePack values of any
shape, frames of every type with hostile fields, requests whose bodies are mutated or speak for
another node, subscriptions with forged credentials, text frames, oversize frames. For every
example: each frame that comes back is a `reply`, `status` or `error` map whose error code is one of
the protocol's (never `internal`); the three nodes of the job and its round are exactly as they
were (a new node may join: that is not forged); the stream ends and the server holds no stream and
no held poll for it afterwards (no stuck task); and the server logs no error.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections import Counter
from typing import Any

import aiohttp
import msgpack
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import decode_request
from protocol.errors import ErrorCode
from protocol.messages import JoinRequest
from protocol.stream import MAX_FRAME_BYTES
from rdzv_server.web.stream import HUB
from tests.fuzz import payloads
from tests.fuzz.inprocess import ServerThread
from tests.fuzz.known_issues import known_log
from tests.fuzz.requests import STILL_CONFIG, Context, Node, valid_body

JOB = itertools.count(1)
CODES = {c.value for c in ErrorCode} - {ErrorCode.INTERNAL.value}
NODES = ("node-a", "node-b", "node-c")
FRAME_TYPES = ["hello", "request", "subscribe", "heartbeat", "reply", "status", "error", "", "HELLO"]


def frames(forged: list[str]) -> st.SearchStrategy[bytes | str]:
    """One hostile message; `forged`: credentials that are not the job's nodes'."""
    node_ids = st.one_of(st.sampled_from([*NODES, "stranger"]), st.sampled_from(payloads.HOSTILE_TEXT))
    values = payloads.msgpack_values()
    ctx = Context("", "j", (), config=dict(STILL_CONFIG))
    body = st.builds(lambda a, n, c: valid_body(ctx, a, Node(n, "fuzz", c)),
                     st.sampled_from(["join", "poll", "failure", "success", "leave"]),
                     st.sampled_from([*NODES, "stranger"]), st.sampled_from([None, "", *forged]))
    mutated = st.builds(lambda b, k, v: {**b, k: v}, body, st.sampled_from(["v", "node_id", "credential", "config",
                                                                          "round_id", "failures"]), values)
    typed = st.one_of(
        st.builds(lambda v, n: {"t": "hello", "v": v, "node_id": n}, st.sampled_from([1, 1, 2, "1", None]), node_ids),
        st.builds(lambda i, a, b: {"t": "request", "id": i, "action": a, "body": b},
                  st.one_of(st.integers(-2, 5), st.sampled_from(payloads.HOSTILE_INTS)),
                  st.sampled_from(["join", "failure", "success", "leave", "poll", "x" * 20, ""]),
                  st.one_of(body, mutated, values)),
        st.builds(lambda c, k, p: {"t": "subscribe", "credential": c, "known_round": k, "master_port": p},
                  st.sampled_from(["", "x" * 65, *forged]), st.sampled_from([-1, 0, 7, -2]),
                  st.sampled_from([0, 1, 65536])),
        st.just({"t": "heartbeat"}),
        st.builds(lambda t, k, v: {"t": t, k: v}, st.sampled_from(FRAME_TYPES), payloads.msgpack_keys(), values),
    )
    return st.one_of(typed.map(payloads.packb), values.map(payloads.packb), st.binary(max_size=64),
                     st.text(max_size=16), st.just(b"\x00" * (MAX_FRAME_BYTES + 1)))


PROBE_ID = 2 ** 40
PROBE = msgpack.packb({"t": "request", "id": PROBE_ID, "action": "success",
                       "body": {"v": 1, "node_id": "node-a", "round_id": 0}})     # no credential: refused


def check_frame(data: bytes) -> dict[str, Any]:
    frame = msgpack.unpackb(data)
    assert isinstance(frame, dict) and frame.get("t") in ("reply", "status", "error"), frame
    error = frame.get("error") if frame["t"] == "reply" else frame if frame["t"] == "error" else None
    if error:
        assert error["code"] in CODES and error["message"], frame
    return frame


async def speak(port: int, job: str, sequence: list[bytes | str]) -> list[str]:
    """Send the sequence on one stream, read what comes back: the frames' types and error codes."""
    got: list[str] = []
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"http://127.0.0.1:{port}/v1/jobs/{job}/stream", max_msg_size=0)
        for message in sequence:
            if ws.closed:
                break
            try:
                await (ws.send_str(message) if isinstance(message, str) else ws.send_bytes(message))
            except (ConnectionError, aiohttp.ClientError):
                break
        if not ws.closed:    # a last request, refused whatever came before: its reply ends what there is to read
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                await ws.send_bytes(PROBE)
        while (msg := await asyncio.wait_for(ws.receive(), 10)).type is aiohttp.WSMsgType.BINARY:
            frame = check_frame(msg.data)
            error = frame.get("error") if frame["t"] == "reply" else frame if frame["t"] == "error" else None
            got.append(f"{frame['t']}:{error['code']}" if error else frame["t"])
            if frame["t"] == "reply" and frame["id"] == PROBE_ID:
                break
        await ws.close()
    return got


def nodes_of(server: ServerThread, job: str) -> tuple[bytes, ...]:
    record = server.job(job)
    assert record is not None
    return (msgspec.msgpack.encode(record.round), *(msgspec.msgpack.encode(record.nodes[n]) for n in NODES))


def test_the_stream_survives_hostile_frames(server: ServerThread, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rdzv_server")
    job = f"stream-fuzz-{next(JOB)}"
    for node in NODES:         # 2 members and a spare, whose leases never run out during the test
        body = valid_body(Context("", job, (), config={**STILL_CONFIG}), "join", Node(node, secrets.token_hex(4), None))
        server.call(_join(server, job, body))
    forged = [secrets.token_urlsafe(24), "x" * 32]      # shaped like a credential, nobody's
    hub = server.call(_hub(server))
    sent = {"frames": 0, "examples": 0}
    seen: Counter[str] = Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(frames(forged), min_size=1, max_size=8), st.booleans())
    def example(sequence: list[bytes | str], hello_first: bool) -> None:
        before = nodes_of(server, job)
        if hello_first:
            sequence = [msgpack.packb({"t": "hello", "v": 1, "node_id": "node-a"}), *sequence]
        seen.update(asyncio.run(speak(server.port, job, sequence)))
        assert nodes_of(server, job) == before, "a stream without the nodes' credentials changed them"
        assert server.call(_streams_left(hub)) == 0, "a stream still held after its client left"
        sent["frames"] += len(sequence)
        sent["examples"] += 1

    example()
    errors = [r.getMessage() for r in caplog.records if r.name == "rdzv_server" and r.levelno >= logging.ERROR]
    assert not [e for e in errors if known_log(e) is None], errors[:3]
    assert sent["examples"] >= 100 and sent["frames"] >= 300, sent
    # the server read them: it refused bad frames, forged subscriptions and requests, and answered others
    assert seen["error:bad_request"] and any(kind.startswith("reply:") for kind in seen), seen
    refused = ("error:unauthorized", "error:forbidden", "reply:unauthorized", "reply:forbidden")
    assert sum(seen[k] for k in refused), seen


async def _join(server: ServerThread, job: str, body: dict[str, Any]) -> None:
    await server.coordinator.handle(job, decode_request(JoinRequest, msgpack.packb(body)))


async def _hub(server: ServerThread) -> Any:
    assert server.runner is not None
    return server.runner.app[HUB]


async def _streams_left(hub: Any) -> int:
    for _ in range(200):           # the handler's `finally` runs once its connection is gone
        if not hub.open:
            return 0
        await asyncio.sleep(0.01)
    return len(hub.open)
