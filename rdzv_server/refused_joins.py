"""Joins the rules refused for what the node asked (another config or command, a drained node, an id held by a live
agent), said in the server's log: the job's own view keeps saying it waits for nodes, and an operator whose agent
is refused again and again under a service manager's restarts should see why on the server too (a review). Once
per job, node and kind of refusal in SAY_EVERY_S, with how many came since, and at most LINES_EVERY lines in that
time for all of them (made-up node ids must not flood the log); bounded in what it remembers."""
from __future__ import annotations

import logging

from protocol.errors import ErrorCode
from protocol.quoting import quote

log = logging.getLogger("rdzv_server")

SAID = frozenset({ErrorCode.CONFIG_CONFLICT, ErrorCode.NODE_DRAINED, ErrorCode.NODE_CONFLICT})
SAY_EVERY_S = 60.0
LINES_EVERY = 20        # lines in SAY_EVERY_S at most, all jobs and nodes together
REMEMBERED = 1024       # (job, node, kind) remembered at most: made-up ids cannot grow it past this


class RefusedJoins:
    def __init__(self) -> None:
        self._said: dict[tuple[str, str, ErrorCode], tuple[float, int]] = {}
        self._window: tuple[float, int] = (-SAY_EVERY_S, 0)     # (when the window began, lines said in it)
        self._unsaid = 0                                         # refusals the window's budget kept out

    def note(self, job_id: str, node_id: str, peer: str, code: ErrorCode, message: str, now: float) -> None:
        if code not in SAID:
            return
        key = (job_id, node_id, code)
        said_at, since = self._said.get(key, (-SAY_EVERY_S, 0))
        if now - said_at < SAY_EVERY_S:
            self._said[key] = (said_at, since + 1)
            return
        began, lines = self._window if now - self._window[0] < SAY_EVERY_S else (now, 0)
        if lines >= LINES_EVERY:
            self._window, self._unsaid = (began, lines), self._unsaid + 1
            return
        self._window = (began, lines + 1)
        if len(self._said) >= REMEMBERED and key not in self._said:
            self._said.clear()
        self._said[key] = (now, 0)
        more = f" ({since} more since the last said)" if since else ""
        if self._unsaid:
            more += f"; {self._unsaid} other refused join(s) not said"
            self._unsaid = 0
        log.warning("[%s] join of node %s from %s refused: %s%s", quote(job_id), quote(node_id), quote(peer),
                    message, more)
