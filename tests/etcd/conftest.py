"""A real 3-member etcd cluster per test module (Debian's etcd, `make etcd`), and a fresh key
prefix per test so the tests of one module never see each other's keys."""
from __future__ import annotations

import itertools

import pytest

from rdzv_server.store.etcd.client import EtcdSettings, parse_store_url
from tests.etcd_cluster import EtcdCluster, etcd_available

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd():
    assert etcd_available(), "etcd is not installed: run `make etcd` (Debian's etcd-server package)"
    cluster = EtcdCluster(3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def settings(etcd) -> EtcdSettings:
    return EtcdSettings(parse_store_url(etcd.url, tls=False), prefix=f"/t{next(_prefixes)}/", timeout_s=2.0)


@pytest.fixture
async def http():
    import aiohttp
    async with aiohttp.ClientSession() as session:
        yield session
