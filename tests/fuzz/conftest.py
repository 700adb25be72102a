import pytest

from tests.fuzz.inprocess import ServerThread


@pytest.fixture
def server(tmp_path):
    """The real server app with its durable store, in a thread of this process (inprocess.py)."""
    srv = ServerThread(str(tmp_path / "state"))
    try:
        yield srv
    finally:
        srv.close()
