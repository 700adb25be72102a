"""Building a round's worker launches from the server's assignment and the agent's options."""
from __future__ import annotations

import os

from node_agent.cli.options import parse_options
from node_agent.settings import Std
from node_agent.training import probe
from node_agent.training.probe import ENV as PROBE_ENV
from node_agent.workers.launch import attempt_dir, build_launches, make_run_dir
from node_agent.workers.probes import ProbeRoot
from protocol.messages import Assignment

# Node 1 of 2, 3 workers each: global ranks 3..5 of 6.
SECOND_NODE = Assignment(round_id=4, group_rank=1, group_world_size=2, rank_offset=3, world_size=6,
                         local_world_size=3, master_addr="10.0.0.1", master_port=29501, restart_count=1,
                         max_restarts=2)
ENV = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}


def options(*flags: str, environ: dict[str, str] = ENV):
    return parse_options(["--standalone", "--job-id", "j1", "--node-id", "n1", *flags, "train.py", "--lr", "1",
                          "--out=o${local_rank}", "$${local_rank}"], environ=environ).workers


def test_one_launch_per_local_rank_with_its_global_rank_env_and_error_file(tmp_path) -> None:
    probes = ProbeRoot()
    launches = build_launches(SECOND_NODE, options(), run_dir=str(tmp_path), hostname="h7", environ=ENV,
                              probes=probes)
    base = attempt_dir(str(tmp_path), 1)
    assert base == str(tmp_path / "attempt_1")      # torchrun's: attempt_RESTART_COUNT
    # torchrun's tee prefix, [ROLE LOCAL_RANK]:, for tee'd streams only
    assert [(w.local_rank, w.rank, w.prefix, w.prefix_all) for w in launches] == [
        (0, 3, "[default0]:", False), (1, 4, "[default1]:", False), (2, 5, "[default2]:", False)]
    for w in launches:
        # torchrun's ${local_rank} macro ($$ is a literal $, as in string.Template)
        assert w.argv[-5:] == ["train.py", "--lr", "1", f"--out=o{w.local_rank}", "${local_rank}"]
        assert w.env["PATH"] == "/bin"
        assert (w.env["RANK"], w.env["LOCAL_RANK"], w.env["GROUP_RANK"]) == (str(w.rank), str(w.local_rank), "1")
        assert w.log_dir == os.path.join(base, str(w.local_rank)) and w.attempt_dir == base
        assert w.error_file == os.path.join(base, str(w.local_rank), "error.json")
        assert os.path.isdir(os.path.dirname(w.error_file))       # made, for the worker to write into
        assert w.echo and not w.stdin_tty
        assert w.probe is not None and w.env[PROBE_ENV] == w.probe.env()
        assert os.path.getsize(w.probe.record) == probe.SIZE
        assert os.path.dirname(w.probe.record) == probes.root and not w.probe.record.startswith(str(tmp_path))
        assert (w.redirect, w.tee) == (Std.NONE, Std.NONE)       # nothing goes to the files
    assert sorted(os.listdir(probes.root or "")) == [f"{r}.{kind}" for r in range(3) for kind in ("progress", "stacks")
                                                     ] + ["owner"]       # its agent's (workers/owners.py)
    probes.close()
    assert probes.root is None and not any(os.path.exists(w.probe.record) for w in launches if w.probe)


def test_log_dir_streams_and_filter_follow_the_flags(tmp_path) -> None:
    opts = options("--log-dir", str(tmp_path), "-r", "0:3", "-t", "2", "--local-ranks-filter", "1",
                   "--duplicate-stdout-filters", "a,,b,c")
    launches = build_launches(SECOND_NODE, opts, run_dir=str(tmp_path), hostname="h7", environ=ENV)
    assert [(w.redirect, w.tee, w.echo) for w in launches] == [
        (Std.ALL, Std.ERR, False), (Std.NONE, Std.ERR, True), (Std.NONE, Std.ERR, False)]
    assert all(w.dup_stdout == ("a,b", "c") and w.dup_stderr == () for w in launches)


