"""torchrun's command line as node-agent reads it: the forms of launch, PET_* variables, prefixes of flags,
--rdzv-conf, the shutdown grace, signals, refused flags and the job's identity."""
from __future__ import annotations

import signal
import uuid

import pytest

from node_agent.cli.job_identity import command_fingerprint
from node_agent.cli.options import OptionsError, agent_token, parse_options
from node_agent.settings import Mode
from tests.options_view import flat

BASE = {"CUDA_VISIBLE_DEVICES": "", "USER": "alice", "LOGNAME": "alice"}


def parse(*argv: str, **env: str):
    return flat(parse_options(list(argv), environ={**BASE, **env}))


def error_of(*argv: str, **env: str) -> str:
    with pytest.raises(OptionsError) as info:
        parse(*argv, **env)
    assert "\n" not in str(info.value)
    return str(info.value)


# ---- forms of launch ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, job_id", [
    (["--nproc-per-node", "2"], None),                                       # the most common line
    (["--nnodes=1", "--rdzv-id=test_run"], "test_run"),                      # torch's own launcher tests
    (["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--rdzv_id", "app-1", "--nnodes", "1"], "app-1"),
    (["--rdzv-backend", "c10d", "--nnodes", "1"], None),                     # c10d would host itself
    (["--standalone", "--nnodes", "1"], None),
])
def test_single_node_forms_need_no_server(argv: list[str], job_id: str | None) -> None:
    o = parse(*argv, "t.py")
    assert o.mode is Mode.STANDALONE and o.endpoint_host is None and (o.job.min_nodes, o.job.max_nodes) == (1, 1)
    if job_id is None:
        uuid.UUID(o.job_id)     # a fresh id, as torchrun's standalone run id
    else:
        assert o.job_id == job_id


def test_static_launches_follow_node_rank_and_the_master() -> None:
    o = parse("--nnodes", "4", "--node_rank", "2", "--master_addr", "10.1.1.1", "--master_port", "1234",
              "--nproc-per-node", "3", "t.py")
    assert (o.mode, o.node_rank, o.master_addr, o.master_port, o.job.max_nodes) == (Mode.STATIC, 2, "10.1.1.1",
                                                                                    1234, 4)
    assert o.job_id == "none" and o.warnings == ()      # torchrun's run id; no server: nothing to merge
    o = parse("--nnodes", "1", "--master-port", "29600", "t.py")     # one node, but a port: static, as torchrun
    assert (o.mode, o.master_addr, o.master_port) == (Mode.STATIC, "127.0.0.1", 29600)
    o = parse("--nnodes", "2", "t.py")                                     # torchrun's defaults
    assert (o.mode, o.node_rank, o.master_addr, o.master_port) == (Mode.STATIC, 0, "127.0.0.1", 29500)
    o = parse("--rdzv-backend", "static", "--rdzv-endpoint", "[::1]:7", "--nnodes", "2", "--node-rank", "1", "t.py")
    assert (o.mode, o.master_addr, o.master_port, o.warnings) == (Mode.STATIC, "::1", 7, ())
    o = parse("--master-addr", "[fe80::1]", "--master-port", "9", "--nnodes", "2", "t.py")
    assert o.master_addr == "fe80::1"


def test_an_endpoint_without_a_backend_is_torchruns_static_master_with_a_warning() -> None:
    o = parse("--rdzv-endpoint", "srv:29400", "--nnodes", "2", "--node-rank", "1", "t.py")
    assert (o.mode, o.node_rank, o.master_addr, o.master_port) == (Mode.STATIC, 1, "srv", 29400)
    assert len(o.warnings) == 1 and "--rdzv-backend c10d" in o.warnings[0]
    o = parse("--rdzv-endpoint", "srv:29400", "--nnodes", "1", "t.py")          # one node: rank 0 is right
    assert (o.mode, o.master_addr, o.master_port) == (Mode.STATIC, "srv", 29400)


