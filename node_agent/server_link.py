"""The agent's conversation with the rendezvous server: each request is a task whose outcome is a fact.
An answer is `StatusReceived` (with when the answered try went out), a typed refusal `ServerRefused`, an
unanswered try `ServerNotReached`, retried on the client's backoff (client/retry.py) until the policy gives
up and the task is cancelled. One request of each kind at a time (a newer replaces an older one still
trying); the long-poll runs only while joined (a join cancels it, its answer restarts it)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from node_agent.client.retry import until_answered
from node_agent.client.transport import ServerRejected, ServerUnreachable, Transport
from node_agent.core.facts import Put, Request, ServerNotReached, ServerRefused, StatusReceived
from node_agent.sources import start_source
from protocol.bounds import MAX_POLL_WAIT_S, MAX_STOP_S
from protocol.messages import (
    FailureReport,
    JoinRequest,
    NodeStatus,
    PollRequest,
    StallReport,
    SuccessReport,
    UnhealthyKind,
    WorkerFailure,
)
from protocol.notes import ProgressNote
from protocol.stalls import RankSeen

# How long a leave waits for a join still on its way (see leave()).
JOIN_LANDING_S = 2.0
# How long a stopped agent's note before its leave may take: its workers' stop waits for both (a manager's grace).
NOTE_BEFORE_LEAVE_S = 1.0


class ServerLink:
    def __init__(self, client: Transport, put: Put, clock: Callable[[], float], *,
                 join: Callable[[], Awaitable[NodeStatus]],
                 poll: Callable[[float], Awaitable[NodeStatus]]) -> None:
        """`join()` sends this node's join; `poll(wait_s)` a poll saying which round it runs."""
        self._client = client
        self._put = put
        self._clock = clock
        self._join = join
        self._poll = poll
        self._tasks: dict[Request, asyncio.Task[None]] = {}
        self._prompt: asyncio.Task[None] | None = None    # poll_now's poll, while it is still trying
        self.joined = False
        # The newest round assigned, at once: while the loop lags a witness must not say "still your round".
        self.assigned_round = -1

    def rejoin(self) -> None:
        """Join (again): polls stop until the server has answered the join. A round assigned before it is no
        longer one this node holds (a server that forgot the job numbers its rounds from 1 again: an old run's
        higher id would tell a witness's asker its round was replaced)."""
        self.joined, self.assigned_round = False, -1
        self._cancel(PollRequest)
        self._cancel_prompt()
        self._send(JoinRequest, self._join)

    def keep_polling(self) -> None:
        """Have one long-poll in flight while joined: it is the lease, and the way news arrives."""
        task = self._tasks.get(PollRequest)
        if self.joined and (task is None or task.done()):
            self._send(PollRequest, lambda: self._poll(MAX_POLL_WAIT_S))   # the longest: the server picks the hold

    def poll_now(self) -> None:
        """A poll answered at once, beside the held one: news for the server (this node is ready, a snapshot's
        digests, its checks passed) now. One at a time: each try sends the news as they are then, so one still
        trying (the server unreachable) carries the later news too."""
        if self.joined and (self._prompt is None or self._prompt.done()):
            self._prompt = start_source(self._until_answered(PollRequest, lambda: self._poll(0.0)), self._put)

    def report_failure(self, round_id: int, failures: tuple[WorkerFailure, ...],
                       progress: ProgressNote | None = None) -> None:
        self._send(FailureReport, lambda: self._client.report_failure(round_id, list(failures), progress))

    def report_success(self, round_id: int, progress: ProgressNote | None = None) -> None:
        self._send(SuccessReport, lambda: self._client.report_success(round_id, progress))

    def report_stall(self, round_id: int, threshold_s: float, ranks: tuple[RankSeen, ...]) -> None:
        self._send(StallReport, lambda: self._client.report_stall(round_id, threshold_s, list(ranks)))

    async def leave(self, reason: str, unhealthy: UnhealthyKind | None = None, stopped: bool = False,
                    stop_timeout_s: float = 0.0) -> float | None:
        """Say goodbye, once and briefly (the lease lapses anyway). A join on its way is waited for briefly,
        so the leave carries its credential rather than leave a record that lapses as a loss (flap damping).
        How long the job keeps this node's place for its next agent (0: not; None: no answer). `stopped`: a poll
        first tells the server what the node's memory holds now (its newest snapshot: awaiting.py's evidence), and
        the leave how long its workers may take to stop (`stop_timeout_s`)."""
        joining = self._tasks.get(JoinRequest)
        if joining is not None and not joining.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(joining), JOIN_LANDING_S)
        kept = None
        if stopped:
            with contextlib.suppress(ServerUnreachable, ServerRejected, asyncio.TimeoutError):
                await asyncio.wait_for(self._poll(0.0), NOTE_BEFORE_LEAVE_S)
        with contextlib.suppress(ServerUnreachable, ServerRejected):
            kept = (await self._client.leave(reason, unhealthy, stopped,
                                             min(stop_timeout_s, MAX_STOP_S) if stopped else 0.0)).place_kept_s
        self.joined = False          # no more polls: this node is no member until it joins again
        self._cancel(PollRequest)
        self._cancel_prompt()
        return kept

    async def stop_ended(self) -> bool:
        """Tell the server this stopped node's stop is over (its workers stopped, its last copies sent), once and
        briefly: the job's wait for its next agent counts from now, not from its --stop-timeout's end
        (LeaveRequest.stop_ended). Whether it was heard (unheard: the wait stays as its leave told)."""
        with contextlib.suppress(ServerUnreachable, ServerRejected):
            return (await self._client.leave("its stop is over", stopped=True, stop_ended=True)).accepted
        return False

    @contextlib.asynccontextmanager
    async def lease_kept(self, interval: float) -> AsyncIterator[None]:
        """Keep a long-poll held while the loop is busy (it re-issues none until it is done): at once (the answer
        that made it busy may end a hold the lease ran through: half of it gone), then again every `interval` once
        answered (its answers wait for the loop as facts). A held poll is the lease, and more: an agent killed
        while busy (as it stops or starts workers) closes it, and the server hears that close as a restart
        (rdzv_server/core/awaiting.py); killed between instant polls it fell silent, a host gone, and an elastic job
        went on without it (a review: every rank back to step 0)."""
        async def renew() -> None:
            while self.joined:                  # (a node that left has no lease)
                self.keep_polling()
                await asyncio.sleep(interval)   # periodic renewal, not synchronisation

        keeper = asyncio.create_task(renew())
        try:
            yield
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def _cancel_prompt(self) -> None:
        if self._prompt is not None:
            self._prompt.cancel()
            self._prompt = None

    def _cancel(self, request: Request) -> None:
        task = self._tasks.pop(request, None)
        if task is not None:
            task.cancel()

    def _send(self, request: Request, call: Callable[[], Awaitable[NodeStatus]]) -> None:
        self._cancel(request)
        self._tasks[request] = start_source(self._until_answered(request, call), self._put)

    async def _until_answered(self, request: Request, call: Callable[[], Awaitable[NodeStatus]]) -> None:
        sent_at = 0.0      # when the try that is answered went out: the lease was renewed after it

        def timed_call() -> Awaitable[NodeStatus]:
            nonlocal sent_at
            sent_at = self._clock()
            return call()

        try:
            async with self._client.joining() if request is JoinRequest else contextlib.nullcontext():
                status = await until_answered(
                    timed_call, on_unreachable=lambda exc: self._put(ServerNotReached(request, str(exc))),
                    path_back=self._client.path_back)
        except ServerRejected as exc:
            self._put(ServerRefused(request, exc.code, exc.message))
            return
        if request is JoinRequest:
            self.joined = True
        if status.assignment is not None:
            self.assigned_round = max(self.assigned_round, status.assignment.round_id)
        self._put(StatusReceived(request, status, sent_at))
