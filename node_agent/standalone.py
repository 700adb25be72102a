"""An embedded rendezvous server for `--standalone` single-node jobs (in-memory, loopback only)."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator


@contextlib.asynccontextmanager
async def embedded_server() -> AsyncIterator[int]:
    from aiohttp import web

    from rdzv_server.app import create_app

    runner = web.AppRunner(create_app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
