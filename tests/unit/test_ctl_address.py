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
