"""The lag rule: a server whose own event loop stalls for longer than the lease declares no node
lost (the requests that would have renewed the leases were waiting in its own backlog).

The agents run on another thread with their own event loop, as agents on other hosts would, so
their polls keep arriving while the server's loop is stuck."""
from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import msgpack

from rdzv_server.core.events import EventKind
from rdzv_server.looplag import LoopLagMeter
from rdzv_server.web.app import COORDINATOR, create_app
from tests.integration.support import start_app, url, wait_until

LEASE = 1.0
MSGPACK = {"Content-Type": "application/msgpack"}


async def test_the_probe_reports_a_stall_still_in_progress():
    probe = LoopLagMeter()
    probe.start()
    try:
        await asyncio.sleep(0.2)                  # the probe has run: no stall
        assert probe.recent_s() < 0.5             # (a loaded machine's own stall may count: under the one made below)
        time.sleep(1.0)      # noqa: ASYNC251 - the loop is stuck on purpose: nobody has run since
        assert probe.recent_s() >= 0.9
    finally:
        await probe.stop()


def agents(base: str, stop: threading.Event, polls: list[int]) -> None:
    """Two agents polling all along (short holds), on their own loop."""
    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            creds = {}
            for n in ("a", "b"):
                body = {"v": 1, "node_id": n, "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1,
                        "config": {"min_nodes": 2, "max_nodes": 2, "lease_timeout_s": LEASE, "last_call_s": 0}}
                async with http.post(f"{base}/join", data=msgpack.packb(body), headers=MSGPACK) as r:
                    creds[n] = msgpack.unpackb(await r.read())["credential"]

            async def poll(n: str) -> None:
                while not stop.is_set():
                    body = {"v": 1, "node_id": n, "credential": creds[n], "known_round": 1, "wait_s": 0.05}
                    async with http.post(f"{base}/poll", data=msgpack.packb(body), headers=MSGPACK) as r:
                        await r.read()
                    polls.append(1)
            await asyncio.gather(poll("a"), poll("b"))
    asyncio.run(main())


async def test_a_stalled_server_blames_no_node_for_its_own_stall():
    srv = await start_app(create_app())
    stop, polls = threading.Event(), []
    thread = threading.Thread(target=agents, args=(url(srv, "/v1/jobs/j"), stop, polls), daemon=True)
    thread.start()
    try:
        await wait_until(lambda: len(polls) >= 20, 30)      # both agents poll, round 1 runs
        time.sleep(2.5 * LEASE)   # noqa: ASYNC251 - the server's loop stalls (a GC pause, a blocked handler)
        seen = len(polls)
        await wait_until(lambda: len(polls) >= seen + 20, 30)   # the polls that waited in the backlog, and more
        job = srv.app[COORDINATOR].core.jobs["j"]
        assert not [e.message for e in job.events if e.kind == EventKind.NODE_LOST]
        assert job.round.round_id == 1 and set(job.nodes) == {"a", "b"}
    finally:
        stop.set()
        await wait_until(lambda: not thread.is_alive(), 30)     # its last polls need this loop to answer
        await srv.close()
