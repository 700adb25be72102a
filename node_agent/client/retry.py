"""Trying a request again while the server cannot be reached: the client's one backoff.
On a network (`path_back`, path_check.py) a failed try waits until the server answers a fresh connection,
then goes at once, never on TCP's own back-off. Otherwise (or when it answered at once: busy, a reset) the
pause doubles from BACKOFF_FIRST_S to BACKOFF_MAX_S, jittered down to half so a fleet does not come back in
one wave; the cap is low so a restarted server sees every node back within about that long. A typed
refusal (`ServerRejected`) is never retried: replies.py says what it means."""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from node_agent.client.transport import CLOSED_BY_SERVER, SERVER_BUSY, ServerUnreachable

BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 0.5
T = TypeVar("T")


class Backoff:
    """The pauses between tries of one request."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S,
                 jitter: Callable[[float, float], float] = random.uniform) -> None:
        self.first_s, self.max_s, self._jitter = first_s, max_s, jitter
        self.tries = 0

    async def pause(self) -> None:
        self.tries += 1
        pause_s = min(self.max_s, self.first_s * 2.0 ** self.tries) * self._jitter(0.5, 1.0)
        await asyncio.sleep(pause_s)   # waiting out an outage: there is nothing to await


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
    """`send()` until answered: each unanswered try goes to `on_unreachable`, then again after the backoff
    or `path_back`; `GaveUp` after `give_up_after` seconds. A typed refusal is raised at once."""
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
            with contextlib.suppress(asyncio.TimeoutError):      # timed out: tried once more, then given up on
                if not await asyncio.wait_for(path_back(), left):
                    await backoff.pause()     # it answers a fresh connection: the failure was not the path


def unreachable_line(server: str, wait_s: float, error: str) -> str:
    """Said at the first unanswered try (node-agent and the plugin): silence for the whole wait looks like a hang.
    Where the server took the connection and closed it, or answered "not now" (a standby during an election,
    a stopping server), it is there: no hint that it may not be running."""
    if error.startswith(SERVER_BUSY):
        return f"the rdzv-server at {server} answers but serves nobody now; retrying for {wait_s:g}s ({error})"
    if CLOSED_BY_SERVER in error:
        return f"cannot reach the rdzv-server at {server}; retrying for {wait_s:g}s ({error}: busy, restarting, " \
               f"or making room at its connection limit)"
    return f"cannot reach the rdzv-server at {server}; retrying for {wait_s:g}s ({error}; is an rdzv-server " \
           f"running there? `rdzv-server --port PORT` on that host starts one)"
