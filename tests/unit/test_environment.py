"""A worker's environment and command line, as torchrun would give them."""
from __future__ import annotations

import sys

import pytest

from node_agent.cli.options import parse_options
from node_agent.workers.environment import worker_argv, worker_env
from node_agent.workers.launch import build_launches
from protocol.messages import Assignment

# Node 1 of 2, 4 workers each: global ranks 4..7 of 8.
SECOND_NODE = Assignment(round_id=3, group_rank=1, group_world_size=2, rank_offset=4, world_size=8,
                         local_world_size=4, master_addr="10.0.0.1", master_port=29501,
                         restart_count=2, max_restarts=5)


def env_for(local_rank: int = 2, *, base: dict[str, str] | None = None, assignment: Assignment = SECOND_NODE,
            error_file: str | None = "/logs/2/error.json", **kw: str | None) -> dict[str, str]:
    return worker_env(base={"PATH": "/bin"} if base is None else base, assignment=assignment,
                      local_rank=local_rank, job_id="job-9", role="trainer", error_file=error_file, **kw)


def test_every_variable_for_a_two_node_assignment() -> None:
    assert env_for(2) == {
        "PATH": "/bin",
        "RANK": "6",
        "LOCAL_RANK": "2",
        "GROUP_RANK": "1",
        "ROLE_RANK": "2",          # role offset 0: ROLE_RANK follows the local rank
        "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "4",
        "WORLD_SIZE": "8",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "8",    # 0 on the wire: the whole world has one role
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29501",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "job-9",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",    # torchrun's default
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_ERROR_FILE": "/logs/2/error.json",
        "OMP_NUM_THREADS": "1",
        "NODE_AGENT_MEMORY_DIR": "",       # none given: empty (protect asks every rank whether it has one)
    }


def test_role_offsets_and_sizes() -> None:
    a = Assignment(round_id=0, group_rank=0, group_world_size=1, rank_offset=0, world_size=2,
                   local_world_size=2, master_addr="m", master_port=1, restart_count=0, max_restarts=0,
                   role_rank_offset=6, role_world_size=10)
    env = env_for(1, assignment=a)
    assert (env["RANK"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == ("1", "7", "10")


def test_launcher_values_override_the_base_and_the_rest_is_kept() -> None:
    base = {"RANK": "99", "WORLD_SIZE": "1", "MY_SETTING": "x", "TORCHELASTIC_ERROR_FILE": "/parent.json"}
    env = env_for(0, base=base)
    assert (env["RANK"], env["WORLD_SIZE"], env["MY_SETTING"]) == ("4", "8", "x")
    assert env["TORCHELASTIC_ERROR_FILE"] == "/logs/2/error.json"
    assert base["RANK"] == "99"   # the base is not modified


def test_no_error_file_drops_an_inherited_one() -> None:
    env = env_for(0, base={"TORCHELASTIC_ERROR_FILE": "/parent.json"}, error_file=None)
    assert "TORCHELASTIC_ERROR_FILE" not in env


def test_omp_num_threads_rule() -> None:
    assert env_for(0)["OMP_NUM_THREADS"] == "1"                                  # unset, 4 local workers
    assert env_for(0, base={"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"   # the user's value wins
    single = Assignment(round_id=0, group_rank=0, group_world_size=1, rank_offset=0, world_size=1,
                        local_world_size=1, master_addr="m", master_port=1, restart_count=0, max_restarts=0)
    assert "OMP_NUM_THREADS" not in env_for(0, assignment=single)


def test_nccl_async_error_handling() -> None:
    assert env_for(0)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env_for(0, base={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env_for(0, base={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
                   nccl_async="0")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_the_agents_token_does_not_reach_the_workers() -> None:
    base = {"PATH": "/bin", "RDZV_TOKEN": "secret-token-0123456789", "RDZV_TOKEN_FILE": "/run/secrets/token",
            "RDZV_ADMIN_TOKEN_FILE": "/run/secrets/admin", "RDZV_SERVER": "http://h:29400"}
    env = env_for(0, base=base)
    assert not {"RDZV_TOKEN", "RDZV_TOKEN_FILE", "RDZV_ADMIN_TOKEN_FILE"} & set(env)
    assert env["RDZV_SERVER"] == "http://h:29400" and base["RDZV_TOKEN"] == "secret-token-0123456789"


def test_the_agents_token_does_not_reach_workers_it_launches(tmp_path) -> None:
    environ = {"PATH": "/bin", "RDZV_TOKEN": "secret-token-0123456789"}
    options = parse_options(["--endpoint", "h", "train.py"], environ)
    assert options.link.token == "secret-token-0123456789"                 # the agent itself uses it
    launches = build_launches(SECOND_NODE, options.workers, run_dir=str(tmp_path), hostname="h",
                              environ=environ)
    assert [launch.env.get("RDZV_TOKEN") for launch in launches] == [None] * 4


def test_signals_to_handle_are_exported_in_torchruns_form(tmp_path) -> None:
    environ = {"PATH": "/bin"}
    for flag, exported in (("SIGTERM,SIGUSR1", "SIGTERM,SIGUSR1"), ("term, usr2", "SIGTERM,SIGUSR2")):
        options = parse_options(["--signals-to-handle", flag, "--standalone", "train.py"], environ)
        launches = build_launches(SECOND_NODE, options.workers, run_dir=str(tmp_path), hostname="h",
                                  environ=environ)
        assert {launch.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] for launch in launches} == {exported}


def test_local_rank_out_of_range() -> None:
    with pytest.raises(ValueError):
        env_for(4)


def opts(*argv: str):
    return parse_options(["--standalone", *argv], environ={}).workers


def test_worker_argv_forms() -> None:
    assert worker_argv(opts("train.py", "--lr", "1"), environ={}) == [sys.executable, "-u", "train.py", "--lr", "1"]
    assert worker_argv(opts("-m", "pkg.main", "a"), environ={}) == [sys.executable, "-u", "-m", "pkg.main", "a"]
    assert worker_argv(opts("--no-python", "./run.sh", "a"), environ={"PYTHON_EXEC": "/x/py"}) == ["./run.sh", "a"]


def test_python_exec_is_honoured() -> None:
    environ = {"PYTHON_EXEC": "/opt/py/bin/python3"}
    assert worker_argv(opts("train.py"), environ=environ) == ["/opt/py/bin/python3", "-u", "train.py"]
    assert worker_argv(opts("-m", "m"), environ=environ)[:4] == ["/opt/py/bin/python3", "-u", "-m", "m"]
