import pytest

from tests.e2e.harness import Cluster
from tests.e2e.replicas import Replicas


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def replicas(cluster, tmp_path):
    """Two rdzv-server replicas on one etcd (tests/e2e/replicas.py)."""
    r = Replicas(cluster, tmp_path)
    try:
        r.start(2)
        yield r
    finally:
        r.close()
