"""Streams: nodes subscribed to their view over one long-lived connection each (docs/protocol.md).

A subscribed stream is a held long-poll that never ends: it takes the same core calls
(`hold_poll` at subscribe, `poll_ended` or `connection_dropped` when it ends) and the same per-node
cap, so every rule about leases stays in the core. What differs is how news leaves:
- when the coordinator wakes a job, the job is marked and flushed once, soon after (`call_soon`),
  so the request that caused the change (a failure report) is answered before the fan-out starts;
  the next flush waits FLUSH_GAP times as long as the last one took, so that fan-outs take at most
  a third of the loop: in a join storm every join wakes the job, and a flush per join looks at every
  subscriber's view (quadratic: a 10,000-node formation never completed); wakes meanwhile coalesce;
- the flush looks at each subscriber's view once, and writes a frame only to those whose view
  changed, straight to their connection (`Stream.push`: no task, future or timer per wake-up);
  subscribers whose views are equal (everyone not in the round) share one encoded frame.
Silence: one sweep every SWEEP_S closes the streams that sent nothing (heartbeats included) for
longer than their lease, plus however far the event loop runs behind, so a server that falls
behind never blames a node for its own backlog. The lease then runs from the last frame heard
(`poll_ended`), as it does from a long-poll's last sign of life.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from protocol.errors import ErrorCode
from protocol.messages import PROTOCOL_VERSION, NodeStatus, PollRequest
from protocol.quoting import quote
from protocol.stream import Status, encode_frame
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.rounds import node_status
from rdzv_server.serving import LEADER_HEADER

log = logging.getLogger("rdzv_server")

SWEEP_S = 0.5              # how often silent streams are looked for
FLUSH_GAP = 2.0            # after a flush that took T, the next waits until 2T later (see above)
UNSUBSCRIBED_SILENCE_S = 30.0   # a stream that has not subscribed (yet) may be silent this long


class Stream(Protocol):
    """One node's connection, as the hub sees it (web/stream_connection.py implements it over a WebSocket)."""

    def push(self, frame: bytes) -> bool:
        """Write one encoded frame now; False: the connection is gone or over its write-buffer cap (closed)."""
    def close(self, code: ErrorCode, message: str, leader: str = "") -> None:
        """Send an error frame and close (from a sweep or a flush: no awaiting)."""
    def kernel_silence_s(self) -> float:
        """How long the kernel has received nothing on the connection (inf where unknown)."""


@dataclass(eq=False, slots=True)
class Subscription:
    """A stream and the node it speaks for; `held`: subscribed (its lease is the stream)."""
    job_id: str
    node_id: str
    stream: Stream
    heard: float                       # loop time of the last frame from the node
    heard_wall: float                  # the same, on the coordinator's clock
    limit_s: float = UNSUBSCRIBED_SILENCE_S
    held: bool = False
    last: NodeStatus | None = None
    ended: str = ""                    # why the hub ended it ("": still open, or the client's doing)


