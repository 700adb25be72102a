"""rdzv-ctl's server address: a mistyped one is one usage line, never a traceback."""
from __future__ import annotations

import pytest

from rdzv_ctl import cli


@pytest.mark.parametrize("address", ["http://[::1", "[::1", "http://[zz]:1", "127.0.0.1:abc", "127.0.0.1:99999"])
def test_a_malformed_server_address_is_one_usage_line(address, capsys, monkeypatch):
    # A review typed `--server http://[::1` and got urllib's ValueError traceback ("Invalid IPv6 URL").
    monkeypatch.delenv("RDZV_SERVER", raising=False)
    assert cli.main(["--server", address, "status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "server address must look like" in err and repr(address)[1:-1] in err


def test_a_well_formed_ipv6_address_is_taken():
    from rdzv_ctl.client import server_url
    assert server_url("[::1]:29400", None, None) == "http://[::1]:29400"


def test_a_refusal_of_a_very_long_path_is_one_short_line_that_says_why():
    # A review closed a job named by 20,000 characters: a 20 kB error line ending in a bare "HTTP 400 Bad Request".
    import io
    import urllib.error
    import urllib.request
    from email.message import Message

    from rdzv_ctl.client import Client

    client = Client("http://127.0.0.1:29400", 1.0)
    path = "/v1/admin/jobs/" + "j" * 20_000 + "/close"
    req = urllib.request.Request(client.server + path, method="POST")
    exc = urllib.error.HTTPError(req.full_url, 400, "Bad Request", Message(), io.BytesIO(b"line too long"))
    said = client._refusal(req, exc, None, admin=True)
    assert len(said) < 500 and f"({len(path)} characters)" in said and "is a job, node or host name that long" in said
