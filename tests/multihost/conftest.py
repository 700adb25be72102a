"""Fixtures for the multi-host tests: namespace networks and jobs, torn down even on failure."""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.multihost import netns
from tests.multihost.job import MultiHostJob


@pytest.fixture(scope="session")
def namespaces() -> None:
    """Skip (with the reason) where network namespaces cannot be made; clear abandoned ones."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    netns.sweep_abandoned()


@pytest.fixture
def multihost(namespaces, tmp_path) -> Iterator[Callable[..., MultiHostJob]]:
    """`multihost(["a", "b"])`: a network of those hosts plus `server` (unless `server_host` is one of
    them) and a job on it. Processes first, then namespaces (with anything still inside them)."""
    made: list[MultiHostJob] = []

    def make(hosts: list[str], server_host: str = "server") -> MultiHostJob:
        names = hosts if server_host in hosts else [server_host, *hosts]
        net = netns.Network(names)
        out = tmp_path / f"net{len(made)}"
        out.mkdir()
        job = MultiHostJob(net, out, f"mh-{uuid.uuid4().hex[:8]}", server_host=server_host)
        made.append(job)
        return job

    yield make
    for job in reversed(made):
        try:
            job.close()
        finally:
            job.net.close()
