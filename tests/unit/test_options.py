"""The node-agent command line: torchrun aliases, -j, nproc resolution, Std specs and errors."""
from __future__ import annotations

import getpass
import os
import signal
import socket
import uuid

import pytest

from node_agent.cli.job_identity import command_fingerprint
from node_agent.cli.options import OptionsError, build_argparser, count_gpus, parse_options
from node_agent.settings import Mode, Std, StdSpec
from protocol.ids import job_id_problem, node_id_problem
from protocol.messages import JobConfig
from tests.options_view import flat

EP = ["--endpoint", "rdzv.example:29400"]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def parse(*argv: str, environ: dict[str, str] | None = None):
    return flat(parse_options(list(argv), environ=NO_GPU if environ is None else environ))


def error_of(*argv: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(OptionsError) as info:
        parse(*argv, environ=environ)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults() -> None:
    o = parse(*EP, "train.py")
    assert o.mode is Mode.SERVER and o.mode is not Mode.STANDALONE
    assert (o.endpoint_host, o.endpoint_port, o.endpoint) == ("rdzv.example", 29400, "rdzv.example:29400")
    assert (o.nproc, o.job.min_nodes, o.job.max_nodes) == (1, 1, 1)
    assert (o.job.max_restarts, o.role) == (0, "default")
    assert o.command == command_fingerprint("python", "train.py", ())
    assert o.job_id == f"{getpass.getuser()}-{o.command[:12]}" and o.job_id_source   # said at start
    assert o.node_id == f"{socket.gethostname()}-{os.getpid()}"
    assert (o.stop_timeout, o.server_wait) == (30, 60)   # torchrun's shutdown grace
    assert (o.job.hang_detection, o.job.hang_timeout_s, o.job.replace_slow_nodes) == (True, 600.0, False)
    assert o.job.hang_alone_timeout_s == 1800.0          # minutes, not seconds: docs/fault-tolerance.md says why
    assert o.signals == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    assert (o.reply_file, o.log_line_prefix, o.tee_prefix) == (None, None, "[${role_name}${local_rank}]:")
    assert o.job == JobConfig()   # every job setting left out takes JobConfig's default, as on the wire
    assert (o.module, o.no_python, o.log_dir, o.local_addr) == (False, False, None, None)
    assert o.redirects.for_rank(0) == Std.NONE and o.tee.for_rank(5) == Std.NONE
    assert o.local_ranks_filter is None and o.warnings == ()
    assert (o.script, o.script_args) == ("train.py", ())


@pytest.mark.parametrize("flag", ["--endpoint", "--rdzv-endpoint", "--rdzv_endpoint"])
@pytest.mark.parametrize("joined", [False, True])
def test_endpoint_aliases(flag: str, joined: bool) -> None:
    argv = [f"{flag}=h1:1234"] if joined else [flag, "h1:1234"]
    o = parse(*argv, "--rdzv-backend", "c10d", "t.py")
    assert (o.mode, o.endpoint_host, o.endpoint_port) == (Mode.SERVER, "h1", 1234)


@pytest.mark.parametrize("argv, attr, value", [
    (["--nproc", "3"], "nproc", 3),
    (["--nproc-per-node", "4"], "nproc", 4),
    (["--nproc_per_node=5"], "nproc", 5),
    (["--job-id", "j1"], "job_id", "j1"),
    (["--rdzv-id", "j2"], "job_id", "j2"),
    (["--rdzv_id", "j3"], "job_id", "j3"),
    (["--max-restarts", "4"], "job.max_restarts", 4),
    (["--max_restarts=2"], "job.max_restarts", 2),
    (["--log-dir", "/x"], "log_dir", "/x"),
    (["--log_dir", "/y"], "log_dir", "/y"),
    (["--local-addr", "10.0.0.1"], "local_addr", "10.0.0.1"),
    (["--local_addr", "10.0.0.2"], "local_addr", "10.0.0.2"),
    (["--no-python"], "no_python", True),
    (["--no_python"], "no_python", True),
    (["-m"], "module", True),
    (["--module"], "module", True),
    (["--role", "trainer"], "role", "trainer"),
    (["--node-id", "n-7"], "node_id", "n-7"),
    (["--local-ranks-filter", "0,2"], "local_ranks_filter", frozenset({0, 2})),
    (["--local_ranks_filter=1"], "local_ranks_filter", frozenset({1})),
    (["--stop-timeout", "0.5"], "stop_timeout", 0.5),
    (["--last-call", "0"], "job.last_call_s", 0.0),
    (["--join-timeout", "30"], "job.join_timeout_s", 30.0),
    (["--lease-timeout", "2.5"], "job.lease_timeout_s", 2.5),
    (["--lease_timeout=1e-3"], "job.lease_timeout_s", 0.001),
    (["--exclude-after", "0"], "job.exclude_after", 0),
    (["--exclude_window", "60"], "job.exclude_window_s", 60.0),
    (["--exclude-cooldown", "0"], "job.exclude_cooldown_s", 0.0),
    (["--server-wait", "0"], "server_wait", 0.0),
    (["--hang-timeout", "1.5"], "job.hang_timeout_s", 1.5),
    (["--hang_timeout=0"], "job.hang_timeout_s", 0.0),
    (["--hang-detection", "off"], "job.hang_detection", False),
    (["--hang-alone-timeout", "30"], "job.hang_alone_timeout_s", 30.0),
    (["--hang_alone_timeout=0"], "job.hang_alone_timeout_s", 0.0),
    (["--hang_detection=ON"], "job.hang_detection", True),
    (["--replace-slow-nodes"], "job.replace_slow_nodes", True),
    (["--replicas", "0"], "job.replicas", 0),
    (["--replicas", "2"], "job.replicas", 2),
    (["--failure-domain", "rack 7"], "failure_domain", "rack 7"),
    (["--replica-bandwidth", "100M"], "copy_bandwidth", 100 * 2**20),
    (["--replica_bandwidth=0"], "copy_bandwidth", 0),
])
def test_aliases_and_values(argv: list[str], attr: str, value: object) -> None:
    opts: object = parse(*EP, *argv, "t.py")
    for part in attr.split("."):
        opts = getattr(opts, part)
    assert opts == value


def test_script_args_are_untouched() -> None:
    o = parse(*EP, "--nproc", "2", "train.py", "--lr", "0.1", "--nproc", "3", "-m", "--", "x", "--endpoint")
    assert o.nproc == 2 and not o.module
    assert (o.script, o.script_args) == ("train.py", ("--lr", "0.1", "--nproc", "3", "-m", "--", "x", "--endpoint"))


def test_double_dash_before_script_and_module_mode() -> None:
    o = parse(*EP, "-m", "--", "pkg.train", "--", "a")
    assert o.module and (o.script, o.script_args) == ("pkg.train", ("--", "a"))


@pytest.mark.parametrize("argv, script_args", [
    (["train.py", "--", "--lr", "0.5"], ("--lr", "0.5")),             # as torchrun: that `--` ends its options
    (["train.py", "--", "--", "x"], ("--", "x")),
    (["train.py", "a", "--", "b"], ("a", "--", "b")),
    (["-m", "pkg.train", "--", "a"], ("a",)),
])
def test_a_double_dash_right_after_the_script_is_dropped_as_torchrun_drops_it(argv, script_args) -> None:
    assert parse(*EP, *argv).script_args == script_args


@pytest.mark.parametrize("spec, nodes, nproc", [
    ("2x4", (2, 2), 4), ("1:4x8", (1, 4), 8), ("4", (1, 1), 4), ("3:3x1", (3, 3), 1),
])
def test_j_spec(spec: str, nodes: tuple[int, int], nproc: int) -> None:
    for argv in (["-j", spec], [f"-j{spec}"], ["--j", spec]):
        o = parse(*EP, *argv, "t.py")
        assert ((o.job.min_nodes, o.job.max_nodes), o.nproc) == (nodes, nproc)


@pytest.mark.parametrize("other", [["--nnodes", "2"], ["--nproc", "2"], ["--nproc-per-node", "2"]])
def test_j_conflicts_with_explicit_counts(other: list[str]) -> None:
    message = error_of(*EP, "-j", "2x4", *other, "t.py")
    assert "-j" in message and other[0] in message


@pytest.mark.parametrize("spec", ["2y4", "x4", "2x", "1:2:3x4", "0x4", "3:2x4", "2x0"])
def test_j_errors(spec: str) -> None:
    assert error_of(*EP, "-j", spec, "t.py").startswith("-j:")


@pytest.mark.parametrize("text, expected", [("3", (3, 3)), ("1:4", (1, 4)), ("2:2", (2, 2))])
def test_nnodes(text: str, expected: tuple[int, int]) -> None:
    o = parse(*EP, "--nnodes", text, "t.py")
    assert (o.job.min_nodes, o.job.max_nodes) == expected


@pytest.mark.parametrize("text", ["3:2", "0", "0:2", "abc", "1:2:3", "", "1:x", "-1"])
def test_nnodes_errors(text: str) -> None:
    assert error_of(*EP, f"--nnodes={text}", "t.py").startswith("--nnodes:")


def test_nproc_cpu_and_auto_without_gpus() -> None:
    assert parse(*EP, "--nproc", "cpu", "t.py").nproc == os.cpu_count()
    assert parse(*EP, "--nproc", "auto", "t.py").nproc == os.cpu_count()


def test_nproc_gpu_and_auto_follow_visible_gpus() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1,3"}
    assert parse(*EP, "--nproc", "gpu", "t.py", environ=env).nproc == 3
    assert parse(*EP, "--nproc", "auto", "t.py", environ=env).nproc == 3
    o = parse(*EP, "--nproc-per-node", "gpu", "t.py", environ=env)
    assert o.nproc == 3


def test_nproc_gpu_without_gpus_is_an_error() -> None:
    message = error_of(*EP, "--nproc-per-node", "gpu", "t.py", environ={"CUDA_VISIBLE_DEVICES": "-1"})
    assert message.startswith("--nproc-per-node:") and "GPU" in message


@pytest.mark.parametrize("text", ["0", "-2", "many", "1.5", "xpu"])
def test_nproc_errors(text: str) -> None:
    assert error_of(*EP, f"--nproc={text}", "t.py").startswith("--nproc:")


@pytest.mark.parametrize("visible, count", [
    ("0,1,2", 3), ("", 0), ("-1", 0), ("0,,1", 2), ("0,-1,1", 1), ("GPU-abc,GPU-def", 2), (" 1 ", 1),
])
def test_count_gpus_honours_cuda_visible_devices(visible: str, count: int, tmp_path) -> None:
    proc = tmp_path / "gpus"
    proc.mkdir()
    (proc / "0000:01:00.0").mkdir()   # would say 1 if CUDA_VISIBLE_DEVICES were ignored
    assert count_gpus({"CUDA_VISIBLE_DEVICES": visible}, proc_dir=str(proc), dev_dir=str(tmp_path)) == count


def test_count_gpus_from_proc_then_dev(tmp_path) -> None:
    proc, dev = tmp_path / "gpus", tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia7", "nvidiactl", "nvidia-uvm", "nvidia-caps", "null"):
        (dev / name).touch()
    assert count_gpus({}, proc_dir=str(proc), dev_dir=str(dev)) == 3        # no /proc entry: /dev
    proc.mkdir()
    assert count_gpus({}, proc_dir=str(proc), dev_dir=str(dev)) == 3        # empty /proc dir: /dev
    for bus in ("0000:01:00.0", "0000:41:00.0"):
        (proc / bus).mkdir()
    assert count_gpus({}, proc_dir=str(proc), dev_dir=str(dev)) == 2        # /proc wins
    assert count_gpus({}, proc_dir=str(tmp_path / "no"), dev_dir=str(tmp_path / "no")) == 0


def test_std_specs() -> None:
    o = parse(*EP, "-r", "3", "-t", "0:1,2:2", "t.py")
    assert [o.redirects.for_rank(r) for r in range(3)] == [Std.ALL] * 3
    assert [o.tee.for_rank(r) for r in range(4)] == [Std.OUT, Std.NONE, Std.ERR, Std.NONE]
    o = parse(*EP, "--redirects=0:3", "--tee", "2", "t.py")
    assert o.redirects == StdSpec(per_rank=((0, Std.ALL),))
    assert (o.redirects.for_rank(1), o.tee.for_rank(9)) == (Std.NONE, Std.ERR)


@pytest.mark.parametrize("flag", ["-r", "--redirects", "-t", "--tee"])
@pytest.mark.parametrize("value", ["4", "x", "0:5", "a:1", "0:1,0:2", "0:1,1", "-1:1"])
def test_std_errors_name_the_flag(flag: str, value: str) -> None:
    joined = f"{flag}={value}" if flag.startswith("--") else flag + value   # "-1:1" looks like a flag
    assert error_of(*EP, joined, "t.py").startswith(f"{flag}:")


@pytest.mark.parametrize("value", ["a", "0,x", "-1", "1,,2"])
def test_local_ranks_filter_errors(value: str) -> None:
    assert error_of(*EP, "--local_ranks_filter", value, "t.py").startswith("--local_ranks_filter:")


@pytest.mark.parametrize("text, host, port", [
    ("[::1]:29400", "::1", 29400), ("[fe80::1]:80", "fe80::1", 80), ("[::1]", "::1", 29400),
    ("node7", "node7", 29400), ("10.1.2.3:1", "10.1.2.3", 1), ("h:65535", "h", 65535),
])
def test_endpoint_forms(text: str, host: str, port: int) -> None:
    o = parse("--endpoint", text, "t.py")
    assert (o.endpoint_host, o.endpoint_port) == (host, port)
    assert parse("--endpoint", o.endpoint, "t.py").endpoint == o.endpoint   # round trip, brackets kept


@pytest.mark.parametrize("text", ["h:x", "h:0", "h:65536", "h:", ":80", "::1:80", "[::1", "[::1]80", "[]:1"])
def test_endpoint_errors_use_the_spelling_given(text: str) -> None:
    assert error_of("--rdzv_endpoint", text, "--nnodes", "2", "t.py").startswith("--rdzv_endpoint:")
    assert error_of("--endpoint", text, "t.py").startswith("--endpoint:")   # port 0: ours always names a server


def test_standalone() -> None:
    o = parse("--standalone", "--nproc", "2", "t.py")
    assert o.mode is Mode.STANDALONE and o.endpoint_host is None and (o.job.min_nodes, o.job.max_nodes) == (1, 1)
    uuid.UUID(o.job_id)                               # torchrun's: a fresh run id
    o = parse("--standalone", "--nnodes", "1:4", "--rdzv-endpoint", "h:1", "--rdzv-id", "mine", "t.py")
    assert (o.job.min_nodes, o.job.max_nodes, o.endpoint_host, o.job_id) == (1, 1, None, "mine")
    assert any("--rdzv-endpoint" in w for w in o.warnings) and any("1:4" in w for w in o.warnings)


def test_accepted_torchrun_flags_with_nothing_to_do() -> None:
    o = parse(*EP, "--rdzv-backend", "c10d", "--monitor-interval", "1", "--start_method=fork",
              "--event-log-handler", "null", "t.py")
    assert o.warnings == ()
    assert error_of(*EP, "--start-method", "thread", "t.py").startswith("--start-method: expected spawn")
    assert error_of(*EP, "--monitor-interval", "x", "t.py").startswith("--monitor-interval:")


@pytest.mark.parametrize("argv, flag", [
    (["--max-restarts", "-1"], "--max-restarts"),
    (["--max_restarts", "two"], "--max_restarts"),
    (["--stop-timeout", "-1"], "--stop-timeout"),
    (["--stop-timeout", "nan"], "--stop-timeout"),
    (["--last-call", "soon"], "--last-call"),
    (["--join-timeout", "0"], "--join-timeout"),
    (["--lease-timeout", "inf"], "--lease-timeout"),
    (["--server-wait", "-3"], "--server-wait"),
    (["--node-id", "bad id!"], "--node-id"),
    (["--job-id", ""], "--job-id"),
    (["--rdzv_id", "has space"], "--rdzv_id"),
    (["--rdzv-id", "x" * 513], "--rdzv-id"),
    (["--lease_timeout", "0"], "--lease_timeout"),
    (["--last-call", "-1"], "--last-call"),
    (["--last-call", "1e9"], "--last-call"),          # over JobConfig's bound (a week)
    (["--exclude-after", "1001"], "--exclude-after"),
    (["--exclude-window", "0"], "--exclude-window"),
    (["--hang-timeout", "inf"], "--hang-timeout"),
    (["--hang-detection", "maybe"], "--hang-detection"),
    (["--hang-alone-timeout", "-1"], "--hang-alone-timeout"),
    (["--hang-alone-timeout", "ten"], "--hang-alone-timeout"),
    (["--hang_alone_timeout", "nan"], "--hang_alone_timeout"),
    (["--nnodes", "1:100001"], "--nnodes"),           # over JobConfig's max_nodes bound
    (["--replicas", "5"], "--replicas"),
    (["--replicas", "-1"], "--replicas"),
    (["--failure-domain", ""], "--failure-domain"),
    (["--failure-domain", "a\tb"], "--failure-domain"),
    (["--replica-bandwidth", "fast"], "--replica-bandwidth"),
])
def test_value_errors_name_the_flag(argv: list[str], flag: str) -> None:
    assert error_of(*EP, *argv, "t.py").startswith(f"{flag}:")


def test_id_errors_use_the_protocols_words() -> None:
    # The same rule and wording the server applies, so a bad id is refused before connecting.
    assert error_of(*EP, "--job-id", "a b", "t.py") == f"--job-id: {job_id_problem('a b')}"
    assert error_of(*EP, "--node-id=.n", "t.py") == f"--node-id: {node_id_problem('.n')}"


def test_job_setting_bounds_are_named_with_the_value_given() -> None:
    assert error_of(*EP, "--max-restarts", "-1", "t.py") == "--max-restarts: must be >= 0, got '-1'"
    assert error_of(*EP, "--join-timeout", "0", "t.py") == "--join-timeout: must be > 0.0, got '0'"


def test_help_shows_jobconfigs_defaults() -> None:
    text = " ".join(build_argparser().format_help().split())
    defaults = JobConfig()
    assert f"before the job fails; default {defaults.max_restarts}" in text
    assert f"once it has MIN; default {defaults.last_call_s:g}" in text
    assert f"(job-wide); 0 never; default {defaults.exclude_after}" in text
    assert f"drops a node; default {defaults.lease_timeout_s:g}" in text


def test_module_and_no_python_conflict() -> None:
    message = error_of(*EP, "-m", "--no-python", "t.py")
    assert "--no-python" in message and "-m" in message


@pytest.mark.parametrize("argv, needle", [
    (["--bogus", "t.py"], "--bogus"),
    (["--s", "t.py"], "ambiguous option: --s could match"),
    (["--nproc"], "--nproc"),                        # value missing
    ([], "script"),
    (["--nproc", "2"], "script"),
])
def test_argparse_errors_become_options_errors(argv: list[str], needle: str) -> None:
    assert needle in error_of(*EP, *argv)


def test_help_is_readable() -> None:
    text = build_argparser().format_help()
    for flag in ("--endpoint, --rdzv-endpoint, --rdzv_endpoint [https://]HOST:PORT", "--nproc-per-node",
                 "-j, --j [MIN:]NxM", "--local-ranks-filter", "--no-python", "--standalone"):
        assert flag in text
    with pytest.raises(SystemExit) as info:
        parse("--help")
    assert info.value.code == 0


def test_the_failure_domain_is_the_flags_else_slurms_switch_else_none() -> None:
    slurm = {**NO_GPU, "SLURM_TOPOLOGY_ADDR": "spine1.leaf3.node17"}
    assert parse(*EP, "t.py", environ=slurm).failure_domain == "spine1.leaf3"
    assert parse(*EP, "--failure-domain", "rack-2", "t.py", environ=slurm).failure_domain == "rack-2"
    assert parse(*EP, "t.py", environ=NO_GPU).failure_domain == ""     # the server takes the host


def test_peer_copy_tls_needs_a_certificate_and_key_that_exist_and_a_ca(tmp_path) -> None:
    cert, key, ca = (tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem")
    for f in (cert, key, ca):
        f.write_text("x")
    assert error_of(*EP, "--tls-cert", str(cert), "t.py") == "--tls-cert: needs --tls-key too"
    assert error_of(*EP, "--tls-key", str(key), "t.py") == "--tls-key: needs --tls-cert too"
    assert error_of(*EP, "--tls-cert", str(cert), "--tls-key", str(tmp_path / "no.pem"), "--tls-ca", str(ca),
                    "t.py") == f"--tls-key: no such file: {tmp_path / 'no.pem'}"
    no_ca = error_of(*EP, "--tls-cert", str(cert), "--tls-key", str(key), "t.py")
    assert no_ca.startswith("--tls-cert: needs --tls-ca")
    o = parse(*EP, "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca), "t.py")
    assert (o.tls_cert, o.tls_key) == (str(cert), str(key))


@pytest.mark.parametrize("argv, hosts", [
    (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400"], True),
    (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"], True),
    (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "rdzv.example:29400"], False),   # elsewhere
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400"], False),      # two nodes
    (["--nnodes", "1", "--endpoint", "localhost:29400"], False),              # --endpoint always means a server
    (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "https://localhost:29400"], False),   # TLS
    (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400", "--rdzv-conf", "is_host=0"],
     False),
    (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{socket.gethostname().upper()}:29400"], True),
])
def test_one_node_at_an_endpoint_on_this_host_may_run_in_process_as_torchrun_hosts_it(argv, hosts) -> None:
    o = parse(*argv, "t.py")
    assert o.mode.value == "server" and o.host_if_unserved is hosts
