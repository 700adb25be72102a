"""Where the agent sends its requests when the server runs as several replicas (one leader, the
others standing by): the endpoints it was given, and the leader a standby named.

A standby answers `not_leader` with the leader's URL in the `Rdzv-Leader` header: the agent follows
it at once. A replica that cannot be reached is skipped for the next one given; a followed leader
that cannot be reached sends the agent back to the endpoints given (with one endpoint, a Kubernetes
Service or a name for every replica, that is where a standby names the new leader). A DNS name that
resolves to several addresses is one endpoint: aiohttp tries its addresses in turn, and a standby
among them names the leader.
"""
from __future__ import annotations

LEADER_HEADER = "Rdzv-Leader"
# While a long-poll is held this long without an answer, the agent checks the path (path_check.py:
# every endpoint's /readyz on a new connection): a leader frozen (SIGSTOP), replaced or cut off keeps
# the connection open and would otherwise hold the agent until the poll's own timeout.
LEADER_CHECK_S = 5.0


def origin(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


class Endpoints:
    def __init__(self, configured: list[str]) -> None:
        """`configured`: origins (scheme://host:port), in the order given."""
        self.configured = configured
        self.current = configured[0]

    @property
    def replicated(self) -> bool:
        return len(self.configured) > 1

    @property
    def following(self) -> bool:
        """The endpoint in use is a leader a standby named, not one of those given."""
        return self.current not in self.configured

    def follow(self, leader: str) -> bool:
        """A standby named the leader: use it from now on (False when it is the one in use)."""
        leader = leader.rstrip("/")
        if not leader.startswith(("http://", "https://")) or leader == self.current:
            return False
        self.current = leader
        return True

    def in_order(self) -> list[str]:
        """Every endpoint, the one in use first: where to check whether the path is back."""
        return [self.current, *(e for e in self.configured if e != self.current)]

    def use(self, endpoint: str) -> None:
        """`endpoint` answered ready over a fresh connection: send there from now on."""
        self.current = endpoint

    def skip(self) -> None:
        """The endpoint in use cannot be reached: the next one given (the first after a named leader)."""
        try:
            at = self.configured.index(self.current)
        except ValueError:
            at = -1
        self.current = self.configured[(at + 1) % len(self.configured)]
