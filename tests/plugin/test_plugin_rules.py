"""The plugin's pure decisions (plugin/session.py) and its settings (plugin/settings.py)."""
from __future__ import annotations

import re

import pytest

from node_agent.client.replies import newer_assignment as assignment_after
from node_agent.client.replies import takes_poll_reply
from node_agent.plugin.session import needs_rendezvous, still_in_round
from node_agent.plugin.settings import SettingsError, TorchLaunch, plugin_settings
from protocol.messages import Assignment, JobState, NodeState, NodeStatus


def status(node: NodeState = NodeState.MEMBER, round_id: int = 1, job: JobState = JobState.RUNNING) -> NodeStatus:
    assignment = None
    if node is NodeState.MEMBER:
        assignment = Assignment(round_id=round_id, group_rank=0, group_world_size=1, rank_offset=0, world_size=1,
                                local_world_size=1, master_addr="127.0.0.1", master_port=1, restart_count=0,
                                max_restarts=0)
    return NodeStatus(job_id="j", job_state=job, node_state=node, round_id=round_id, restart_count=0,
                      assignment=assignment)


# ------------------------------------------------------------------------------- needs_rendezvous

def test_nothing_to_do_while_the_server_runs_our_round():
    assert not needs_rendezvous(status(round_id=3), 3)


@pytest.mark.parametrize("view", [
    status(round_id=4),                                    # a newer round: failure elsewhere, node lost or joined
    status(NodeState.WAITING, round_id=-1),                # the round dissolved (below min nodes)
    status(NodeState.SPARE), status(NodeState.EXCLUDED), status(NodeState.GONE),
    status(NodeState.GONE, job=JobState.FAILED), status(NodeState.GONE, job=JobState.CLOSED),
])
def test_torch_restarts_its_workers_when_the_job_moved_on(view):
    assert needs_rendezvous(view, 3)


def test_a_late_reply_about_an_older_round_and_a_succeeded_job_are_no_news():
    assert not needs_rendezvous(status(round_id=2), 3)
    assert not needs_rendezvous(status(NodeState.GONE, job=JobState.SUCCEEDED), 3)


def test_no_workers_running_means_nothing_to_restart():
    assert not needs_rendezvous(status(round_id=4), -1)
    assert not needs_rendezvous(None, 3)


def test_still_in_round_means_our_own_workers_failed():
    assert still_in_round(status(round_id=3), 3)
    assert not still_in_round(status(round_id=4), 3)
    assert not still_in_round(status(NodeState.WAITING, round_id=-1), 3)
    assert not still_in_round(status(round_id=3, job=JobState.FAILED), 3)


def test_assignment_after_takes_only_a_newer_round():
    assert assignment_after(status(round_id=3), 3) is None
    a = assignment_after(status(round_id=4), 3)
    assert a is not None and a.round_id == 4
    assert assignment_after(status(NodeState.SPARE), 3) is None


# ------------------------------------------------------------------------------- poll-reply order

def test_a_poll_sent_after_the_latest_answer_is_taken_as_it_comes():
    assert takes_poll_reply(status(round_id=5), status(NodeState.WAITING, round_id=-1), sent_before_latest=False)


def test_a_poll_sent_before_the_latest_answer_is_taken_only_when_it_shows_progress():
    view = status(round_id=5)
    assert not takes_poll_reply(view, status(round_id=4), sent_before_latest=True)
    assert not takes_poll_reply(view, status(NodeState.WAITING, round_id=-1), sent_before_latest=True)
    assert takes_poll_reply(view, status(round_id=6), sent_before_latest=True)
    assert takes_poll_reply(view, status(NodeState.GONE, job=JobState.FAILED), sent_before_latest=True)
    assert not takes_poll_reply(status(NodeState.GONE, job=JobState.FAILED), status(round_id=6), True)


# ------------------------------------------------------------------------------------- settings

LAUNCH = TorchLaunch(local_world_size=1, max_restarts=0)


