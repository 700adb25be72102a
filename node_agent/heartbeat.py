"""Worker-side heartbeat for hang detection. No torch import; safe to call from any script.

    from node_agent.heartbeat import beat
    for step in ...:
        train_step()
        beat()

Each call costs a clock read; at most one byte per 50 ms goes down a non-blocking pipe to the agent
(`node-agent --hang-timeout S`). Outside node-agent, or with hang detection off, `beat()` does nothing.
A worker that never beats is never treated as hung."""
from __future__ import annotations

import os
import time

ENV_FD = "NODE_AGENT_HEARTBEAT_FD"
_MIN_INTERVAL_S = 0.05
_fd: int | None = None
_last = 0.0


def beat() -> None:
    global _fd, _last
    now = time.monotonic()
    if now - _last < _MIN_INTERVAL_S:
        return
    _last = now
    if _fd is None:
        try:
            _fd = int(os.environ.get(ENV_FD, "-1"))
        except ValueError:
            _fd = -1
    if _fd < 0:
        return
    try:
        os.write(_fd, b".")
    except BlockingIOError:
        pass            # the agent is behind on reading: it has seen a beat recently anyway
    except OSError:
        _fd = -1        # the agent is gone: stop trying
