"""The nodes whose copies a holder takes (store.py), as it sees them: what their keys are checked against."""
from __future__ import annotations

from typing import Protocol


class Source(Protocol):
    """A node whose copies this node holds: what the key they come with is checked against (the token itself
    from an older server), its local ranks (0: not said)."""
    @property
    def verifier(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def ranks(self) -> int: ...


class Sources(Protocol):
    """The nodes whose copies this node holds now, by node id (a dict of protocol.messages.CopySource)."""
    def get(self, node: str, /) -> Source | None: ...
    def __len__(self) -> int: ...
