"""One client process of `bench_scale.py`: many simulated nodes that talk to the server as the agent does.

Each simulated node speaks through the agent's `Transport` (the typed wire, the credential from its
join on every later request, the agent's error mapping) over a lean HTTP/1.1 connection of its own
(scale_wire.py: cheap enough that the clients stay out of the way on 2 cores, and it times each
reply by the kernel's receive time), and follows the
agent's rules (node_agent/server_link.py, policy.py): one long-poll always in flight asking for the
longest hold (`wait_s` 60), the next one sent as soon as one returns, the agent's jittered
exponential backoff after a try that got no answer (or a retryable refusal), a join refused as
`node_conflict` tried again every second for a lease and 2 s more, a fresh join when told `gone` or
when a poll is refused for an unknown job or node, and an exit when anything else is refused. It
runs no workers, so `known_round` is the last round it was assigned.

The nodes of a process are spread over several loopback source addresses (127.0.0.0/8), as a real
fleet comes from many hosts: the server limits the long-polls it holds for one address
(--max-polls-per-peer). A failure report goes on a second connection, as the agent's does while its
long-poll is held.

The controller drives the process over a pipe (commands below); every time is `time.monotonic()`,
which on Linux is one clock for every process of the machine.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import psutil

from benchmarks.scale_wire import WireClient
from node_agent.client.path_check import ANSWER_WAIT_S, CHECK_TIMEOUT_S, PathCheck, answer_due
from node_agent.client.readyz import readyz_status
from node_agent.client.replies import CONFLICT_RETRY_S, Refusal, conflict_retry_for, refusal
from node_agent.client.retry import Backoff
from node_agent.client.transport import ServerRejected, ServerUnreachable
from protocol.bounds import MAX_POLL_WAIT_S
from protocol.messages import FailureReport, JobConfig, JoinRequest, NodeState, NodeStatus, PollRequest, WorkerFailure
from protocol.notes import ProgressNote

LAG_PROBE_S = 0.02          # the client's own loop-lateness probe interval


@dataclass
class NodeSpec:
    job_id: str
    node_id: str
    addr: str                    # loopback source address the node's connections come from
    config: JobConfig
    witness_port: int = 29600      # the agent's witness port in its join (0: a client without one)
    progress: bool = False       # polls carry a progress note, as an agent's with workers stepping does


@dataclass
class Tally:
    polls: int = 0                          # polls answered (HTTP 200)
    polls_by_second: Counter[int] = field(default_factory=Counter)
    rejoins: int = 0                        # joins after the first (told gone, or job/node unknown)
    unreachable: Counter[str] = field(default_factory=Counter)   # tries that got no answer, by kind
    refused: Counter[str] = field(default_factory=Counter)       # typed refusals, by code
    exited: int = 0                         # nodes that stopped as the agent would (a refused join, ...)
    crashes: list[str] = field(default_factory=list)     # a simulated node's own bug: the run is void
    reissue: list[float] = field(default_factory=list)   # answer -> this node's next poll sent (own lateness)
    gone: list[tuple[float, float]] = field(default_factory=list)   # told gone: (own gap before the poll, its RTT)
    path_checks: int = 0                    # rounds of /readyz checks over fresh connections (overdue answers)
    resent: list[float] = field(default_factory=list)   # when a request went again once a check found the path back

    def lateness(self) -> dict[str, float]:
        """How late the nodes sent their next poll after an answer (p99, max, ms), since the last call."""
        gaps, self.reissue = sorted(self.reissue), []
        if not gaps:
            return {"reissue_p99_ms": 0.0, "reissue_max_ms": 0.0}
        return {"reissue_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))], "reissue_max_ms": 1000 * gaps[-1]}


class SimNode:
    def __init__(self, spec: NodeSpec, port: int, tally: Tally) -> None:
        self.spec = spec
        self.client = WireClient(port, spec.job_id, spec.node_id, spec.addr)      # joins and polls
        self.reporter = WireClient(port, spec.job_id, spec.node_id, spec.addr)    # reports, beside a held poll
        self.tally = tally
        self.instance = secrets.token_hex(6)
        self.known_round = -1
        self.join_sent: float | None = None       # the first join's send time
        self.join_answered: float | None = None   # the first join's reply time
        self.seen: dict[int, float] = {}          # round id -> when this node first held its assignment
        self.answered_at = 0.0                    # when the last answer to this node's own loop came
        self.poll_sent = 0.0
        self.poll_gap = 0.0                       # the last answer -> the poll now in flight
        self.finished = False
        self.hold_s = 0.0                         # the longest hold the server said it gives this node's polls
        self.path = PathCheck(self._readyz)        # the agent's "is the path back?" (client/path_check.py)

    async def run(self) -> None:
        try:
            await self._join()
            while not self.finished:
                self.poll_sent = time.monotonic()
                self.poll_gap = self.poll_sent - self.answered_at
                self.tally.reissue.append(self.poll_gap)
                status = await self._until_answered("poll", self._poll)
                self.answered_at = self.client.arrived
                if status is not None:
                    self.tally.polls += 1
                    self.tally.polls_by_second[int(time.monotonic())] += 1
                    await self.on_status(status)
        except _Exit:
            self.tally.exited += 1
        except Exception as exc:     # a bug of the harness: the controller stops the run and shows it
            self.tally.crashes.append(f"{self.spec.node_id}: {traceback.format_exc(limit=-3)}")
            raise exc

    async def _join(self) -> None:
        if self.join_sent is None:
            self.join_sent = time.monotonic()
        else:
            self.tally.rejoins += 1
        cfg = self.spec.config
        status = await self._until_answered("join", lambda: self.client.join(
            addr=self.spec.addr, host=self.spec.node_id, local_world_size=8, master_port=29500,
            config=cfg, instance=self.instance, role="default", witness_port=self.spec.witness_port))
        if status is None:
            raise _Exit()
        self.answered_at = self.client.arrived
        if self.join_answered is None:
            self.join_answered = self.answered_at
        await self.on_status(status)

    async def on_status(self, status: NodeStatus, arrived: float | None = None) -> None:
        """Act on a status as the agent's policy does (no workers: only the round it would run)."""
        if status.poll_hold_s > 0:         # what the agent's client keeps (client/http.py): its polls ask no longer
            self.hold_s = self.client.hold_s = status.poll_hold_s
        if status.job_state.finished:
            self.finished = True
        elif status.node_state == NodeState.GONE:
            # Evidence for whoever declared this node lost: was it late itself, or did its poll wait?
            if len(self.tally.gone) < 10_000:
                self.tally.gone.append((self.poll_gap, self.client.arrived - self.poll_sent))
            self.known_round = -1
            await self._join()
        elif status.node_state == NodeState.MEMBER and status.assignment is not None:
            rid = status.assignment.round_id
            if rid != self.known_round:
                self.known_round = rid
                self.seen.setdefault(rid, self.client.arrived if arrived is None else arrived)
        else:
            self.known_round = -1

    def _progress_note(self) -> ProgressNote | None:
        """What an agent whose 8 workers step 10 times a second would say (node_agent/core/progress.py)."""
        if not self.spec.progress or self.known_round < 0:
            return None
        now = time.time()
        started = self.join_sent or time.monotonic()
        steps = int((time.monotonic() - started) * 10)
        return ProgressNote(round_id=self.known_round, probes=8, steps=steps, first_step_at=now - steps / 10,
                            last_step_at=now, step_s=0.1, window_s=1.7, window_steps=17, demand=0.6)

    async def _poll(self) -> NodeStatus:
        """One poll as the agent's client sends it (client/http.py): once its answer is overdue, the path
        is checked over fresh connections; once a check is answered, the poll goes again on a new
        connection, the stalled one closed."""
        due = answer_due("poll", MAX_POLL_WAIT_S, self.hold_s)
        while True:
            request = asyncio.ensure_future(self.client.poll(self.known_round, MAX_POLL_WAIT_S,
                                                             progress=self._progress_note()))
            try:
                done, _ = await asyncio.wait({request}, timeout=due)
                if done or not await self._path_back(request):
                    return await request         # type: ignore[no-any-return]
                self.tally.resent.append(time.monotonic())
                due *= 2                         # a server slow but there is waited for longer
            finally:
                if not request.done():
                    request.cancel()             # WireClient closes a connection cancelled mid-request
                await asyncio.gather(request, return_exceptions=True)

    async def _path_back(self, request: asyncio.Future[Any]) -> bool:
        """Checks (one now, then on the schedule) until one is answered (True) or `request` is (False)."""
        self.tally.path_checks += 1
        if await self.path.check(["server"]) is not None:
            return not request.done()
        back = asyncio.ensure_future(self.path.until_back(lambda: ["server"]))
        try:
            await asyncio.wait({request, back}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not back.done():
                back.cancel()
            await asyncio.gather(back, return_exceptions=True)
        return not request.done()

    async def _readyz(self, _endpoint: str) -> int | None:
        """The server's /readyz status over a new connection from this node's address (None: no answer):
        the agent's probe (client/readyz.py)."""
        return await readyz_status(f"http://127.0.0.1:{self.client.port}", ssl_context=None,
                                   connect_s=CHECK_TIMEOUT_S, answer_s=ANSWER_WAIT_S, connected=self.path.connected,
                                   local_host=self.spec.addr)

    async def report_failure(self) -> dict[str, Any]:
        """One worker of this node failed: report it for the round it runs (and act on the reply)."""
        round_id = self.known_round
        failure = WorkerFailure(local_rank=0, rank=0, exitcode=1, message="bench_scale: simulated failure",
                                timestamp=time.time())
        self.reporter.credential = self.client.credential
        sent = time.monotonic()
        status = await self._until_answered("failure", lambda: self.reporter.report_failure(round_id, [failure]))
        answered = self.reporter.arrived
        out = {"node_id": self.spec.node_id, "old_round": round_id, "sent": sent, "answered": answered,
               "accepted": bool(status and status.accepted), "reason": status.reason if status else "refused",
               "new_round": status.round_id if status else -1}
        if status is not None:
            await self.on_status(status, answered)
        return out

    async def _until_answered(self, what: str, call: Any) -> NodeStatus | None:
        """The agent's retry rules (the client core's backoff and refusal rules): None when refused for good."""
        backoff = Backoff()
        conflict_since: float | None = None
        request = {"join": JoinRequest, "poll": PollRequest}.get(what, FailureReport)
        while True:
            try:
                return await call()     # type: ignore[no-any-return]
            except ServerRejected as exc:
                self.tally.refused[exc.code] += 1
                meaning = refusal(exc.code, request)
                if meaning is Refusal.CONFLICT:
                    # Maybe our own earlier try, answered too late: wait out its lease, then give up.
                    now = time.monotonic()
                    conflict_since = now if conflict_since is None else conflict_since
                    if now - conflict_since < conflict_retry_for(self.spec.config.lease_timeout_s):
                        await asyncio.sleep(CONFLICT_RETRY_S)
                        continue
                if meaning is Refusal.FORGOTTEN:
                    self.known_round = -1
                    await self._join()
                    return None
                if meaning is Refusal.DROPPED:
                    return None           # a refused report: dropped, as the agent does
                raise _Exit() from None
            except ServerUnreachable as exc:
                self.tally.unreachable[str(exc).split(":")[0][:60]] += 1
                # The agent's retry (client/retry.py): once the server answers a fresh connection again,
                # at once; the backoff only when it answered at once (the failure was not the path).
                if await self.path.check(["server"]) is not None:
                    await backoff.pause()
                else:
                    await self.path.until_back(lambda: ["server"])
                    self.tally.resent.append(time.monotonic())


class _Exit(Exception):
    """The node stops, as the agent would exit."""


class LagProbe:
    """How late this process's own event loop runs: a client that is late makes the server look slow."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)        # the measurement itself
            self.lags.append(max(0.0, time.monotonic() - t0 - LAG_PROBE_S))

    def take(self) -> dict[str, float]:
        lags, self.lags = sorted(self.lags), []
        if not lags:
            return {"p99_ms": 0.0, "max_ms": 0.0, "samples": 0}
        return {"p99_ms": 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))], "max_ms": 1000 * lags[-1],
                "samples": len(lags)}


class Fleet:
    """The simulated nodes of one client process and the commands the controller sends it."""

    def __init__(self, port: int, specs: list[NodeSpec]) -> None:
        self.port = port
        self.specs = specs
        self.tally = Tally()
        self.nodes: dict[str, SimNode] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.probe = LagProbe()
        self.proc = psutil.Process()

    async def open(self) -> None:
        for spec in self.specs:
            self.nodes[f"{spec.job_id}/{spec.node_id}"] = SimNode(spec, self.port, self.tally)
        self.tasks.append(asyncio.create_task(self.probe.run()))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for node in self.nodes.values():
            node.client.close()
            node.reporter.close()

    async def command(self, cmd: dict[str, Any]) -> Any:
        what = cmd["cmd"]
        if what == "start":
            self.tasks.extend(asyncio.create_task(node.run()) for node in self.nodes.values())
            return {"started": time.monotonic()}
        if what == "progress":       # how many nodes hold at least their job's `min_round` (counts only)
            want = cmd["min_round"]
            return {"holding": sum(1 for n in self.nodes.values()
                                   if n.known_round > 0 and n.known_round >= want.get(n.spec.job_id, 1 << 62)),
                    "exited": self.tally.exited, "crashes": self.tally.crashes[:3]}
        if what == "times":          # per node of `job`: first join sent/answered, when it first held each round
            return [{"key": k, "join_sent": n.join_sent, "join_answered": n.join_answered, "seen": n.seen}
                    for k, n in self.nodes.items() if n.spec.job_id == cmd["job"]]
        if what == "fail":
            return await self.nodes[cmd["key"]].report_failure()
        if what == "window":         # a measured window ends: this process's CPU, lag and polls since last time
            cpu = self.proc.cpu_times()
            t = self.tally
            out = {"cpu_s": cpu.user + cpu.system, "t": time.monotonic(), "lag": self.probe.take(),
                   "polls": t.polls, "polls_by_second": dict(t.polls_by_second), "rejoins": t.rejoins,
                   "unreachable": dict(t.unreachable), "refused": dict(t.refused), "exited": t.exited,
                   "rss_mib": self.proc.memory_info().rss / 2 ** 20,
                   **t.lateness(), "gone": list(t.gone), "path_checks": t.path_checks, "resent": t.resent[-20_000:]}
            t.polls_by_second.clear()
            return out
        raise ValueError(f"unknown command {what!r}")


def client_main(port: int, specs: list[NodeSpec], conn: Connection, new_session: bool = False) -> None:
    """Entry point of a client process: serve the controller's commands until `stop`. `new_session`:
    in a session of its own, so the controller can give its scheduler autogroup a priority."""
    if new_session:
        os.setsid()
    async def main() -> None:
        fleet = Fleet(port, specs)
        await fleet.open()
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        loop.add_reader(conn.fileno(), lambda: inbox.put_nowait(conn.recv()))
        conn.send({"ready": True})
        while True:
            cmd = await inbox.get()       # the controller sends one command and waits for its answer
            if cmd["cmd"] == "stop":
                break
            conn.send(await fleet.command(cmd))
        loop.remove_reader(conn.fileno())
        await fleet.close()
        conn.send({"stopped": True})

    asyncio.run(main())
