"""The agent's one loop: wires the server client, the supervision policy and the worker group.

Three sources of facts run concurrently: the long-poll (always one in flight), the local worker
group (its `wait()` returns the moment a worker fails or all finish) and the signal queue. Each
fact goes through the policy; the actions it returns are executed here, in order.
"""
from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from typing import TextIO

from protocol.errors import ErrorCode
from protocol.messages import Assignment, NodeStatus, WorkerFailure
from node_agent.transport import ServerRejected, ServerUnreachable, Transport, free_port
from node_agent.environment import worker_argv, worker_env
from node_agent.hangwatch import HangWatch
from node_agent.options import AgentOptions
from node_agent.policy import (Action, Exit, Leave, Rejoin, ReportFailure, ReportSuccess, Spawn, StopWorkers,
                               SupervisionPolicy)
from node_agent.error_file import read_error_file
from node_agent.launch import WorkerLaunch
from node_agent.worker import WorkerExit
from node_agent.workers import WorkerGroup

POLL_WAIT_S = 2.0
# Retry pause cap while the server is away: a restarted server sees every agent back within about this.
BACKOFF_MAX_S = 0.5
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class AgentError(Exception):
    """A condition that ends the agent with one clear line (no traceback)."""


class Agent:
    def __init__(self, opts: AgentOptions, transport: Transport, addr: str, console: TextIO = sys.stderr) -> None:
        self.opts = opts
        self.transport = transport
        self.console = console
        self.hostname = socket.gethostname()
        self.instance = uuid.uuid4().hex[:12]
        self.addr = addr
        self.policy = SupervisionPolicy(server_wait_s=max(opts.server_wait, opts.job.lease_timeout_s))
        self.group: WorkerGroup | None = None
        self._group_task: asyncio.Task | None = None
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._signalled = asyncio.Event()   # set with every queued signal: cuts backoff waits short
        self._attempts = 0
        self._signal_count = 0
        self._hang_task: asyncio.Task | None = None
        self._exit: Exit | None = None
        self._log_root = opts.log_dir
        self._tmp_root: str | None = None
        self.hangs = HangWatch(opts.hang_timeout) if opts.hang_timeout > 0 else None
        self._first_beat = asyncio.Event()
        self._last_view: tuple | None = None

    def say(self, message: str) -> None:
        for line in message.splitlines() or [""]:
            print(f"[node-agent {self.opts.node_id}] {line}", file=self.console, flush=True)

    @staticmethod
    def now() -> float:
        return time.monotonic()

    # -- main loop --

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in FORWARDED_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        if self._log_root is None:
            self._tmp_root = tempfile.mkdtemp(prefix="node-agent-")
        try:
            async with self.transport as client:
                self.client = client
                return await self._run()
        finally:
            for sig in FORWARDED_SIGNALS:
                loop.remove_signal_handler(sig)
            if self.group is not None:
                await self.group.stop()
            if self._tmp_root:
                shutil.rmtree(self._tmp_root, ignore_errors=True)

    async def _run(self) -> int:
        status = await self._join()
        if status is not None:
            await self._apply(self.policy.on_status(status, self.now()))
        poll_task: asyncio.Task | None = None
        signal_task = asyncio.create_task(self._signals.get())
        try:
            while self._exit is None:
                if poll_task is None:
                    poll_task = asyncio.create_task(self._poll_once(self.policy.known_round))
                waiting = {poll_task, signal_task} | ({self._group_task} if self._group_task else set())
                if self._hang_task is not None:
                    waiting.add(self._hang_task)
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if signal_task in done:
                    signum = signal_task.result()
                    if self._signals.empty():
                        self._signalled.clear()
                    signal_task = asyncio.create_task(self._signals.get())
                    await self._apply(self.policy.on_signal(signum, self.now()))
                    continue
                if self._hang_task is not None and self._hang_task in done:
                    overdue = self._hang_task.result()
                    self._hang_task = None
                    await self._on_hang(overdue)
                    continue
                if self._group_task is not None and self._group_task in done:
                    exits = self._group_task.result()
                    self._group_task = None
                    await self._on_worker_exits(exits)
                    continue
                if poll_task in done:
                    result = poll_task.result()
                    poll_task = None
                    await self._on_server_result(result)
        finally:
            pending = [t for t in (poll_task, signal_task, self._hang_task) if t is not None]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        assert self._exit is not None
        self.say(self._exit.message)
        return self._exit.code

    def _on_signal(self, signum: int) -> None:
        self._signal_count += 1
        if self._signal_count > 1:
            # A second signal forces the exit (like a second Ctrl-C): kill workers, no clean-up.
            if self.group is not None:
                self.group.send_signal(signal.SIGKILL)
            print(f"[node-agent {self.opts.node_id}] second {signal.Signals(signum).name}: forced exit",
                  file=self.console, flush=True)
            os._exit(128 + signum)
        self._signals.put_nowait(signum)
        self._signalled.set()

    async def _poll_once(self, known_round: int) -> NodeStatus | ServerUnreachable | ServerRejected:
        try:
            return await self.client.poll(known_round, POLL_WAIT_S, master_port=free_port(self.addr))
        except (ServerUnreachable, ServerRejected) as exc:
            return exc

    async def _on_server_result(self, result: NodeStatus | ServerUnreachable | ServerRejected) -> None:
        if isinstance(result, ServerRejected):
            await self._apply(self.policy.on_rejected(result.code, result.message, self.now()))
        elif isinstance(result, ServerUnreachable):
            await self._apply(self.policy.on_server_unreachable(str(result), self.now()))
            await self._backoff()
        else:
            self._attempts = 0
            self._describe(result)
            await self._apply(self.policy.on_status(result, self.now()))

    def _describe(self, status: NodeStatus) -> None:
        """Say once when this node starts waiting, becomes a spare or is excluded."""
        view = (status.node_state, status.spare_position, status.round_id)
        if view == self._last_view or status.node_state.value in ("member", "gone"):
            self._last_view = view
            return
        self._last_view = view
        if status.node_state.value == "spare":
            self.say(f"job is at max nodes: waiting as spare #{status.spare_position + 1}")
        elif status.node_state.value == "excluded":
            self.say(f"node excluded for {status.excluded_for_s:.0f}s more: {status.reason}")
        elif status.node_state.value == "waiting":
            self.say(f"waiting for the next round: {status.reason or 'collecting nodes'}")

    async def _backoff(self) -> None:
        """Jittered exponential backoff between retries of an unreachable server (not a sync wait)."""
        self._attempts += 1
        delay = min(BACKOFF_MAX_S, 0.05 * 2 ** self._attempts) * random.uniform(0.5, 1.0)
        try:
            await asyncio.wait_for(self._signalled.wait(), delay)
        except asyncio.TimeoutError:
            pass

    async def _join(self) -> NodeStatus | None:
        opts = self.opts
        while self._exit is None:
            try:
                return await self.client.join(addr=self.addr, host=self.hostname, local_world_size=opts.nproc,
                                              master_port=free_port(self.addr), config=opts.job,
                                              instance=self.instance, role=opts.role)
            except ServerRejected as exc:
                if exc.code == ErrorCode.NODE_DRAINED.value:   # an operator took this node out: done here
                    await self._apply(self.policy.on_drained(exc.message))
                    return None
                raise AgentError(f"the rendezvous server refused to let node {opts.node_id} join job "
                                 f"{opts.job_id!r}: {exc.message}") from None
            except ServerUnreachable as exc:
                await self._apply(self.policy.on_server_unreachable(str(exc), self.now()))
                if not self._signals.empty():
                    await self._apply(self.policy.on_signal(self._signals.get_nowait(), self.now()))
                if self._exit is None:
                    await self._backoff()
        return None

    # -- actions --

    async def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, StopWorkers):
                await self._stop_workers(action)
            elif isinstance(action, Spawn):
                await self._spawn(action.assignment)
            elif isinstance(action, ReportFailure):
                status = await self._report(self.client.report_failure, action.round_id, list(action.failures))
                if status is not None:
                    await self._apply(self.policy.on_status(status, self.now()))
            elif isinstance(action, ReportSuccess):
                status = await self._report(self.client.report_success, action.round_id)
                if status is not None:
                    await self._apply(self.policy.on_status(status, self.now()))
            elif isinstance(action, Rejoin):
                self.say(f"rejoining: {action.reason}")
                status = await self._join()
                if status is not None:
                    await self._apply(self.policy.on_status(status, self.now()))
            elif isinstance(action, Leave):
                try:
                    await self.client.leave(action.reason)
                except (ServerUnreachable, ServerRejected):
                    pass  # leaving is a courtesy: the lease expires anyway
            elif isinstance(action, Exit):
                self._exit = action

    async def _report(self, fn, *args) -> NodeStatus | None:
        """Send a report, retrying while the server is away (within the policy's window)."""
        while self._exit is None:
            try:
                return await fn(*args)
            except ServerRejected as exc:
                self.say(f"server rejected the report: {exc.message}")
                return None
            except ServerUnreachable as exc:
                await self._apply(self.policy.on_server_unreachable(str(exc), self.now()))
                if self._exit is None:
                    await self._backoff()
        return None

    async def _spawn(self, a: Assignment) -> None:
        opts = self.opts
        attempt_dir = os.path.join(self._log_root or self._tmp_root or ".", opts.job_id, opts.node_id,
                                   f"attempt_{a.round_id}")
        argv = worker_argv(opts)
        launches = []
        for local_rank in range(a.local_world_size):
            rank_dir = os.path.join(attempt_dir, str(local_rank))
            os.makedirs(rank_dir, exist_ok=True)
            env = worker_env(base=os.environ, assignment=a, local_rank=local_rank, job_id=opts.job_id,
                             role=opts.role, error_file=os.path.join(rank_dir, "error.json"))
            rank = a.rank_offset + local_rank
            launches.append(WorkerLaunch(
                local_rank=local_rank, rank=rank, argv=argv, env=env,
                log_dir=rank_dir if self._log_root else None,
                redirect=opts.redirects.for_rank(local_rank), tee=opts.tee.for_rank(local_rank),
                echo=opts.local_ranks_filter is None or local_rank in opts.local_ranks_filter,
                prefix=f"[{self.hostname}:{rank}]", heartbeat=self.hangs is not None))
        self.say(f"round {a.round_id}: group rank {a.group_rank}/{a.group_world_size}, ranks "
                 f"{a.rank_offset}..{a.rank_offset + a.local_world_size - 1} of world size {a.world_size}, "
                 f"master {a.master_addr}:{a.master_port}, restart count {a.restart_count}/{a.max_restarts}")
        if self.hangs is not None:
            self.hangs.reset()
        self.group = WorkerGroup(launches, stop_timeout=opts.stop_timeout,
                                 on_beat=self._on_beat if self.hangs is not None else None)
        try:
            await self.group.start()
        except OSError as exc:
            await self.group.stop()
            self.group = None
            failure = WorkerFailure(local_rank=0, rank=a.rank_offset, exitcode=127, reason="spawn failed",
                                    message=f"cannot start {argv[0]!r}: {exc.strerror or exc}",
                                    timestamp=time.time(), host=self.hostname)
            await self._apply(self.policy.on_workers_failed([failure], self.now()))
            return
        self._group_task = asyncio.create_task(self.group.wait())
        if self.hangs is not None:
            self._hang_task = asyncio.create_task(self._watch_hangs(self.hangs))

    async def _stop_workers(self, action: StopWorkers) -> None:
        if self._hang_task is not None:
            self._hang_task.cancel()
            self._hang_task = None
        if self._group_task is not None:
            self._group_task.cancel()
            self._group_task = None
        if self.group is not None:
            group, self.group = self.group, None
            keeper = asyncio.create_task(self._keep_lease())
            try:
                await group.stop(action.signum)   # up to --stop-timeout: the lease must not lapse meanwhile
            finally:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)

    async def _keep_lease(self) -> None:
        """Renew the lease with instant polls while the loop is busy (no long-poll in flight)."""
        interval = max(0.2, self.opts.job.lease_timeout_s / 3)
        while True:
            await asyncio.sleep(interval)   # periodic renewal, not synchronisation
            try:
                await self.client.poll(self.policy.known_round, 0.0)
            except (ServerUnreachable, ServerRejected):
                pass

    # -- hang detection --

    def _on_beat(self, local_rank: int) -> None:
        assert self.hangs is not None
        self.hangs.beat(local_rank, self.now())
        self._first_beat.set()

    async def _watch_hangs(self, watch: HangWatch) -> list[int]:
        """Return the local ranks that stopped beating; sleeps until the watch's next deadline."""
        while True:
            deadline = watch.next_deadline()
            if deadline is None:
                self._first_beat.clear()
                await self._first_beat.wait()
                continue
            group = self.group
            for exited in group.exits() if group is not None else []:
                watch.forget(exited.local_rank)   # a rank that finished is not hung
            overdue = watch.overdue(self.now())
            if overdue:
                return overdue
            deadline = watch.next_deadline()
            if deadline is None:
                continue
            await asyncio.sleep(max(0.0, deadline - self.now()))

    async def _on_hang(self, local_ranks: list[int]) -> None:
        assert self.hangs is not None and self.group is not None
        launches = {w.local_rank: w for w in self.group.launches}
        failures = []
        for lr in local_ranks:
            silent = self.now() - self.hangs.last_beat[lr]
            failures.append(WorkerFailure(
                local_rank=lr, rank=launches[lr].rank, exitcode=-signal.SIGTERM, signal="SIGTERM", reason="hang",
                message=f"no heartbeat for {silent:.1f}s (hang timeout {self.opts.hang_timeout:g}s); stopped",
                timestamp=time.time(), host=self.hostname, node_id=self.opts.node_id))
        self.say(f"worker rank {failures[0].rank} (local {local_ranks[0]}) is hung: {failures[0].message}")
        await self._apply(self.policy.on_workers_failed(failures, self.now()))

    async def _on_worker_exits(self, exits: list[WorkerExit]) -> None:
        failed = [e for e in exits if e.exitcode != 0]
        if not failed:
            if self._hang_task is not None:
                self._hang_task.cancel()
                self._hang_task = None
            await self._apply(self.policy.on_workers_succeeded(self.now()))
            return
        failures = [self._failure(e) for e in failed]
        f = failures[0]
        how = f"signal {f.signal}" if f.signal else f"exit code {f.exitcode}"
        self.say(f"worker rank {f.rank} (local {f.local_rank}) failed with {how}; stopping local workers")
        await self._apply(self.policy.on_workers_failed(failures, self.now()))

    def _failure(self, e: WorkerExit) -> WorkerFailure:
        # Order failures by when the agent reaped them: error.json's timestamps are whole seconds.
        message, tb, ts = "", "", e.seen_at or time.time()
        parsed = read_error_file(e.error_file) if e.error_file else None
        if parsed is not None:
            message, tb = parsed[0], parsed[1]
        return WorkerFailure(local_rank=e.local_rank, rank=e.rank, exitcode=e.exitcode, signal=e.signal_name,
                             message=message, traceback=tb, timestamp=ts, host=self.hostname,
                             node_id=self.opts.node_id)
