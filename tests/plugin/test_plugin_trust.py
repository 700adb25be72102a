"""The plugin's handler against an rdzv-server with a token and TLS: `--rdzv-conf token_file=...,tls_ca=...`
(or RDZV_TOKEN/RDZV_TOKEN_FILE, as for node-agent) reach the client the handler makes. The handler is
torch's object, made as torchrun makes it (create_handler with RendezvousParameters), in this process."""
from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from node_agent.plugin.handler import create_handler
from tests.e2e.certs import make_ca, make_server_cert
from tests.e2e.harness import job_view

pytestmark = pytest.mark.e2e
TOKEN = "plugin-trust-token-0123456789abcdef"


def params(port: int, job: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(backend="rdzv-server", endpoint=f"https://127.0.0.1:{port}", run_id=job,
                                min_nodes=1, max_nodes=1, local_addr="127.0.0.1", last_call_timeout="0",
                                local_world_size="1", max_restarts="0", **conf)   # no launcher: given


def test_the_handler_joins_over_tls_with_the_token_and_without_it_is_one_line(cluster, tmp_path, monkeypatch,
                                                                           capsys):
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    cluster.start_server("--token-file", str(token), "--tls-cert", cert, "--tls-key", key, "--state-dir", "none")
    cluster.token, cluster.ca = TOKEN, ca[0]
    monkeypatch.delenv("RDZV_TOKEN", raising=False)
    monkeypatch.delenv("RDZV_TOKEN_FILE", raising=False)

    handler = create_handler(params(cluster.port, "tls-plugin", token_file=str(token), tls_ca=ca[0]))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        job = job_view(cluster, "tls-plugin")
        assert job["state"] == "running" and [n["node_id"] for n in job["nodes"]] == [handler.settings.node_id]
    finally:
        handler.shutdown()

    monkeypatch.setenv("RDZV_TOKEN", TOKEN)            # the agents' variable serves the plugin too
    by_env = create_handler(params(cluster.port, "tls-plugin-env", tls_ca=ca[0]))
    try:
        assert by_env.next_rendezvous().world_size == 1
    finally:
        by_env.shutdown()
    monkeypatch.delenv("RDZV_TOKEN")

    without = create_handler(params(cluster.port, "no-token", tls_ca=ca[0]))
    with pytest.raises(SystemExit) as exit_:
        without.next_rendezvous()
    assert exit_.value.code == 1
    said = capsys.readouterr().err
    assert "token" in said and "Traceback" not in said
