"""Nodes on the stream and nodes on long-polls in one job see the same rounds; a slow reader's stream
is closed without holding the server's memory; a client in `auto` falls back to HTTP against a
server that does not offer the stream."""
from __future__ import annotations

import asyncio

from aiohttp import web

from node_agent.client.http import RdzvClient
from node_agent.client.stream import StreamClient
from node_agent.client.transport import ServerRejected, Transport
from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JoinRequest, NodeStatus, WorkerFailure, poll_ready
from rdzv_server.coordinator import Coordinator
from rdzv_server.streams import StreamHub
from rdzv_server.web import app as app_module
from rdzv_server.web.app import create_app
from tests.integration.support import FixedLag, start_app

LIMIT = 10.0
THREE = JobConfig(min_nodes=3, max_nodes=3, max_restarts=5, last_call_s=0.0)


async def until_round(t: Transport, known: int) -> NodeStatus:
    """Poll as an agent does until the node holds a round newer than `known`."""
    while True:
        status = await asyncio.wait_for(t.poll(known, 5.0), LIMIT)
        if status.assignment is not None and status.assignment.round_id > known:
            return status


async def test_stream_and_long_poll_nodes_agree_on_every_round() -> None:
    srv = await start_app(create_app(Coordinator()))
    port = srv.port or 0
    nodes: list[Transport] = [StreamClient("127.0.0.1", port, "mix", "s1"),
                              StreamClient("127.0.0.1", port, "mix", "s2", transport="auto"),
                              RdzvClient("127.0.0.1", port, "mix", "h1")]
    try:
        for t in nodes:
            await t.__aenter__()
        for t in nodes:
            await t.join(addr="127.0.0.1", host="h", local_world_size=2, master_port=1000, config=THREE,
                         instance=t.node_id, role="default")
        assert all(isinstance(t, StreamClient) and t.streaming for t in nodes[:2])
        known = -1
        for turn in range(3):
            views = await asyncio.gather(*(until_round(t, known) for t in nodes))
            rounds = {v.assignment.round_id for v in views if v.assignment}
            assert len(rounds) == 1, rounds
            assert sorted(v.assignment.group_rank for v in views if v.assignment) == [0, 1, 2]
            assert {(v.assignment.world_size, v.assignment.master_port, v.assignment.restart_count)
                    for v in views if v.assignment} == {(6, views[0].assignment.master_port, turn)}
            known = rounds.pop()
            reporter = nodes[turn % 3]          # each transport reports one failure in turn
            reply = await reporter.report_failure(known, [WorkerFailure(local_rank=0, rank=0, exitcode=1)])
            assert reply.round_id == known + 1
    finally:
        for t in nodes:
            await t.__aexit__(None, None, None)
        await srv.close()


async def test_auto_falls_back_to_http_against_a_server_without_the_stream(monkeypatch) -> None:
    monkeypatch.setattr(app_module, "STREAM_VERSION", None)   # /healthz as a server before the stream answers it
    srv = await start_app(create_app(Coordinator()))
    client = StreamClient("127.0.0.1", srv.port or 0, "old", "n1")
    try:
        await client.__aenter__()
        status = await client.join(addr="127.0.0.1", host="h", local_world_size=1, master_port=1,
                                   config=JobConfig(last_call_s=0.0), instance="i", role="default")
        assert client.streaming is False and status.assignment is not None
        assert poll_ready(await client.poll(-1, 0.0), -1)
    finally:
        await client.__aexit__(None, None, None)
        await srv.close()


