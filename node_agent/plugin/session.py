"""The torchrun plugin's side of the agent protocol: the node's conversation with rdzv-server. torch's agent
calls its handler from its main thread and blocks; our transport (RdzvClient) is asyncio. So `ServerSession` runs
an event loop in a daemon thread, and the handler's blocking calls run coroutines on it. Between them one
long-poll is always in flight (docs/protocol.md, "What a client must do"): it renews the lease while torch's
workers run, rejoins when the server forgot the node, and keeps `view`, the node's latest status.
- Ordering: replies to the handler's requests and to the poll can arrive out of order; a poll sent before the
  handler's latest request was answered may describe an older state, so it is taken only when it shows progress.
- Witness: as under node-agent, the session answers the other members' "do you hear the server, and which round
  do you run?" (client/witness.py) on a port named at join, so node-agent members get witnesses on plugin nodes.
  It cannot fence its workers (torch owns them): cut off from the server it ends after server_wait (ServerLost),
  and torch's agent stops them.
The decisions are the pure functions at the top (tested without a server); the rest is I/O."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import resource
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgspec

from node_agent.client.endpoints import origin
from node_agent.client.listener import agent_caps, caps_for_descriptors
from node_agent.client.replies import (
    CONFLICT_RETRY_S,
    ENDINGS,
    Code,
    News,
    Refusal,
    conflict_retry_for,
    newer_assignment,
    news,
    refusal,
    takes_poll_reply,
)
from node_agent.client.retry import Backoff, GaveUp, unreachable_line, until_answered
from node_agent.client.transport import ServerRejected, ServerUnreachable, Transport
from node_agent.client.witness import WitnessServer
from node_agent.plugin.settings import PluginSettings
from protocol.bounds import MAX_POLL_WAIT_S
from protocol.messages import (
    Assignment,
    FailureReport,
    JobState,
    JoinRequest,
    NodeState,
    NodeStatus,
    PollRequest,
    WorkerFailure,
)

T = TypeVar("T")


# What a reply means is the client core's rule (client/replies.py); these two say what it means for torch's calls.
def needs_rendezvous(view: NodeStatus | None, running_round: int) -> bool:
    """Whether torch's agent, running `running_round`, must stop its workers and call next_rendezvous: a newer
    round formed, this node is no longer in a round, or the job failed or was closed."""
    if view is None or running_round < 0:
        return False
    meaning = news(view, running_round)
    if meaning is News.FINISHED:
        return view.job_state is not JobState.SUCCEEDED
    return meaning is not News.NONE    # an older round is a late reply: not news


def still_in_round(view: NodeStatus | None, round_id: int) -> bool:
    """The server still runs `round_id` with this node in it: when torch asks for a new round now,
    it is because this node's own workers failed."""
    return (view is not None and news(view, round_id) is News.NONE and view.assignment is not None
            and view.assignment.round_id == round_id)


class SessionEnded(Exception):
    """This node can take no further part in the job."""


class ServerLost(SessionEnded):
    """The server stayed unreachable past `server_wait`, or refused a poll."""


class RequestRefused(SessionEnded):
    """The server refused a request of this node that it would refuse again (Refusal.INVALID)."""


class JoinRefused(SessionEnded):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code


class JobFinished(SessionEnded):
    """The job ended; one line, as the server gives it (a failure's reason carries the root cause)."""


