"""The server's listening socket keeps its whole accept queue (serve.py: LISTEN_BACKLOG, capped by the
kernel's net.core.somaxconn) on either event loop, although asyncio's is told to accept only
ACCEPT_BATCH connections at a time: a fleet that comes back at once must not find a short queue."""
from __future__ import annotations

import subprocess

import pytest

from rdzv_server.serve import LISTEN_BACKLOG

pytestmark = pytest.mark.e2e


def _somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


def _listen_queue_size(port: int) -> int:
    """The listening socket's accept-queue size as the kernel holds it (`ss`: Send-Q of a listener)."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    assert len(rows) == 1, f"one listener on port {port} expected, ss says: {out!r}"
    return int(rows[0][2])


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_the_accept_queue_is_the_whole_backlog_on_either_loop(cluster, event_loop):
    port = cluster.start_server("--state-dir", "none", "--event-loop", event_loop)
    assert _listen_queue_size(port) == min(LISTEN_BACKLOG, _somaxconn())