async def test_auto_goes_on_over_http_when_something_on_the_way_refuses_the_upgrade() -> None:
    @web.middleware
    async def proxy_without_websockets(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.headers.get("Upgrade", "").lower() == "websocket":
            raise web.HTTPBadRequest(text="this gateway does not pass upgrades")
        return await handler(request)

    app = create_app(Coordinator())
    app.middlewares.insert(0, proxy_without_websockets)
    srv = await start_app(app)
    auto = StreamClient("127.0.0.1", srv.port or 0, "gw", "n1")
    only = StreamClient("127.0.0.1", srv.port or 0, "gw", "n2", transport="stream")
    try:
        await auto.__aenter__()
        await only.__aenter__()
        status = await auto.join(addr="127.0.0.1", host="h", local_world_size=1, master_port=1,
                                 config=JobConfig(min_nodes=1, max_nodes=2, last_call_s=5.0), instance="i",
                                 role="default")
        assert auto.streaming is False and status.node_state.value in ("waiting", "member")
        assert (await auto.poll(-1, 0.0)).job_id == "gw"
        try:                                   # asked for the stream only: the refusal says what to do
            await only.join(addr="127.0.0.1", host="h", local_world_size=1, master_port=1,
                            config=JobConfig(min_nodes=1, max_nodes=2, last_call_s=5.0), instance="i2",
                            role="default")
            raise AssertionError("a refused upgrade was not reported")
        except ServerRejected as exc:
            assert "HTTP 400" in exc.message and "--transport poll" in exc.message
    finally:
        await auto.__aexit__(None, None, None)
        await only.__aexit__(None, None, None)
        await srv.close()


class SlowStream:
    """A connection whose node stopped reading: every push leaves it over its write-buffer cap."""

    def __init__(self) -> None:
        self.pushed = 0
        self.closed: tuple[ErrorCode, str] | None = None

    def push(self, frame: bytes) -> bool:
        self.pushed += 1
        return self.pushed == 1              # the first (the subscribe's own) fits; then the buffer is full

    def close(self, code: ErrorCode, message: str, leader: str = "") -> None:
        self.closed = (code, message)

    def kernel_silence_s(self) -> float:
        return 0.0


async def test_a_slow_reader_is_closed_once_over_its_cap_and_its_node_is_kept() -> None:
    coord = Coordinator()
    await coord.start()
    hub = StreamHub(coord)
    try:
        statuses = [await coord.handle("j", _join(n)) for n in ("a", "b")]
        slow = SlowStream()
        sub = hub.opened("j", "a", slow)
        hub.subscribe(sub, statuses[0].credential, -1, 0)
        await coord.handle("j", _join("c"))          # the round forms: a push to a, which does not read
        for _ in range(100):                          # the flush runs soon after the wake (call_soon)
            if slow.closed:
                break
            await asyncio.sleep(0)
        assert slow.closed is not None and slow.closed[0] is ErrorCode.LIMIT_REACHED
        hub.closed(sub)
        assert hub.counts.closed == {"slow reader": 1}
        node = coord.core.jobs["j"].nodes["a"]
        assert node.holding == 0 and not node.dropped    # not a dropped connection: its lease runs
        assert coord.polls_by_node.held(("j", "a")) == 0
    finally:
        await coord.stop()


def _join(node: str) -> JoinRequest:
    return JoinRequest(v=1, node_id=node, addr="127.0.0.1", local_world_size=1, master_port=1, config=THREE,
                       instance=node)


class QuietStream(SlowStream):
    """A node that sends nothing; `kernel_s`: how long its kernel has received nothing either."""

    def __init__(self, kernel_s: float) -> None:
        super().__init__()
        self.kernel_s = kernel_s

    def push(self, frame: bytes) -> bool:
        return True

    def kernel_silence_s(self) -> float:
        return self.kernel_s


async def test_silence_is_judged_past_the_servers_own_lag_and_with_the_kernels_evidence() -> None:
    coord = Coordinator()
    await coord.start()
    hub = StreamHub(coord)
    try:
        statuses = {n: await coord.handle("j", _join(n)) for n in ("a", "b", "c")}
        streams = {"a": QuietStream(kernel_s=9.0), "b": QuietStream(kernel_s=0.0), "c": QuietStream(kernel_s=9.0)}
        subs = {}
        for n, stream in streams.items():
            subs[n] = hub.opened("j", n, stream)
            hub.subscribe(subs[n], statuses[n].credential, -1, 0)
            subs[n].limit_s = 1.0
            subs[n].heard -= 5.0                   # silent for 5 s by the frames the server has read
            subs[n].heard_wall -= 10.0             # (its last frame, on the coordinator's clock: a lease ago)
        coord.loop_lag = FixedLag(10.0)                 # ... but the server runs 10 s behind: nobody is blamed
        hub._sweep()
        assert all(s.closed is None for s in streams.values())
        coord.loop_lag = FixedLag(0.0)                  # caught up: a and c are silent; b's kernel heard it just now
        hub._sweep()
        assert streams["a"].closed is not None and streams["a"].closed[0] is ErrorCode.LIMIT_REACHED
        assert streams["b"].closed is None and streams["c"].closed is not None
        closed_at = coord.clock()
        hub.closed(subs["a"])
        node = coord.core.jobs["j"].nodes["a"]
        # the lease runs again, from the last sign of life before the close (not from the close)
        assert node.holding == 0 and not node.dropped and node.last_seen < closed_at
        assert node.lease_expires == node.last_seen + THREE.lease_timeout_s
        assert hub.counts.closed == {"silent": 1}
    finally:
        coord.loop_lag = None
        await coord.stop()


class AskedStream(QuietStream):
    """A QuietStream that counts how often the sweep asks its kernel."""

    def __init__(self, kernel_s: float) -> None:
        super().__init__(kernel_s)
        self.asked = 0

    def kernel_silence_s(self) -> float:
        self.asked += 1
        return super().kernel_silence_s()


async def test_the_sweep_asks_the_kernel_only_about_streams_silent_past_their_limit() -> None:
    # A TCP_INFO read per open stream per sweep was half the server's CPU at 10,000 streams; the
    # kernel's evidence can only shorten a silence, so a stream heard within its limit needs none.
    coord = Coordinator()
    await coord.start()
    hub = StreamHub(coord)
    try:
        statuses = {n: await coord.handle("j", _join(n)) for n in ("a", "b")}
        streams = {"a": AskedStream(kernel_s=9.0), "b": AskedStream(kernel_s=9.0)}
        for n, stream in streams.items():
            sub = hub.opened("j", n, stream)
            hub.subscribe(sub, statuses[n].credential, -1, 0)
            sub.limit_s = 1.0
            if n == "b":
                sub.heard -= 5.0                       # b: silent past its limit by the frames read
        hub._sweep()
        assert streams["a"].asked == 0 and streams["a"].closed is None
        assert streams["b"].asked == 1 and streams["b"].closed is not None
    finally:
        await coord.stop()


async def test_a_heartbeat_shows_a_subscribed_node_as_seen_and_an_unsubscribed_stream_speaks_for_nobody() -> None:
    clock = [1000.0]
    coord = Coordinator(clock=lambda: clock[0])
    await coord.start()
    hub = StreamHub(coord)
    try:
        statuses = {n: await coord.handle("j", _join(n)) for n in ("a", "b")}
        held = hub.opened("j", "a", QuietStream(kernel_s=0.0))
        hub.subscribe(held, statuses["a"].credential, -1, 0)
        hello_only = hub.opened("j", "b", QuietStream(kernel_s=0.0))     # said hello as b, never subscribed
        nodes = coord.core.jobs["j"].nodes
        b_seen = nodes["b"].last_seen
        clock[0] += 30.0
        hub.heard(held)
        hub.heard(hello_only)
        assert nodes["a"].last_seen == clock[0]      # the views show a lease age of 0, not 30 s
        assert nodes["b"].last_seen == b_seen         # no credential shown: nothing said for b
    finally:
        await coord.stop()
