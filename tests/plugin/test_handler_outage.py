"""The plugin's handler (torch's object, made as torchrun makes it, in this process) when the rdzv-server goes
away for good mid-job: torch stops the workers for it, and the handler says so, not that they failed."""
from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from node_agent.plugin.handler import create_handler
from tests.e2e.harness import wait_until

pytestmark = pytest.mark.e2e


def test_a_server_gone_past_server_wait_ends_the_round_without_a_failure_report(cluster, capsys):
    """A review: after server_wait torch stopped the workers (num_nodes_waiting), then next_rendezvous said "this
    node's workers failed; reporting it" and retried that report for server_wait more (60 s past the documented
    timeout, on every node) before it raised RendezvousConnectionError, which torchrun printed as a traceback: it
    now says why in one line and exits 1."""
    cluster.start_server("--state-dir", "none")
    handler = create_handler(RendezvousParameters(
        backend="rdzv-server", endpoint=cluster.endpoint(), run_id="outage", min_nodes=1, max_nodes=1,
        local_addr="127.0.0.1", last_call_timeout="0", local_world_size="1", max_restarts="0", lease_timeout="1",
        server_wait="1"))   # no launcher here: sizes given
    try:
        assert handler.next_rendezvous().world_size == 1
        assert cluster.server is not None
        cluster.server.kill_all()
        wait_until(lambda: handler.num_nodes_waiting() > 0, 60, "the session to end once the server stayed away")
        with pytest.raises(SystemExit) as exit_:
            handler.next_rendezvous()    # torch's restart after it stopped the workers for the news
        assert exit_.value.code == 1
    finally:
        handler.shutdown()
    said = capsys.readouterr().err
    assert "workers failed" not in said and "report not delivered" not in said, said
    assert "cannot reach the rdzv-server" in said, said
