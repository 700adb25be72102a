"""What the integration tests share: the real app on a free loopback port, URLs, bounded waits."""
from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer


async def start_app(app: web.Application) -> TestServer:
    srv = TestServer(app, host="127.0.0.1", port=0)
    await srv.start_server()
    return srv


# Node credentials the tests' wire clients were given: (job, node) -> the latest secret. Kept apart
# from any one client object, as several may speak for the same node (another connection, or the
# same agent after its server restarted). A stale one is harmless: a join that makes a new record
# answers with a new secret.
_CREDENTIALS: dict[tuple[str, str], str] = {}


def with_credential(server: TestServer, job: str, body: dict) -> dict:
    """`body` with the credential its node was given, unless it names one itself."""
    known = _CREDENTIALS.get((job, body["node_id"]))
    return body if known is None or "credential" in body else {**body, "credential": known}


def remember_credential(server: TestServer, job: str, node_id: str, reply: dict) -> None:
    if reply.get("credential"):
        _CREDENTIALS[(job, node_id)] = reply["credential"]


def url(server: TestServer, path: str) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


async def wait_until(predicate, timeout: float = 5.0) -> None:
    """Wait for a condition that no event announces (bounded; fails the test on timeout)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class FixedLag:
    """A loop-lag probe (coordinator.LagSource) that says the server runs `lag_s` behind, whatever
    the machine's load: tests that set the coordinator's clock by hand need its lag set too (a real
    probe on a busy CI runner held a lease past the time such a test had set)."""

    max_s = 0.0

    def __init__(self, lag_s: float) -> None:
        self.lag_s = lag_s

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def recent_s(self) -> float:
        return self.lag_s

    def note_waited(self, waited_s: float) -> None:
        pass

    def summary(self) -> str:
        return "not measured (test)"
