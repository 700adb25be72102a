"""Whether this server may serve agents now: its state is loaded, it is not stopping, and, as one of
several replicas, it leads (a lone server leads from the start; a replica follows its election).

During an election or takeover an agent's request is parked (`until_serving`) and served the moment
this replica leads, rather than refused and retried after a backoff; a standby's refusal names the leader.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from protocol.errors import ErrorCode
from protocol.quoting import quote
from rdzv_server.core.errors import RendezvousError

LEADER_HEADER = "Rdzv-Leader"   # on a not_leader reply: the leader's advertised URL
ELECTION_WAIT_S = 3.0           # an agent's request is parked at most this long during an election
FOREIGN_SAID_MAX = 1024         # job ids whose "another deployment" line was said (then said again)

log = logging.getLogger("rdzv_server")


class Serving:
    def __init__(self) -> None:
        self.started = False                      # the saved state is loaded: agents may be served
        self.shutting_down = False
        # Replicas: whether this one surely leads, where the leader is, whether an election is under way.
        self.leading: Callable[[], bool] = lambda: True
        self.leader_url: Callable[[], str | None] = lambda: None
        self.replicated = False                   # one of several replicas on a replicated store (etcd)
        self.where = ""                           # that store, as its log lines name it
        self._foreign_said: set[str] = set()
        self.electing: Callable[[], bool] = lambda: False
        self.parked = 0                           # agent requests waiting for an election to end
        self._served = asyncio.Event()            # set while started
        self._news = asyncio.Event()              # set (and replaced) when the election's outcome changes

    def follow(self, leading: Callable[[], bool], leader_url: Callable[[], str | None],
               electing: Callable[[], bool], where: str = "") -> None:
        """Take leadership from an election instead of leading from the start."""
        self.leading, self.leader_url, self.electing = leading, leader_url, electing
        self.replicated, self.where = True, where

    def foreign_job(self, job_id: str) -> RendezvousError:
        """A replica's answer to a poll or report for a job its store does not hold. A replicated store loses no
        running job, so the job is another deployment's (this replica's --etcd-prefix or --store is not the one
        its agents' leader used): `unknown_job` would have them join here as a new job, from scratch, and drop
        their snapshots; `not_leader` has them keep their workers and wait for their own leader. Said once a job."""
        if job_id not in self._foreign_said:
            if len(self._foreign_said) >= FOREIGN_SAID_MAX:
                self._foreign_said.clear()
            self._foreign_said.add(job_id)
            log.warning("an agent of job %s asks this replica, whose store (%s) has no such job: not served here "
                        "(is this replica's --etcd-prefix or --store the deployment its job runs on?)", quote(job_id),
                        self.where or "etcd")
        return RendezvousError(ErrorCode.NOT_LEADER, f"this replica's store has no job {quote(job_id)}: it serves "
                               "another deployment (check its --etcd-prefix and --store); not serving this job here")

    def start(self) -> None:
        self.started = True
        self._served.set()
        self.election_news()

    def stop(self) -> None:
        self.started = False
        self._served.clear()

    def serving(self) -> bool:
        """Agents may be served: the state is loaded, the server is not stopping, it leads."""
        return self.started and not self.shutting_down and self.leading()

    async def until_serving(self, timeout: float = ELECTION_WAIT_S) -> bool:
        """During an election or takeover, wait up to `timeout` to serve or for a leader to be known."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + timeout
        while not self.serving() and self.electing() and loop.time() < ends:
            served, news = asyncio.ensure_future(self._served.wait()), asyncio.ensure_future(self._news.wait())
            self.parked += 1
            try:
                await asyncio.wait({served, news}, timeout=ends - loop.time(), return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.parked -= 1
                served.cancel()
                news.cancel()
        return self.serving()

    def election_news(self) -> None:
        """The leader became known (or unknown): requests parked by `until_serving` look again."""
        self._news.set()
        self._news = asyncio.Event()

    def not_serving(self) -> RendezvousError:
        """Why a request is not served here: stopping, or not the leader (and where the leader is)."""
        if self.shutting_down:
            return RendezvousError(ErrorCode.SHUTTING_DOWN, "server is shutting down; retry shortly")
        url = self.leader_url()
        if url:
            return RendezvousError(ErrorCode.NOT_LEADER, f"this replica is a standby; the leader is {url}",
                                   headers={LEADER_HEADER: url})
        return RendezvousError(ErrorCode.NOT_LEADER, "this replica is a standby and no leader is known yet "
                               "(an election is under way); retry shortly")