def test_each_filter_given_has_its_filtered_log_in_the_attempt_matched_or_not(tmp_path) -> None:
    # torchrun opens attempt_N/filtered_std{out,err}.log for every filter flag given, even when no line matches
    build_launches(SECOND_NODE, options("--duplicate-stderr-filters", "x"), run_dir=str(tmp_path), hostname="h",
                   environ=ENV)
    base = attempt_dir(str(tmp_path), 1)
    assert sorted(os.listdir(base)) == ["0", "1", "2", "filtered_stderr.log"]
    with open(os.path.join(base, "filtered_stderr.log"), "w") as f:
        f.write("kept\n")
    build_launches(SECOND_NODE, options("--duplicate-stderr-filters", "x", "--duplicate-stdout-filters", "y"),
                   run_dir=str(tmp_path), hostname="h", environ=ENV)     # a new round of the same count
    assert sorted(os.listdir(base)) == ["0", "1", "2", "filtered_stderr.log", "filtered_stdout.log"]
    with open(os.path.join(base, "filtered_stderr.log")) as f:
        assert f.read() == "kept\n"                                     # written on, as the lines are
    build_launches(SECOND_NODE, options(), run_dir=str(tmp_path / "none"), hostname="h", environ=ENV)
    assert sorted(os.listdir(attempt_dir(str(tmp_path / "none"), 1))) == ["0", "1", "2"]


def test_a_no_python_program_gets_no_probe(tmp_path) -> None:
    launches = build_launches(SECOND_NODE, options("--no-python"), run_dir=str(tmp_path), hostname="h", environ=ENV,
                              probes=ProbeRoot())
    assert all(w.probe is None and PROBE_ENV not in w.env for w in launches)


def test_prefix_templates_torchruns_variable_and_ours(tmp_path) -> None:
    env = {**ENV, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}|${rank}|${local_rank}] "}
    teed = build_launches(SECOND_NODE, options("--role", "t", environ=env), run_dir=str(tmp_path), hostname="h7",
                          environ=env)
    assert [(w.prefix, w.prefix_all) for w in teed] == [("[t|3|0] ", False), ("[t|4|1] ", False),
                                                        ("[t|5|2] ", False)]
    ours = build_launches(SECOND_NODE, options("--log-line-prefix", "[${host}:${rank}] ", environ=env),
                          run_dir=str(tmp_path), hostname="h7", environ=env)
    assert [(w.prefix, w.prefix_all) for w in ours] == [("[h7:3] ", True), ("[h7:4] ", True), ("[h7:5] ", True)]


def test_virtual_local_rank_gives_each_worker_one_gpu_as_device_0(tmp_path) -> None:
    env = {**ENV, "CUDA_VISIBLE_DEVICES": "4,5,6"}
    launches = build_launches(SECOND_NODE, options("--virtual-local-rank", environ=env), run_dir=str(tmp_path),
                              hostname="h", environ=env)
    assert [(w.env["LOCAL_RANK"], w.env["CUDA_VISIBLE_DEVICES"], w.env["RANK"]) for w in launches] == [
        ("0", "4", "3"), ("0", "5", "4"), ("0", "6", "5")]
    plain = build_launches(SECOND_NODE, options(environ=env), run_dir=str(tmp_path), hostname="h", environ=env)
    assert [(w.env["LOCAL_RANK"], w.env["CUDA_VISIBLE_DEVICES"]) for w in plain] == [
        ("0", "4,5,6"), ("1", "4,5,6"), ("2", "4,5,6")]


def test_each_run_gets_a_fresh_directory_named_after_the_job(tmp_path) -> None:
    first, second = make_run_dir(str(tmp_path), "team/exp1"), make_run_dir(str(tmp_path), "team/exp1")
    assert first != second and os.path.dirname(first) == str(tmp_path) == os.path.dirname(second)
    assert os.path.basename(first).startswith("team_exp1_")   # one path component, even for ids with /
    assert len(os.path.basename(make_run_dir(str(tmp_path), "x" * 512))) < 255
