import pytest

from tests.e2e.harness import Cluster
from tests.e2e.replicas import Replicas

TAIL_LINES = 60   # of each process's output, printed when its test failed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.call_failed = report.failed


@pytest.fixture
def cluster(tmp_path, request):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
        if getattr(request.node, "call_failed", False):   # what the processes said: shown with the failure
            for proc in c.procs:
                lines = proc.output.splitlines()[-TAIL_LINES:]
                print(f"----- {proc.name} (last {len(lines)} lines)", *lines, sep="\n")


@pytest.fixture
def replicas(cluster, tmp_path):
    """Two rdzv-server replicas on one etcd (tests/e2e/replicas.py)."""
    r = Replicas(cluster, tmp_path)
    try:
        r.start(2)
        yield r
    finally:
        r.close()