class ServerSession:
    def __init__(self, settings: PluginSettings, transport: Transport, master_port: int,
                 say: Callable[[str], None]) -> None:
        self.settings = settings
        self.view: NodeStatus | None = None     # written on the loop thread only; read from any thread
        self.ended: SessionEnded | None = None
        self.master_port = master_port          # published at join: this node's agent store
        self.say = say
        self._client = transport
        self._instance = uuid.uuid4().hex[:12]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rdzv-server-plugin", daemon=True)
        self._answered = 0                      # handler requests answered: "Ordering" above
        self._changed = asyncio.Event()
        self._follower: asyncio.Task[None] | None = None
        self._said: tuple[str, int, int] | None = None
        self._left = False                      # left the job: follow no more, never rejoin
        self._running = -1                      # the round whose workers torch runs (the witness says it)
        # Joins answered, and the one `_running` came under: a round of an earlier join is void (a server without a
        # store that restarted numbers the job's rounds from 1 again: torch's "after round 7" would wait forever)
        self._joins = self._running_join = 0
        self._cut_off = False                   # the latest request reached no server (the witness says it)
        # Capped by torchrun's own descriptor limit (not raised: its workers inherit it), and saying so when a flood
        # meets the caps, as node-agent's listeners do
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        caps = agent_caps() if limit == resource.RLIM_INFINITY else caps_for_descriptors(limit)
        self.witness = WitnessServer(settings.addr, lambda: not self._cut_off, lambda: self._running, caps=caps,
                                     say=say)
        self._closed = False
        self._stopped = False

    @property
    def rejoined(self) -> bool:
        """Whether this node joined again since torch's round was assigned: that round is void for the server."""
        return self._running_join != self._joins

    # -- blocking API, for torch's thread --

    def start(self) -> None:
        self._thread.start()
        self._call(self._client.__aenter__())
        self._call(self.witness.start())   # 0 when it cannot listen: then nobody asks this node

    def next_assignment(self, ran_round: int, failures: list[WorkerFailure] | None) -> Assignment:
        """Report this node's failure of `ran_round` (when given), then wait for a round after it."""
        return self._call(self._next_assignment(ran_round, failures))

    def report_success(self, round_id: int) -> None:
        self._call(self._report("success", lambda: self._client.report_success(round_id), self.settings.server_wait_s))

    def leave(self, reason: str) -> None:
        self._call(self._leave(reason))

    def close(self, failed_round: int = -1, failures: list[WorkerFailure] | None = None,
              leave_reason: str = "") -> None:
        """The last report and leave (each within `close_timeout`), then stop the loop."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._close(failed_round, failures, leave_reason))
        finally:
            self._stopped = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            if not self._thread.is_alive():
                self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._stopped:
            coro.close()
            raise SessionEnded("the plugin's session with the rdzv-server is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()      # e.g. torch's SignalException arrived while we waited
            raise

    # -- on the loop --

    async def _next_assignment(self, ran_round: int, failures: list[WorkerFailure] | None) -> Assignment:
        if self.view is None:
            await self._join()
            self._follower = asyncio.create_task(self._follow())
            self._follower.add_done_callback(self._follower_done)
        elif failures:
            await self._report("failure", lambda: self._client.report_failure(ran_round, failures),
                               self.settings.server_wait_s)
        while True:
            if self.ended is not None:
                raise self.ended
            view = self.view
            assert view is not None
            if view.job_state.finished:
                raise JobFinished(f"job {view.job_id!r} {view.job_state.value}: {view.reason}")
            assignment = newer_assignment(view, ran_round if self._running_join == self._joins else -1)
            if assignment is not None:
                self._running, self._running_join = assignment.round_id, self._joins
                self._said = None   # waiting again after this round is news: a survivor below MIN says why
                return assignment
            self._describe(view)
            await self._changed.wait()

    async def _join(self) -> None:
        s = self.settings
        conflict = Backoff(first_s=CONFLICT_RETRY_S, max_s=CONFLICT_RETRY_S, jitter=lambda low, high: 1.0)
        loop = asyncio.get_running_loop()
        conflict_until = loop.time() + conflict_retry_for(s.config.lease_timeout_s)
        while True:
            try:
                await self._retrying(lambda: self._client.join(
                    addr=s.addr, host=s.hostname, local_world_size=s.local_world_size, master_port=self.master_port,
                    config=s.config, instance=self._instance, role=s.role, witness_port=self.witness.port,
                    launcher="torchrun"),
                    s.server_wait_s)
                self._joins += 1
                return
            except ServerRejected as exc:
                # Maybe our own predecessor, dead but not yet noticed: wait out its lease, then give up.
                if refusal(exc.code, JoinRequest) is Refusal.CONFLICT and loop.time() < conflict_until:
                    await conflict.pause()
                    continue
                raise JoinRefused(exc.code, f"the rdzv-server refused to let node {s.node_id} join job "
                                            f"{s.job_id!r}: {exc.message}") from None

    async def _report(self, what: str, send: Callable[[], Awaitable[NodeStatus]], limit: float) -> None:
        try:
            await self._retrying(send, limit)
        except ServerRejected as exc:
            if refusal(exc.code, FailureReport) is Refusal.DROPPED:    # the next poll says where things stand
                self.say(f"the rdzv-server refused the {what} report: {exc.message}")
            else:
                self._refused(exc)
        except ServerLost as exc:
            self.say(f"{what} report not delivered: {exc}")

    async def _retrying(self, send: Callable[[], Awaitable[NodeStatus]], limit: float) -> NodeStatus:
        """Send until answered, retrying an unreachable server for `limit` seconds; the reply is the view."""
        try:
            status = await until_answered(send, give_up_after=limit, path_back=self._client.path_back,
                                          on_unreachable=self._lost_contact)
        except GaveUp as exc:
            raise ServerLost(self._unreachable(exc.waited_s, exc.last)) from None
        self._answered += 1
        self._set(status)
        return status

    def _unreachable(self, waited: float, exc: Exception) -> str:
        s = self.settings
        return (f"cannot reach the rdzv-server at {self._server} (--rdzv-endpoint) for {waited:.0f}s "
                f"(--rdzv-conf server_wait={s.server_wait_s:g}): {exc}")

    async def _follow(self) -> None:
        """One long-poll in flight until the job ends or the session closes."""
        while self.ended is None and not self._left:
            view = self.view
            assert view is not None
            if view.job_state.finished:
                return
            if view.node_state is NodeState.GONE:
                self._running = -1          # no round for the server now (what the witness says), as node-agent's
                self.say(f"rejoining: {view.reason or 'the server no longer knows this node'}")
                try:
                    await self._join()
                except SessionEnded as exc:
                    self._end(exc)
                continue
            known = view.assignment.round_id if view.node_state is NodeState.MEMBER and view.assignment else -1
            answered = self._answered
            try:
                reply = await until_answered(functools.partial(self._client.poll, known, MAX_POLL_WAIT_S),
                                             give_up_after=self.settings.server_wait_s,
                                             path_back=self._client.path_back, on_unreachable=self._lost_contact)
            except GaveUp as exc:
                self._end(ServerLost(self._unreachable(exc.waited_s, exc.last)))
                return
            except ServerRejected as exc:
                self._refused(exc)
                continue
            if takes_poll_reply(self.view, reply, sent_before_latest=answered != self._answered):
                self._set(reply)

    def _refused(self, exc: ServerRejected) -> None:
        """A refused poll or report: join again when the server forgot this node, else the end."""
        match refusal(exc.code, PollRequest):
            case Refusal.INVALID:
                self._end(RequestRefused(f"the rdzv-server refused this node's request, and would again: "
                                         f"{exc.message}"))
            case Refusal.FORGOTTEN:   # no record of this node or job (a server without a store restarted)
                if self.view is not None and not self.view.job_state.finished:
                    self._set(msgspec.structs.replace(self.view, node_state=NodeState.GONE, assignment=None,
                                                      reason=exc.message))
            case Refusal.TAKEN_OVER:
                self._end(ServerLost(ENDINGS[Refusal.TAKEN_OVER][2].format(exc.message)))
            case _:
                self._end(ServerLost(f"the rdzv-server refused a poll: {exc}"))

    def _follower_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._end(ServerLost(f"plugin error while following the job: {task.exception()!r}"))

    def _lost_contact(self, exc: Exception) -> None:
        if not self._cut_off:   # said once per outage, at its first failed try
            self.say(unreachable_line(self._server, self.settings.server_wait_s, str(exc)))
        self._cut_off = True

    @property
    def _server(self) -> str:
        """HOST:PORT as the user writes it: an IPv6 host in brackets."""
        s = self.settings
        return origin(s.scheme, s.host, s.port).partition("://")[2]

    def _set(self, status: NodeStatus) -> None:
        if self._cut_off:
            self.say(f"the rdzv-server at {self.settings.host}:{self.settings.port} answers again")
        self._cut_off = False   # an answer: the server is heard
        self.view = status
        self._changed.set()
        self._changed = asyncio.Event()

    def _end(self, exc: SessionEnded) -> None:
        if self.ended is None:
            self.ended = exc
        self._changed.set()
        self._changed = asyncio.Event()

    def _describe(self, view: NodeStatus) -> None:
        """Say once when this node starts waiting, becomes a spare or is excluded."""
        seen = (view.node_state.value, view.spare_position, view.round_id)
        if seen == self._said:
            return
        self._said = seen
        if view.node_state is NodeState.SPARE:
            self.say(f"job is at max nodes: waiting as spare #{view.spare_position + 1}")
        elif view.node_state is NodeState.EXCLUDED:
            self.say(f"node excluded for {view.excluded_for_s:.0f}s more: {view.reason}")
        elif view.node_state is NodeState.WAITING:
            self.say(f"waiting for the next round: {view.reason or 'collecting nodes'}")

    async def _leave(self, reason: str) -> None:
        view, self._left = self.view, True
        if view is None or view.job_state.finished or view.node_state is NodeState.GONE:
            return
        if isinstance(self.ended, ServerLost):
            return   # no use waiting for a server that stayed away
        with contextlib.suppress(ServerUnreachable, ServerRejected):   # a courtesy: the lease runs out anyway
            await self._client.leave(reason)

    async def _close(self, failed_round: int, failures: list[WorkerFailure] | None, leave_reason: str) -> None:
        view = self.view
        if failures and view is not None and not view.job_state.finished and self.ended is None:
            await self._report("failure", lambda: self._client.report_failure(failed_round, failures),
                               self.settings.close_timeout_s)
        if leave_reason:
            await self._leave(leave_reason)
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        await self.witness.close()
        await self._client.__aexit__(None, None, None)
