"""Hosts that left a job unhealthy (a broken GPU, a failed --health-check, a stuck worker), kept out of every job of
this server for `hold_s` or until `rdzv-ctl clear-unhealthy HOST`: no single-job launcher can do that. Keyed by the
join's host name, which is the node's own word: a hold keeps out only joins from the address the unhealthy node's
connection came from (a review: any holder of the agent token named another host, left unhealthy, and kept that
host out of every job for an hour). In memory only (each node checks itself again before it joins anyway).
"""
from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ErrorCode
from protocol.quoting import quote
from protocol.views import HostHold
from rdzv_server.core.addresses import same_host
from rdzv_server.core.errors import RendezvousError

DEFAULT_HOLD_S = 3600.0
MAX_HOSTS = 10_000            # holds kept at most (the oldest go first): one server's memory stays bounded


@dataclass(frozen=True)
class Hold:
    host: str
    kind: str                 # a protocol.messages.UnhealthyKind value
    reason: str               # the node's one line
    job_id: str
    node_id: str
    since: float
    until: float
    source: str = ""          # where the node's connection came from ("": not known: the name alone)

    def view(self, now: float) -> HostHold:
        return HostHold(host=self.host, kind=self.kind, reason=self.reason, job_id=self.job_id, node_id=self.node_id,
                        held_for_s=round(max(0.0, self.until - now), 1))


class UnhealthyHosts:
    def __init__(self, hold_s: float = DEFAULT_HOLD_S) -> None:
        self.hold_s = hold_s
        # host -> source -> its hold: one source's never replaces another's (a stranger's would lift a real one)
        self._holds: dict[str, dict[str, Hold]] = {}
        self._count = 0

    def hold(self, host: str, kind: str, reason: str, job_id: str, node_id: str, now: float,
             source: str = "") -> None:
        """Keep `host` out until now + hold_s (unless holds are off, or there is no host to hold): its joins from
        `source`, the unhealthy node's connection's address (any, where not known)."""
        if self.hold_s <= 0 or not host:
            return
        self._drop(host, source)
        while self._count >= MAX_HOSTS:
            oldest = min((h for held in self._holds.values() for h in held.values()), key=lambda h: h.since)
            self._drop(oldest.host, oldest.source)
        self._holds.setdefault(host, {})[source] = Hold(host, kind, reason, job_id, node_id, now, now + self.hold_s,
                                                       source)
        self._count += 1

    def check(self, host: str, node_id: str, now: float, source: str = "") -> None:
        """Refuse a join from a held host (from a held source, where both are known)."""
        for held in self.get(host, now):
            if not held.source or not source or same_host(source, held.source):
                raise RendezvousError(ErrorCode.HOST_UNHEALTHY, (
                    f"host {quote(host)} (node {quote(node_id)}) is held out as unhealthy for "
                    f"{held.until - now:.0f}s more: node {quote(held.node_id)} of job {quote(held.job_id)} left "
                    f"with {held.reason}; an operator clears it with `rdzv-ctl clear-unhealthy {host}`"))

    def get(self, host: str, now: float) -> list[Hold]:
        """`host`'s holds still running, oldest first."""
        for held in [h for h in self._holds.get(host, {}).values() if h.until <= now]:
            self._drop(host, held.source)
        return sorted(self._holds.get(host, {}).values(), key=lambda h: h.since)

    def clear(self, host: str, now: float) -> Hold:
        """An operator lets `host` join again (from every source): its newest hold; NOT_FOUND when it is not held."""
        held = self.get(host, now)
        if not held:
            raise RendezvousError(ErrorCode.NOT_FOUND, f"host {quote(host)} is not held as unhealthy")
        for h in held:
            self._drop(host, h.source)
        return held[-1]

    def current(self, now: float) -> list[Hold]:
        """The holds still running, oldest first."""
        return sorted((h for host in list(self._holds) for h in self.get(host, now)), key=lambda h: h.since)

    def _drop(self, host: str, source: str) -> None:
        held = self._holds.get(host)
        if held is not None and held.pop(source, None) is not None:
            self._count -= 1
            if not held:
                del self._holds[host]