def settings(conf=None, launch=LAUNCH, endpoint="127.0.0.1:29400", run_id="job42", nnodes=(1, 4), environ=None):
    return plugin_settings(endpoint=endpoint, run_id=run_id, min_nodes=nnodes[0], max_nodes=nnodes[1],
                           local_addr="10.0.0.1", conf=conf or {}, launch=launch, environ=environ or {})


def test_torchrun_rdzv_conf_keys_become_the_job_config():
    s = settings({"join_timeout": "120", "last_call_timeout": "2.5", "heartbeat_timeout": "7", "close_timeout": "4",
                  "read_timeout": "30", "max_restarts": "5", "exclude_after": "0"}, TorchLaunch(8, 3, "trainer"))
    c = s.config
    assert (c.min_nodes, c.max_nodes, c.join_timeout_s, c.last_call_s, c.lease_timeout_s) == (1, 4, 120, 2.5, 7)
    assert (c.max_restarts, c.exclude_after) == (5, 0)       # --rdzv-conf max_restarts wins over --max-restarts
    assert (s.close_timeout_s, s.store_timeout_s, s.local_world_size, s.role) == (4, 30, 8, "trainer")
    assert (s.host, s.port, s.addr, s.job_id) == ("127.0.0.1", 29400, "10.0.0.1", "job42")


def test_max_restarts_and_workers_come_from_torchs_launch_by_default():
    s = settings({"timeout": "900"}, TorchLaunch(local_world_size=2, max_restarts=3, role="trainer"))
    assert (s.config.max_restarts, s.local_world_size, s.config.join_timeout_s, s.role) == (3, 2, 900, "trainer")
    assert settings({"timeout": "900", "join_timeout": "60"}).config.join_timeout_s == 60
    plain = settings()
    assert (plain.config.max_restarts, plain.local_world_size, plain.port) == (0, 1, 29400)


def test_without_torchs_launch_the_sizes_must_be_given_never_guessed():
    with pytest.raises(SettingsError, match="^torch's launch configuration could not be read, so local_world_size "
                                            "and max_restarts are not known: give --rdzv-conf "
                                            "local_world_size=N,max_restarts=K"):
        settings(launch=None)
    with pytest.raises(SettingsError, match="so max_restarts is not known"):
        settings({"local_world_size": "2"}, launch=None)
    given = settings({"local_world_size": "2", "max_restarts": "4"}, launch=None)
    assert (given.local_world_size, given.config.max_restarts, given.role) == (2, 4, "default")


def test_without_a_run_id_the_plugin_derives_one_as_node_agent_does():
    """The scheduler's job id, else the user's name and the command's fingerprint (the same as node-agent's
    for the same command, so the two kinds of node find one job)."""
    from node_agent.cli.job_identity import command_fingerprint
    launch = TorchLaunch(local_world_size=2, max_restarts=1, kind="python", script="train.py", script_args=("--lr",))
    for run_id in ("none", ""):
        s = settings(launch=launch, run_id=run_id, environ={"USER": "alice"})
        assert s.job_id == f"alice-{command_fingerprint('python', 'train.py', ('--lr',))[:12]}"
        assert s.job_id_source == "your user name and the command's fingerprint"
    slurm = settings(launch=launch, run_id="none", environ={"SLURM_JOB_ID": "812", "USER": "alice"})
    assert (slurm.job_id, slurm.job_id_source) == ("slurm-812", "$SLURM_JOB_ID")
    assert settings(launch=launch, run_id="given").job_id_source == ""
    with pytest.raises(SettingsError, match=r"^no run id.*--rdzv-id ID, or set \$PET_RDZV_ID"):
        settings({"local_world_size": "2", "max_restarts": "4"}, launch=None, run_id="none")


def test_one_pair_of_stray_quotes_around_rdzv_conf_is_dropped():
    """torch's own parser keeps the quotes of `--rdzv-conf='join_timeout=5,...'` (PyTorch's launcher
    tests write it so): in the first key and the last value."""
    s = settings({"'join_timeout": "5", "last_call_timeout": "1", "timeout": "5'"})
    assert (s.config.join_timeout_s, s.config.last_call_s) == (5.0, 1.0)
    assert settings({'"max_restarts': '2"'}).config.max_restarts == 2
    for spoiled in ({"'join_timeout": "5"}, {"'join_timeout": '5"'}, {"''join_timeout": "5''"}):
        with pytest.raises(SettingsError, match="unknown key \"'join_timeout\""):
            settings(spoiled)


