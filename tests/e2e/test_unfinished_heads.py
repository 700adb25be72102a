"""A stranger's connections (no token needed), each sending a request head without its final blank line and holding
it, cannot fill the server's memory (rdzv_server/web/heads.py): past 16 MiB of unfinished heads the oldest are
closed. Before, aiohttp kept each head (128 fields of 8 KiB accepted, ~1.6 MiB of memory for a 782 KiB one) with no
deadline for a first request, and the connection cap was ~19,700 away: 200 such connections took the server's RSS
47 -> 360 MiB, 600 of them 988 MiB. Measured in bytes and connections closed, not time; /healthz and a member's
held long-poll are answered all along."""
from __future__ import annotations

import contextlib
import socket
import urllib.request

import psutil
import pytest

from tests.e2e.harness import wait_until
from tests.e2e.test_connections import HELD_CONFIG, held_poll, metric, open_polls, post

pytestmark = pytest.mark.e2e
HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 8000) for i in range(100))
FLOOD = 100                 # 78 MiB of heads; at most 16 MiB of them kept
KEPT = (16 << 20) // len(HEAD)
RSS_GROWTH = 80 << 20       # kept heads at ~2x, the connections and slack; before: +160 MiB


def closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:             # reset: closed with what was sent unread
        return True


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_unfinished_request_heads_are_closed_oldest_first_past_their_budget(cluster, loop: str) -> None:
    port = cluster.start_server("--state-dir", "none", "--event-loop", loop)
    server = psutil.Process(cluster.server.pid)
    held = held_poll(port)
    before = server.memory_info().rss
    flood: list[socket.socket] = []
    try:
        for i in range(FLOOD):                                  # from 10 addresses: no one source stands out
            sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                            source_address=(f"127.0.0.{2 + i % 10}", 0))
            flood.append(sock)
            with contextlib.suppress(OSError):                 # closed while sending: one of the oldest
                sock.sendall(HEAD)
        wait_until(lambda: sum(map(closed_by_server, flood)) >= FLOOD - KEPT, 30,   # aiohttp's own idle close: 60 s
                   lambda: f"the oldest closed: {sum(map(closed_by_server, flood))} of {FLOOD}")
        grown = server.memory_info().rss - before
        assert grown < RSS_GROWTH, f"the server's RSS grew {grown >> 20} MiB for {FLOOD} unfinished heads"
        assert not any(map(closed_by_server, flood[-KEPT // 2:])), "the newest heads are kept (oldest first)"
        assert metric(port, "rdzv_connections_unfinished_heads_total") >= FLOOD - KEPT
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            assert resp.status == 200
        assert open_polls(port) == 1                            # a's poll, still held
        post(port, "join", {"v": 1, "node_id": "b", "addr": "10.0.0.2", "local_world_size": 1,
                            "master_port": 2, "config": HELD_CONFIG})
        held.settimeout(10)
        answer = held.recv(4096)                                 # and answered: the round formed
        assert answer.startswith(b"HTTP/1.1 200") and b"member" in answer
    finally:
        held.close()
        for sock in flood:
            sock.close()
