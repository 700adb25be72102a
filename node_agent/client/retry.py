"""Trying a request again while the server cannot be reached: the client's one backoff.

With a transport on a network (`path_back`, path_check.py), a try that failed because the server is
away waits until it answers a fresh connection again, and goes at once then: never on TCP's own
back-off, and no longer than the check schedule. The pause (otherwise, or when the server answered
a fresh connection at once: busy, or the connection was reset) grows from BACKOFF_FIRST_S and
doubles per try up to BACKOFF_MAX_S, each jittered down to half so a fleet of nodes does not come
back in one wave; the cap is low so that a restarted server sees every node back within about that
long. A typed refusal (`ServerRejected`) is never retried
here: what it means is the caller's rule (replies.py).
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from node_agent.client.transport import ServerUnreachable

BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 0.5
T = TypeVar("T")


class Backoff:
    """The pauses between tries of one request; `reset()` once it was answered."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S,
                 jitter: Callable[[float, float], float] = random.uniform) -> None:
        self.first_s, self.max_s, self._jitter = first_s, max_s, jitter
        self.tries = 0

    def next_pause(self) -> float:
        self.tries += 1
        return min(self.max_s, self.first_s * 2.0 ** self.tries) * self._jitter(0.5, 1.0)

    async def pause(self) -> None:
        await asyncio.sleep(self.next_pause())   # waiting out an outage: there is nothing to await

    def reset(self) -> None:
        self.tries = 0


class GaveUp(Exception):
    """The server stayed unreachable for longer than the caller allowed."""

    def __init__(self, waited_s: float, last: ServerUnreachable) -> None:
        super().__init__(f"{waited_s:.0f}s: {last}")
        self.waited_s = waited_s
        self.last = last


async def until_answered(send: Callable[[], Awaitable[T]], *,
                         on_unreachable: Callable[[ServerUnreachable], None] | None = None,
                         give_up_after: float | None = None,
                         path_back: Callable[[], Awaitable[bool]] | None = None,
                         clock: Callable[[], float] = time.monotonic) -> T:
    """`send()` until it is answered. Each try that reaches no server is told to `on_unreachable`
    and tried again after the backoff and, with `path_back` (the transport's: path_check.py), once
    the server answers a fresh connection again; after `give_up_after` seconds of that, `GaveUp`.
    A typed refusal is raised at once."""
    backoff, started = Backoff(), clock()
    while True:
        try:
            return await send()
        except ServerUnreachable as exc:
            if on_unreachable is not None:
                on_unreachable(exc)
            waited = clock() - started
            if give_up_after is not None and waited >= give_up_after:
                raise GaveUp(waited, exc) from exc
            if path_back is None:
                await backoff.pause()
                continue
            left = None if give_up_after is None else max(0.0, give_up_after - (clock() - started))
            try:
                if not await asyncio.wait_for(path_back(), left):
                    await backoff.pause()     # it answers a fresh connection: the failure was not the path
            except asyncio.TimeoutError:
                pass          # tried once more, then given up on


def unreachable_line(server: str, wait_s: float, error: str) -> str:
    """Said at the first try that gets no answer (node-agent and the plugin alike): silence for the whole
    wait would look like a hang."""
    return f"cannot reach the rdzv-server at {server}; retrying for {wait_s:g}s ({error})"
