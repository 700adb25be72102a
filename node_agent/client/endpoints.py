"""Where requests go when the server runs as replicas: the endpoints given, and the leader a standby named
(`not_leader` with its URL in `Rdzv-Leader`: followed at once). An unreachable replica is skipped for the
next one given; an unreachable followed leader sends the agent back to those given (one endpoint for all
replicas, a Kubernetes Service say, has a standby name the new leader). A DNS name with several addresses
is one endpoint: aiohttp tries them in turn."""
from __future__ import annotations

LEADER_HEADER = "Rdzv-Leader"
# A long-poll unanswered this long has the path checked: a frozen, replaced or cut-off leader holds it open.
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
        at = -1 if self.following else self.configured.index(self.current)
        self.current = self.configured[(at + 1) % len(self.configured)]
