"""Well-behaved traffic during `make fuzz`: a /healthz probe, and a live job whose agents must never
notice the attack (every request answered 200, no node lost, rounds keep forming).

Spoken with aiohttp and the plain `msgpack` package, as another agent implementation would.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import msgpack

CONFIG = {"min_nodes": 2, "max_nodes": 2, "max_restarts": 1_000_000, "last_call_s": 0.0, "exclude_after": 0}
FAIL_EVERY_S = 3.0
POLL_WAIT_S = 2.0


class HealthProbe:
    def __init__(self, port: int, limit_s: float) -> None:
        self.url = f"http://127.0.0.1:{port}/healthz"
        self.limit_s = limit_s
        self.count = self.failures = 0
        self.slowest_s = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=self.limit_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    async with http.get(self.url) as resp:
                        ok = resp.status == 200 and (await resp.json()).get("ok") is True
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok = False
                self.count += 1
                self.failures += not ok
                self.slowest_s = max(self.slowest_s, time.monotonic() - started)
                await asyncio.sleep(0.2)


class LiveJob:
    """Two nodes of one job, each keeping a long-poll in flight; node a reports a worker failure every
    few seconds, so a new round forms and both must follow it."""

    def __init__(self, port: int, limit_s: float) -> None:
        self.base = f"http://127.0.0.1:{port}/v1/jobs/live-job"
        self.limit_s = limit_s
        self.requests = 0
        self.rounds = 0
        self.problems: list[str] = []
        self.credentials: dict[str, Any] = {}
        self.known_round = {"a": -1, "b": -1}

    async def post(self, http: aiohttp.ClientSession, node: str, action: str, **fields: Any) -> dict[str, Any] | None:
        body = {"v": 1, "node_id": node, **fields}
        if self.credentials.get(node) is not None:
            body["credential"] = self.credentials[node]
        self.requests += 1
        started = time.monotonic()
        try:
            async with http.post(f"{self.base}/{action}", data=msgpack.packb(body),
                                 headers={"Content-Type": "application/msgpack"}) as resp:
                reply = msgpack.unpackb(await resp.read())
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            self.problems.append(f"{node} {action}: no reply ({type(exc).__name__}: {exc}) after "
                                 f"{time.monotonic() - started:.1f} s")
            return None
        if status != 200:
            self.problems.append(f"{node} {action}: HTTP {status} {reply}")
            return None
        if reply.get("node_state") == "gone" or (reply.get("job_state") != "running" and action != "join"):
            self.problems.append(f"{node} {action}: node {reply.get('node_state')}, job {reply.get('job_state')}: "
                                 f"{reply.get('reason')}")
        return reply

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.limit_s + POLL_WAIT_S)) as http:
            for node, port in (("a", 3001), ("b", 3002)):
                reply = await self.post(http, node, "join", addr="10.9.0.1", local_world_size=1, master_port=port,
                                        config=CONFIG, instance=f"live-{node}")
                if reply is None:
                    return
                self.credentials[node] = reply.get("credential")
            await asyncio.gather(self.poll_loop(http, "a", stop), self.poll_loop(http, "b", stop),
                                 self.fail_loop(http, stop))

    async def poll_loop(self, http: aiohttp.ClientSession, node: str, stop: asyncio.Event) -> None:
        while not stop.is_set() and len(self.problems) < 20:
            reply = await self.post(http, node, "poll", known_round=self.known_round[node], wait_s=POLL_WAIT_S)
            if reply is not None and reply.get("assignment"):
                new = reply["assignment"]["round_id"]
                if new != self.known_round[node]:
                    self.known_round[node] = new
                    self.rounds = max(self.rounds, new)

    async def fail_loop(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set() and len(self.problems) < 20:
            try:
                await asyncio.wait_for(stop.wait(), FAIL_EVERY_S)
            except asyncio.TimeoutError:
                pass
            if not stop.is_set() and self.known_round["a"] > 0:
                await self.post(http, "a", "failure", round_id=self.known_round["a"], failures=[
                    {"local_rank": 0, "rank": 0, "exitcode": 1, "message": "live job: planned failure"}])