@dataclass
class StreamCounts:
    """What the metrics show: frames pushed, streams closed by reason, requests by action and outcome."""
    pushed: int = 0
    flushes: int = 0                   # fan-outs run, how long they took in all, and the last one
    flush_s: float = 0.0
    last_flush_s: float = 0.0
    closed: dict[str, int] = field(default_factory=dict)
    requests: dict[tuple[str, str], int] = field(default_factory=dict)

    def request(self, action: str, outcome: str) -> None:
        key = (action, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def close(self, reason: str) -> None:
        self.closed[reason] = self.closed.get(reason, 0) + 1


class StreamHub:
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.open: set[Subscription] = set()
        self._by_job: dict[str, set[Subscription]] = {}
        self._dirty: set[str] = set()
        self._flush_soon = False
        self._next_flush_at = 0.0   # loop time before which no flush starts
        self._sweeper: asyncio.TimerHandle | None = None
        self.counts = StreamCounts()
        coord.waiters.listeners.append(self.wake)

    # -- life of one stream --
    def opened(self, job_id: str, node_id: str, stream: Stream) -> Subscription:
        loop = asyncio.get_running_loop()
        sub = Subscription(job_id, node_id, stream, loop.time(), self.coord.clock())
        self.open.add(sub)
        if self._sweeper is None:
            self._sweeper = loop.call_later(SWEEP_S, self._sweep)
        return sub

    def heard(self, sub: Subscription) -> None:
        sub.heard = asyncio.get_running_loop().time()
        sub.heard_wall = self.coord.clock()
        # the quiet rule (core/leases.py): agents are heard; and a node that subscribed (its
        # credential shown) was seen: one that only said hello speaks for nobody yet
        if sub.held:
            self.coord.core.heard(sub.heard_wall, sub.job_id, sub.node_id)
        else:
            self.coord.core.heard(sub.heard_wall)

    def subscribe(self, sub: Subscription, credential: str, known_round: int, master_port: int) -> None:
        """Hold the node's lease on this stream and push its view now (a repeat publishes a new
        master_port: the old hold ends as the new one starts)."""
        coord, key = self.coord, (sub.job_id, sub.node_id)
        if not coord.gate.serving():
            raise coord.gate.not_serving()
        req = PollRequest(v=PROTOCOL_VERSION, node_id=sub.node_id, credential=credential,
                          known_round=known_round, master_port=master_port)
        if not sub.held:
            coord.polls_by_node.take(key, quote(sub.node_id))
        try:
            status = coord.call(lambda now: coord.core.hold_poll(sub.job_id, req, now))
        except BaseException:
            if not sub.held:
                coord.polls_by_node.give_back(key)
            raise
        if sub.held:            # the earlier hold ends: one hold per stream
            self._release(sub, dropped=False)
            coord.polls_by_node.take(key, quote(sub.node_id))
        sub.held, sub.limit_s, sub.last = True, status.lease_timeout_s, status
        self._by_job.setdefault(sub.job_id, set()).add(sub)
        self.counts.pushed += 1
        sub.stream.push(encode_frame(Status(status=status)))

    def closed(self, sub: Subscription) -> None:
        """The connection ended. Closed by the node or the network: a dropped connection (a short
        grace, as for a long-poll); ended by the hub (silence, a slow reader, bad input): the lease
        runs from the last frame heard."""
        self.open.discard(sub)
        if sub.held:
            self._release(sub, dropped=not sub.ended)
        self.counts.close(sub.ended or "closed by the client")

    def end(self, sub: Subscription, code: ErrorCode, message: str, reason: str, leader: str = "") -> None:
        """The hub closes a stream (its handler then sees it closed and calls `closed`)."""
        if not sub.ended:
            sub.ended = reason
            sub.stream.close(code, message, leader)

    def _release(self, sub: Subscription, *, dropped: bool) -> None:
        coord = self.coord
        sub.held = False
        subs = self._by_job.get(sub.job_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._by_job[sub.job_id]
        coord.polls_by_node.give_back((sub.job_id, sub.node_id))
        if not coord.gate.serving():
            return           # stopping or stepping down: nobody is blamed for it
        if dropped:
            coord.core.connection_dropped(sub.job_id, sub.node_id, coord.clock())
        else:
            coord.core.poll_ended(sub.job_id, sub.node_id, coord.clock(), sub.heard_wall)
        coord._apply()

    # -- news --
    def wake(self, job_id: str | None) -> None:
        """The coordinator woke `job_id` (None: every job): flush it soon, once."""
        self._dirty.update(self._by_job if job_id is None else (job_id,))
        if not self._flush_soon and self._dirty:
            self._flush_soon = True
            loop = asyncio.get_running_loop()
            wait = self._next_flush_at - loop.time()
            if wait > 0:
                loop.call_later(wait, self._flush)
            else:
                loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        dirty, self._dirty = self._dirty, set()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            self._flush_jobs(dirty)
        finally:
            done = loop.time()
            self._next_flush_at = done + FLUSH_GAP * (done - started)
            counts = self.counts
            counts.flushes, counts.flush_s, counts.last_flush_s = counts.flushes + 1, counts.flush_s + done - started, \
                done - started

    def _flush_jobs(self, dirty: set[str]) -> None:
        coord = self.coord
        for job_id in dirty:
            subs = self._by_job.get(job_id)
            if not subs:
                continue
            if not coord.gate.serving():
                self._end_all(subs, coord.gate.not_serving(), "not serving")
            elif job_id not in coord.core.jobs:
                self._end_all(subs, RendezvousError(ErrorCode.UNKNOWN_JOB, f"job {quote(job_id)} was forgotten"),
                              "job forgotten")
            else:
                self._push_views(job_id, subs)

    def _push_views(self, job_id: str, subs: set[Subscription]) -> None:
        job, now = self.coord.core.jobs[job_id], self.coord.clock()
        shared: dict[tuple[object, ...], bytes] = {}
        for sub in list(subs):
            status = node_status(job, sub.node_id, now)       # core.view's own, without its lookups per node
            if status == sub.last:
                continue
            sub.last = status
            if status.assignment is None:       # the same view for many nodes: encoded once
                key = msgspec.structs.astuple(status)
                frame = shared.get(key)
                if frame is None:
                    frame = shared[key] = encode_frame(Status(status=status))
            else:
                frame = encode_frame(Status(status=status))
            self.counts.pushed += 1
            if not sub.stream.push(frame):
                self.end(sub, ErrorCode.LIMIT_REACHED, "the node reads too slowly: its stream's write buffer "
                         "is full; reconnect and subscribe again", "slow reader")

    def _end_all(self, subs: set[Subscription], why: RendezvousError, reason: str) -> None:
        for sub in list(subs):
            self.end(sub, why.code, why.message, reason, (why.headers or {}).get(LEADER_HEADER, ""))

    def _sweep(self) -> None:
        """Close the streams silent for longer than their limit (plus the server's own lag)."""
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(SWEEP_S, self._sweep) if self.open else None
        lag = self.coord.loop_lag.recent_s() if self.coord.loop_lag is not None else 0.0
        now = loop.time()
        for sub in list(self.open):
            limit = sub.limit_s + lag
            if now - sub.heard <= limit or sub.ended:
                continue
            # Silent by the frames read; the kernel may have received one the loop has not read yet.
            # Asked only here: a TCP_INFO read per stream per sweep was half the server's CPU at 10,000.
            silent = min(now - sub.heard, sub.stream.kernel_silence_s())
            if silent > limit:
                # retryable: a node that was only paused (SIGSTOP) reconnects and learns where it stands
                self.end(sub, ErrorCode.LIMIT_REACHED, f"no frame for {silent:.1f}s (limit {sub.limit_s:g}s: "
                         f"send a heartbeat every lease_timeout_s / 3)", "silent")
