"""Building a round's worker launches from the server's assignment and the agent's options."""
from __future__ import annotations

import os

from node_agent.launch import attempt_dir, build_launches
from node_agent.option_values import Std
from node_agent.options import parse_options
from protocol.messages import Assignment

# Node 1 of 2, 3 workers each: global ranks 3..5 of 6.
SECOND_NODE = Assignment(round_id=4, group_rank=1, group_world_size=2, rank_offset=3, world_size=6,
                         local_world_size=3, master_addr="10.0.0.1", master_port=29501, restart_count=1,
                         max_restarts=2)
ENV = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}


def options(*flags: str):
    return parse_options(["--standalone", "--job-id", "j1", "--node-id", "n1", *flags, "train.py", "--lr", "1"],
                         environ=ENV)


def test_one_launch_per_local_rank_with_its_global_rank_env_and_error_file(tmp_path) -> None:
    launches = build_launches(SECOND_NODE, options(), files_root=str(tmp_path), hostname="h7", environ=ENV)
    base = attempt_dir(str(tmp_path), "j1", "n1", 4)
    assert base == str(tmp_path / "j1" / "n1" / "attempt_4")
    assert [(w.local_rank, w.rank, w.prefix) for w in launches] == [(0, 3, "[h7:3]"), (1, 4, "[h7:4]"),
                                                                     (2, 5, "[h7:5]")]
    for w in launches:
        assert w.argv[-3:] == ["train.py", "--lr", "1"] and w.env["PATH"] == "/bin"
        assert (w.env["RANK"], w.env["LOCAL_RANK"], w.env["GROUP_RANK"]) == (str(w.rank), str(w.local_rank), "1")
        assert w.error_file == os.path.join(base, str(w.local_rank), "error.json")
        assert os.path.isdir(os.path.dirname(w.error_file))       # made, for the worker to write into
        assert w.log_dir is None and w.echo and not w.heartbeat     # no --log-dir: console only


def test_log_dir_streams_filter_and_heartbeat_follow_the_flags(tmp_path) -> None:
    opts = options("--log-dir", str(tmp_path), "-r", "0:3", "-t", "2", "--local-ranks-filter", "1",
                   "--hang-timeout", "5")
    launches = build_launches(SECOND_NODE, opts, files_root=str(tmp_path), hostname="h7", environ=ENV)
    assert [w.log_dir for w in launches] == [os.path.join(attempt_dir(str(tmp_path), "j1", "n1", 4), str(r))
                                             for r in range(3)]
    assert [(w.redirect, w.tee, w.echo) for w in launches] == [
        (Std.ALL, Std.ERR, False), (Std.NONE, Std.ERR, True), (Std.NONE, Std.ERR, False)]
    assert all(w.heartbeat for w in launches)
