"""`rdzv-server --store etcd://...` and `node-agent --endpoint a,b`: the flags parse into what the
replicas and agents use, and bad ones end with one line and exit 2 before anything starts."""
from __future__ import annotations

import pytest

from node_agent.cli.options import parse_options
from rdzv_server import cli
from rdzv_server.store.etcd.options import settings_from


def args(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def test_the_store_url_and_etcdctl_style_flags_become_settings(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not used: the file must only exist for this check\n")
    password = tmp_path / "pw"
    password.write_text("s3cret\n")
    s = settings_from(args("--store", "etcd://e1:2379,[::1]:2380,e3", "--etcd-prefix", "/team-a",
                           "--etcd-user", "rdzv", "--etcd-password-file", str(password)))
    assert s.endpoints == ("http://e1:2379", "http://[::1]:2380", "http://e3:2379")
    assert s.prefix == "/team-a/" and s.user == "rdzv" and s.password == "s3cret"
    assert settings_from(args("--store", "etcd://e1:2379", "--etcd-user", "u:pw")).password == "pw"


@pytest.mark.parametrize("argv, words", [
    (["--store", "http://e1:2379"], "--store: expected etcd://HOST:PORT"),
    (["--store", "etcd://e1:99999"], "--store: bad port"),
    (["--store", "etcd://e1:2379", "--state-dir", "x"], "give one"),
    (["--advertise-url", "http://me:1"], "--advertise-url needs --store"),
    (["--store", "etcd://e1:2379", "--advertise-url", "me:1"], "must be an http:// or https:// URL"),
    (["--store", "etcd://e1:2379", "--leader-ttl", "1"], "--leader-ttl must be >= 2"),
    (["--store", "etcd://e1:2379", "--etcd-cacert", "/nonexistent/ca.pem"], "--etcd-cacert /nonexistent/ca.pem"),
    (["--store", "etcd://e1:2379", "--etcd-cert", "c.pem"], "--etcd-cert and --etcd-key go together"),
    (["--store", "etcd://e1:2379", "--etcd-password", "pw"], "needs --etcd-user"),
    (["--store", "etcd://e1:2379", "--etcd-max-txn-ops", "8"], "--etcd-max-txn-ops must be >="),
])
def test_bad_etcd_flags_are_one_line_and_exit_2(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(cli, "serve", lambda *a, **k: pytest.fail("the server started despite bad flags"))
    assert cli.main(["--host", "127.0.0.1", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err


def test_node_agent_takes_replicas_as_one_comma_separated_endpoint():
    opts = parse_options(["--endpoint", "rdzv-1:29400, rdzv-2:29401,[::1]", "train.py"], {}).link
    assert (opts.endpoint_host, opts.endpoint_port) == ("rdzv-1", 29400)
    assert opts.endpoint_replicas == (("rdzv-2", 29401), ("::1", 29400))


def test_node_agent_replicas_share_one_scheme():
    from node_agent.cli.options import OptionsError
    with pytest.raises(OptionsError, match="same scheme"):
        parse_options(["--endpoint", "https://a:1,http://b:2", "train.py"], {})
