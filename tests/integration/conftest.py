import aiohttp
import pytest


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session