@pytest.mark.parametrize("argv, env, named", [
    (["--nnodes", "2", "--rdzv-endpoint", "srv:29400"], {}, "--rdzv-endpoint"),
    (["--nnodes", "1:4", "--rdzv_endpoint=srv:29400"], {}, "--rdzv_endpoint"),
    (["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "srv:29400"], {}, "--rdzv-endpoint"),
    ([], {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "srv:29400"}, "$PET_RDZV_ENDPOINT"),
])
def test_several_nodes_at_an_endpoint_with_no_backend_and_no_node_rank_are_refused(
        argv: list[str], env: dict[str, str], named: str) -> None:
    """Every node would be node rank 0 of a static launch and wait for the others forever."""
    line = error_of(*argv, "t.py", **env)
    assert line.startswith(f"{named}: ") and "node rank 0" in line
    assert "--rdzv-backend c10d" in line and "--node-rank" in line


@pytest.mark.parametrize("argv, env, mode", [
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "srv:29400"], {}, Mode.SERVER),
    (["--nnodes", "2", "--rdzv-backend", "rdzv-server", "--rdzv-endpoint", "srv:29400"], {}, Mode.SERVER),
    (["--nnodes", "2", "--endpoint", "srv:29400"], {}, Mode.SERVER),
    ([], {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "srv:29400", "PET_RDZV_BACKEND": "c10d"}, Mode.SERVER),
    ([], {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "srv:29400", "PET_NODE_RANK": "1"}, Mode.STATIC),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "srv", "--master-port", "29500"], {}, Mode.STATIC),
    (["--standalone", "--nnodes", "2", "--rdzv-endpoint", "srv:29400"], {}, Mode.STANDALONE),
])
def test_the_other_multi_node_forms_at_an_endpoint_still_start(argv: list[str], env: dict[str, str],
                                                                mode: Mode) -> None:
    assert parse(*argv, "t.py", **env).mode is mode


