"""Simulated agents for the failover benchmark: each speaks the wire with aiohttp and plain msgpack,
carries the credential its join reply gave on every later request, and keeps one long-poll held
(wait_s 60, as node-agent asks) while it is a member or waiting. Like node-agent it follows the
leader among replicas: a `not_leader` reply names it (Rdzv-Leader), an unreachable replica is
skipped, and any other retryable refusal is retried after a short jittered pause.

Every write the server acknowledges (HTTP 200) is recorded, so the benchmark can check that the
replica that takes over holds every one of them.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import msgpack

HEADERS = {"Content-Type": "application/msgpack"}
RETRYABLE = {"shutting_down", "store_unavailable", "limit_reached", "not_leader"}


class Refused(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


@dataclass
class Acked:
    """What the servers acknowledged, per job: the highest restart count and the nodes that joined."""
    restarts: dict[str, int] = field(default_factory=dict)
    joined: dict[str, set[str]] = field(default_factory=dict)
    count: int = 0

    def note(self, job: str, node: str, action: str, reply: dict) -> None:
        self.count += 1
        if action == "failure":
            self.restarts[job] = max(self.restarts.get(job, 0), reply["restart_count"])
        elif action == "join":
            self.joined.setdefault(job, set()).add(node)


class Fleet:
    def __init__(self, session: aiohttp.ClientSession, replicas: list[str], config: dict) -> None:
        self.session = session
        self.replicas = replicas
        self.config = config
        self.acked = Acked()
        self.renewed_at: dict[str, float] = {}   # node -> send time of its first poll answered since `mark`
        self.mark = 0.0
        self.agents: list[SimAgent] = []
        self.all_renewed = asyncio.Event()          # set once every agent has a renewed_at
        self.lost: list[str] = []                   # agents the server declared lost
        self.refused: list[str] = []                # joins refused (none expected)

    def add(self, job: str, node: str) -> SimAgent:
        agent = SimAgent(self, job, node)
        self.agents.append(agent)
        agent.task = asyncio.create_task(agent.run())
        return agent

    async def close(self) -> None:
        for agent in self.agents:
            if agent.task is not None:
                agent.task.cancel()
        await asyncio.gather(*(a.task for a in self.agents if a.task is not None), return_exceptions=True)


class SimAgent:
    def __init__(self, fleet: Fleet, job: str, node: str) -> None:
        self.fleet, self.job, self.node = fleet, job, node
        self.server = fleet.replicas[0]
        self.credential = ""
        self.round = -1
        self.member = False
        self.assigned = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.doing = ""                  # what it is waiting for, for a report on agents that do not renew

    async def call(self, action: str, body: dict, timeout: float = 75.0) -> dict:
        """POST until a server answers 200 or refuses for good; follows the leader."""
        body = {"v": 1, "node_id": self.node, "credential": self.credential, **body}
        data = msgpack.packb(body)
        tries = 0
        while True:
            sent = time.time()
            server = self.server
            self.doing = f"{action} at {server} since {sent:.3f} (try {tries})"
            try:
                async with self.fleet.session.post(f"{server}/v1/jobs/{self.job}/{action}", data=data,
                                                   headers=HEADERS, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    reply = msgpack.unpackb(await r.read())
                    leader = r.headers.get("Rdzv-Leader", "")
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self.doing += f": {type(exc).__name__} {exc}"
                self._skip(server)
                tries += 1
                await asyncio.sleep(min(0.5, 0.05 * 2 ** tries) * random.uniform(0.5, 1.0))
                continue
            if status == 200:
                if action != "poll":
                    self.fleet.acked.note(self.job, self.node, action, reply)
                elif sent >= self.fleet.mark and self.node not in self.fleet.renewed_at:
                    self.fleet.renewed_at[self.node] = sent
                    if len(self.fleet.renewed_at) >= len(self.fleet.agents):
                        self.fleet.all_renewed.set()
                if reply.get("credential"):
                    self.credential = reply["credential"]
                return reply
            code = reply.get("code", "")
            self.doing += f": {code}"
            if code == "not_leader" and leader and leader != server:
                self.server = leader.rstrip("/")
                continue
            if code in RETRYABLE:
                if code == "not_leader":
                    self._skip(server)
                tries += 1
                await asyncio.sleep(min(0.5, 0.05 * 2 ** tries) * random.uniform(0.5, 1.0))
                continue
            raise Refused(code)

    def _skip(self, server: str) -> None:
        replicas = self.fleet.replicas
        if self.server == server:
            self.server = replicas[(replicas.index(server) + 1) % len(replicas)] if server in replicas else replicas[0]

    async def run(self) -> None:
        join = {"addr": "127.0.0.1", "local_world_size": 8, "master_port": 20000, "config": self.fleet.config,
                "instance": f"{self.node}#1"}
        reply = await self.join(join)
        while True:
            self._see(reply)
            if reply.get("node_state") == "gone":      # lost while away: join again, as node-agent does
                self.fleet.lost.append(self.node)
                reply = await self.join(join)
                continue
            try:
                reply = await self.call("poll", {"known_round": self.round if self.member else -1, "wait_s": 60.0})
            except Refused:
                reply = await self.join(join)

    async def join(self, body: dict) -> dict:
        """Join; a refusal is recorded and the join tried again each second (node-agent retries a
        node_conflict for a lease, and gives up on the others; here they are counted)."""
        while True:
            try:
                return await self.call("join", body)
            except Refused as exc:
                self.fleet.refused.append(f"{self.node}: join {exc.code}")
                await asyncio.sleep(1.0)

    def _see(self, reply: dict) -> None:
        self.member = reply.get("node_state") == "member"
        if self.member and reply.get("assignment") is not None:
            self.round = reply["round_id"]
            self.assigned.set()

    async def fail(self) -> None:
        """Report a worker failure in its round (the job restarts: a new round for every member)."""
        failure = {"local_rank": 0, "rank": 0, "exitcode": 1, "message": "simulated", "timestamp": time.time()}
        await self.call("failure", {"round_id": self.round, "failures": [failure]})