@pytest.mark.parametrize("conf, message", [
    ({"join_timeout": "soon"}, "--rdzv-conf join_timeout: expected a number of seconds, got 'soon'"),
    ({"last_call_timeout": "-1"}, "--rdzv-conf last_call_timeout: expected a number of seconds >= 0, got '-1'"),
    ({"heartbeat_timeout": "0"}, "--rdzv-conf heartbeat_timeout: expected `float` > 0.0"),
    ({"max_restarts": "2.5"}, "--rdzv-conf max_restarts: expected a whole number, got '2.5'"),
    ({"local_world_size": "0"}, "--rdzv-conf local_world_size: expected at least 1 worker, got 0"),
    ({"node_id": "a b"}, "--rdzv-conf node_id: node id must be"),
    ({"jion_timeout": "5"}, "--rdzv-conf: unknown key 'jion_timeout' for --rdzv-backend rdzv-server; known keys:"),
])
def test_a_bad_rdzv_conf_value_names_its_key(conf, message):
    with pytest.raises(SettingsError) as info:
        settings(conf)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("endpoint, run_id, message", [
    ("host:0", "job42", "--rdzv-endpoint: .*port '?0"),     # port 0 names no server
    ("host:http", "job42", "--rdzv-endpoint: bad port 'http'"),
    ("127.0.0.1:29400", "team exp1", r"--rdzv-id \(or \$PET_RDZV_ID\): job id must be"),
])
def test_a_bad_endpoint_or_id_is_one_line(endpoint, run_id, message):
    with pytest.raises(SettingsError, match="^" + message):
        settings(endpoint=endpoint, run_id=run_id)


def test_an_empty_endpoint_is_torchs_default_and_ipv6_needs_brackets():
    assert (settings(endpoint="").host, settings(endpoint="").port) == ("localhost", 29400)
    assert (settings(endpoint="[::1]:7").host, settings(endpoint="[::1]:7").port) == ("::1", 7)


def test_the_servers_token_and_ca_come_from_rdzv_conf_or_the_agents_variables(tmp_path):
    token, ca = tmp_path / "token", tmp_path / "ca.pem"
    token.write_text("plugin-token-0123456789abcdef\n")
    ca.write_text("PEM")
    s = settings({"token_file": str(token), "tls_ca": str(ca)})
    assert (s.scheme, s.token, s.tls_ca, s.host, s.port) == ("https", "plugin-token-0123456789abcdef", str(ca),
                                                             "127.0.0.1", 29400)
    assert settings(endpoint="https://h:1").scheme == "https"
    env = plugin_settings(endpoint="h:1", run_id="j", min_nodes=1, max_nodes=1, local_addr="10.0.0.1", conf={},
                          launch=LAUNCH, environ={"RDZV_TOKEN": "env-token-0123456789abcdef"})
    assert (env.scheme, env.token, env.tls_ca) == ("http", "env-token-0123456789abcdef", None)
    assert (settings().token, settings().scheme) == (None, "http")


@pytest.mark.parametrize("conf, endpoint, message", [
    ({"tls_ca": "/no/such/ca.pem"}, "h:1", "--rdzv-conf tls_ca: no such file: /no/such/ca.pem"),
    ({"token_file": "/no/such/token"}, "h:1", "--rdzv-conf token_file /no/such/token: No such file"),
    ({"tls_ca": "CA"}, "http://h:1", "--rdzv-endpoint: --tls-ca needs an https endpoint"),
])
def test_a_bad_token_or_ca_is_one_line(tmp_path, conf, endpoint, message):
    if conf.get("tls_ca") == "CA":
        (tmp_path / "ca.pem").write_text("PEM")
        conf = {"tls_ca": str(tmp_path / "ca.pem")}
    with pytest.raises(SettingsError, match="^" + re.escape(message)):
        settings(conf, endpoint=endpoint)