@pytest.mark.parametrize("argv, start", [
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank: must be 0..1"),
    (["--nnodes", "2", "--master-port", "x"], "--master-port: expected a port number"),
    (["--nnodes", "2", "--master-port", "70000"], "--master-port: expected a port 1-65535"),
    (["--nnodes", "2", "--master-addr", ""], "--master-addr: must not be empty"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0", "--nnodes", "2"], "--rdzv-endpoint: port 0"),
])
def test_static_and_endpoint_errors(argv: list[str], start: str) -> None:
    assert error_of(*argv, "t.py").startswith(start)


def test_a_server_for_several_nodes() -> None:
    o = parse("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--nnodes", "1:3", "t.py")
    assert (o.mode, o.endpoint, o.job.min_nodes, o.job.max_nodes) == (Mode.SERVER, "h:1", 1, 3)
    o = parse("--rdzv-backend", "etcd", "--nnodes", "2", "t.py")     # torch's default endpoint
    assert (o.mode, o.endpoint) == (Mode.SERVER, "localhost:29400")
    o = parse("--endpoint", "https://h:1", "--nnodes", "1", "t.py")  # ours: always a server
    assert (o.mode, o.endpoint_scheme) == (Mode.SERVER, "https")


# ---- PET_* variables and prefixes --------------------------------------------------------------

def test_pet_variables_stand_for_flags_left_out() -> None:
    o = parse("t.py", PET_NPROC_PER_NODE="3", PET_NNODES="1", PET_MAX_RESTARTS="2", PET_LOG_DIR="/logs",
              PET_TEE="3", PET_ROLE="trainer", PET_MODULE="1", PET_SHUTDOWN_TIMEOUT="9")
    assert (o.mode, o.nproc, o.job.max_restarts, o.log_dir, o.role, o.module, o.stop_timeout) == (
        Mode.STANDALONE, 3, 2, "/logs", "trainer", True, 9.0)
    assert o.tee.for_rank(0) == 3
    o = parse("t.py", PET_RDZV_BACKEND="c10d", PET_RDZV_ENDPOINT="h:5", PET_NNODES="2", PET_RDZV_ID="k8s-job")
    assert (o.mode, o.endpoint, o.job_id, o.job_id_source) == (Mode.SERVER, "h:5", "k8s-job", "")
    o = parse("--nproc-per-node", "1", "--no-python", "t.py", PET_NPROC_PER_NODE="5", PET_NO_PYTHON="0")
    assert (o.nproc, o.no_python) == (1, True)                       # the command line wins
    assert not parse("t.py", PET_STANDALONE="0", PET_NNODES="1").module
    static = parse("t.py", PET_NNODES="2", PET_NODE_RANK="1", PET_MASTER_ADDR="m", PET_MASTER_PORT="23456")
    assert (static.mode, static.node_rank, static.master_addr, static.master_port) == (Mode.STATIC, 1, "m", 23456)


def test_pet_errors_name_the_variable() -> None:
    assert error_of("t.py", PET_MODULE="yes") == "$PET_MODULE: expected 0 or 1, got 'yes'"
    assert error_of("t.py", PET_NNODES="x").startswith("$PET_NNODES:")


@pytest.mark.parametrize("argv, attr, value", [
    (["--redirect=3"], "redirects.default", 3),
    (["--nproc-per", "2"], "nproc", 2),
    (["--max-r", "4"], "job.max_restarts", 4),
    (["--node_", "1", "--nnodes", "2"], "node_rank", 1),    # torchrun's --node_rank, not our --node_id
    (["--shutdown", "3"], "stop_timeout", 3.0),
    (["--rdzv-c", "join_timeout=5"], "job.join_timeout_s", 5.0),
])
def test_unambiguous_prefixes_name_the_flag_as_in_torchrun(argv: list[str], attr: str, value: object) -> None:
    opts: object = parse(*argv, "t.py")
    for part in attr.split("."):
        opts = getattr(opts, part)
    assert opts == value


# ---- rdzv-conf, shutdown grace, signals, refused flags -----------------------------------------

def test_rdzv_conf_keys_become_the_jobs_settings() -> None:
    o = parse("--endpoint", "h", "--max-restarts", "9", "--rdzv-conf",
              "join_timeout=30, last_call_timeout=1,heartbeat_timeout=4,timeout=99,max_restarts=2,server_wait=7",
              "t.py")
    assert (o.job.join_timeout_s, o.job.last_call_s, o.job.lease_timeout_s) == (30.0, 1.0, 4.0)
    assert (o.job.max_restarts, o.server_wait) == (2, 7.0)           # the job budget, as for the plugin
    assert parse("--endpoint", "h", "--rdzv-conf", "timeout=45", "t.py").job.join_timeout_s == 45.0
    noted = parse("--endpoint", "h", "--rdzv_conf", "close_timeout=3,is_host=1,read_timeout=9", "t.py").warnings
    assert sorted(w.split(" has")[0] for w in noted) == ["--rdzv-conf close_timeout", "--rdzv-conf is_host",
                                                        "--rdzv-conf read_timeout"]


@pytest.mark.parametrize("argv", [
    ["--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'"],      # PyTorch's launcher tests' line
    ["--rdzv-conf", '"join_timeout=5, last_call_timeout=1"'],
    ["--rdzv_conf", "' join_timeout = 5 ,last_call_timeout=1 '"],
])
def test_one_pair_of_stray_quotes_around_rdzv_conf_is_dropped(argv: list[str]) -> None:
    o = parse("--endpoint", "h", *argv, "t.py")
    assert (o.job.join_timeout_s, o.job.last_call_s) == (5.0, 1.0)


@pytest.mark.parametrize("conf, start", [
    ("'join_timeout=5", "--rdzv_conf: unknown key \"'join_timeout\""),     # no pair: the key check stays strict
    ("''join_timeout=5''", "--rdzv_conf: unknown key \"'join_timeout\""),  # one pair only
    ("'join_timeout=5\"", "--rdzv_conf: unknown key \"'join_timeout\""),  # not a matching pair
    ("join_timeout=soon", "--rdzv-conf join_timeout: expected a number of seconds"),
    ("last_call_timeout=-1", "--rdzv-conf last_call_timeout: must be >= 0.0"),
    ("joint_timeout=1", "--rdzv_conf: unknown key 'joint_timeout'; known keys: close_timeout,"),
    ("join_timeout", "--rdzv_conf: join_timeout has no value"),
])
def test_rdzv_conf_errors(conf: str, start: str) -> None:
    assert error_of("--endpoint", "h", "--rdzv_conf", conf, "t.py").startswith(start)


def test_shutdown_grace_is_torchruns_flag_its_variable_or_30s() -> None:
    assert parse("t.py").stop_timeout == 30.0
    assert parse("t.py", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="12").stop_timeout == 12.0
    assert parse("--shutdown-timeout", "3", "t.py", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="12").stop_timeout == 3.0
    assert parse("--stop-timeout=0.5", "t.py").stop_timeout == 0.5
    assert error_of("t.py", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="x").startswith("$TORCH_ELASTIC_SHUTDOWN_TIMEOUT:")


def test_signals_to_handle() -> None:
    o = parse("--signals-to-handle", "SIGTERM, SIGUSR1,USR2,SIGTERM", "t.py")
    assert o.signals == (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    assert "SIGFOO" in error_of("--signals_to_handle", "SIGFOO", "t.py")
    assert error_of("--signals-to-handle", "SIGKILL", "t.py").startswith("--signals-to-handle: SIGKILL cannot")


@pytest.mark.parametrize("argv", [["--logs-specs", "default"], ["--logs_specs", "default"], ["--logs-spec=default"]])
def test_logs_specs_default_is_torchruns_layout_which_node_agent_writes(argv: list[str]) -> None:
    o = parse(*argv, "t.py")
    assert o.warnings == () and o.script == "t.py"


@pytest.mark.parametrize("argv, words", [
    (["--logs-specs", "mine"], ["--logs-specs: only 'default', got 'mine'", "--log-dir"]),
    (["--logs_specs=custom"], ["--logs_specs: only 'default', got 'custom'", "--log-dir"]),
    # --numa-binding is taken now (tests/unit/test_gpu_options.py); an unknown mode is refused with the four
    (["--numa_binding", "nodes"], ["--numa_binding: expected one of node, socket, exclusive, core-complex"]),
    (["--event-log-handler", "console"], ["--event-log-handler: only 'null'", "rdzv-ctl events"]),
    (["--nproc-per-node", "xpu"], ["--nproc-per-node:", "NVIDIA"]),
    (["--virtual-local-rank", "--nproc-per-node", "3"], ["--virtual-local-rank: 3 workers", "lists 2"]),
])
def test_refused_flags_say_why_or_what_instead(argv: list[str], words: list[str]) -> None:
    message = error_of(*argv, "t.py", CUDA_VISIBLE_DEVICES="0,1")
    assert all(w in message for w in words), message


def test_entry_points_and_other_torchrun_settings() -> None:
    o = parse("--run-path", "-m", "--no-python", "t.py")     # --run-path wins, as in torchrun
    assert (o.run_path, o.module, o.no_python) == (True, True, True)
    o = parse("--role", "", "--virtual-local-rank", "--duplicate-stderr-filters", "x", "t.py", CUDA_VISIBLE_DEVICES="0",
              TORCHELASTIC_ERROR_FILE="/tmp/reply.json", TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[${rank}]")
    assert (o.role, o.virtual_local_rank, o.dup_stderr) == ("", True, ("x",))   # TorchX passes --role ""
    assert (o.reply_file, o.tee_prefix) == ("/tmp/reply.json", "[${rank}]")


# ---- the job's identity ------------------------------------------------------------------------

SERVER = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--nnodes", "2")


def test_the_job_id_comes_from_the_flag_then_the_scheduler_then_user_and_command() -> None:
    assert parse(*SERVER, "--rdzv-id", "team/exp1", "t.py", SLURM_JOB_ID="77").job_id == "team/exp1"
    o = parse(*SERVER, "t.py", SLURM_JOB_ID="77")
    assert (o.job_id, o.job_id_source) == ("slurm-77", "$SLURM_JOB_ID")
    assert parse(*SERVER, "--rdzv-id", "none", "t.py", SLURM_JOB_ID="77", SLURM_STEP_ID="3").job_id == "slurm-77.3"
    assert parse(*SERVER, "t.py", JOBSET_NAME="train-a").job_id == "jobset-train-a"
    # a JobSet deleted and made again under its name is a new object, with a new uid: a new job
    uid = "5f1c2d3e-aaaa-4bbb-8ccc-0123456789ab"
    o = parse(*SERVER, "t.py", JOBSET_NAME="train-a", JOBSET_UID=uid)
    assert (o.job_id, o.job_id_source) == (f"jobset-train-a-{uid}", "$JOBSET_NAME-$JOBSET_UID")
    assert parse(*SERVER, "t.py", JOBSET_NAME="train-a", JOBSET_UID="").job_id == "jobset-train-a"
    mine = parse(*SERVER, "t.py", "--lr", "1")
    assert mine.job_id == f"alice-{command_fingerprint('python', 't.py', ('--lr', '1'))[:12]}"
    assert parse(*SERVER, "t.py", "--lr", "1").job_id == mine.job_id           # every node of the command
    assert parse(*SERVER, "t.py", "--lr", "2").job_id != mine.job_id           # another run: another job
    assert parse(*SERVER, "t.py", "--lr", "1", USER="bob", LOGNAME="bob").job_id != mine.job_id
    assert parse(*SERVER, "-m", "t.py", "--lr", "1").command != mine.command   # how it runs counts too


def test_the_command_fingerprint_goes_with_joins_unless_turned_off() -> None:
    assert parse(*SERVER, "--rdzv-id", "j", "t.py").command == command_fingerprint("python", "t.py", ())
    assert parse(*SERVER, "--rdzv-id", "j", "--no-command-check", "t.py").command == ""
    assert error_of(*SERVER, "--rdzv-id", "x" * 513, "t.py").startswith("--rdzv-id: job id must be 1-512")


def test_the_servers_token_and_ca_from_rdzv_conf(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("conf-token-0123456789abcdef\n")
    o = parse(*SERVER, "--rdzv-id", "j", "--rdzv-conf", f"token_file={token}", "t.py")
    assert (o.token_file, agent_token(o), o.endpoint_scheme) == (str(token), "conf-token-0123456789abcdef", "http")
    missing = parse(*SERVER, "--rdzv-conf", "token_file=/no/such", "t.py")     # read at start-up, not here
    with pytest.raises(OptionsError, match="^--token-file /no/such: No such file"):
        agent_token(missing)
    assert agent_token(parse(*SERVER, "t.py", RDZV_TOKEN="env-token-0123456789abcdef")) == "env-token-0123456789abcdef"
    assert error_of(*SERVER, "t.py", RDZV_TOKEN="short").startswith("$RDZV_TOKEN:")
    assert error_of(*SERVER, "--rdzv-conf", "tls_ca=/no/such", "t.py") == "--rdzv-conf tls_ca: no such file: /no/such"
    assert error_of(*SERVER, "--tls_ca", "/no/such", "t.py") == "--tls_ca: no such file: /no/such"
