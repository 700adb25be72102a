"""What the integration tests share: the real app on a free loopback port, URLs, bounded waits."""
from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer


async def start_app(app: web.Application) -> TestServer:
    srv = TestServer(app, host="127.0.0.1", port=0)
    await srv.start_server()
    return srv


def url(server: TestServer, path: str) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


async def wait_until(predicate, timeout: float = 5.0) -> None:
    """Wait for a condition that no event announces (bounded; fails the test on timeout)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
