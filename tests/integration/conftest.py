import aiohttp
import pytest

from rdzv_server.web.app import create_app
from tests.integration.support import start_app


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def server():
    """The real app on a free loopback port (one in-memory coordinator)."""
    srv = await start_app(create_app())
    try:
        yield srv
    finally:
        await srv.close()
