"""The plugin's reaches into torch's private parts (node_agent/plugin/torch_internals.py) still find what
they read in the installed torch: each test names the piece that moved, instead of failure reports
silently losing which rank failed."""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from datetime import timedelta

import torch
from torch.distributed import run
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher import api as launcher_api

from node_agent.plugin import torch_internals as ti
from node_agent.plugin.settings import TorchLaunch


def test_the_run_loop_and_its_result_are_where_the_plugin_looks():
    loop = getattr(agent_api.SimpleElasticAgent, ti.RUN_LOOP, None)
    assert loop is not None, f"torch {torch.__version__}: SimpleElasticAgent.{ti.RUN_LOOP} is gone"
    assert ti.RUN_RESULT in loop.__code__.co_varnames, (
        f"torch {torch.__version__}: {ti.RUN_LOOP} has no local {ti.RUN_RESULT!r}; its locals: "
        f"{loop.__code__.co_varnames}")
    rendezvous = inspect.unwrap(agent_api.SimpleElasticAgent._rendezvous)     # under torch's metrics decorator
    assert "next_rendezvous" in rendezvous.__code__.co_names, (
        f"torch {torch.__version__}: the agent no longer calls next_rendezvous from _rendezvous")


def test_failures_are_read_from_the_run_loop_frame_as_torch_keeps_them(tmp_path):
    failure = ProcessFailure(local_rank=1, pid=12, exitcode=3, error_file=str(tmp_path / "none"))

    def _invoke_run() -> dict[int, object] | None:    # the run loop's name and local, as torch has them
        run_result = agent_api.RunResult(state=agent_api.WorkerState.FAILED, failures={5: failure})
        assert run_result.failures
        return ti.run_loop_failures(None)

    assert _invoke_run.__name__ == ti.RUN_LOOP
    assert _invoke_run() == {5: failure}
    assert ti.run_loop_failures(None) is None                      # no run loop below us: nothing
    assert ti.run_loop_failures(ChildFailedError("train", {5: failure})) == {5: failure}


def test_a_process_failure_has_what_the_report_reads(tmp_path):
    f = ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file=str(tmp_path / "none"))
    for name in ("message", "exitcode", "local_rank", "timestamp"):
        assert hasattr(f, name), f"torch {torch.__version__}: ProcessFailure has no {name!r}"
    assert f.signal_name() == "SIGKILL"


def test_the_exit_barrier_key_is_torchs():
    assert getattr(agent_api, "_TERMINAL_STATE_SYNC_ID", None) == ti.EXIT_BARRIER, (
        f"torch {torch.__version__}: the exit barrier's key moved")


def test_torchs_launch_configuration_is_read_where_the_handler_is_made(tmp_path):
    """torch's launcher makes the handler inside launch_agent, whose locals hold its LaunchConfig and what
    each worker runs: read from there whoever called the launcher (torchrun, accelerate, elastic_launch)."""
    source = inspect.getsource(launcher_api.launch_agent)
    code = launcher_api.launch_agent.__code__
    assert code.co_name == ti.LAUNCH_AGENT, f"torch {torch.__version__}: launch_agent was renamed"
    assert all(name in code.co_varnames for name in ti.LAUNCH_LOCALS), (
        f"torch {torch.__version__}: launch_agent's locals are {code.co_varnames}, not {ti.LAUNCH_LOCALS}")
    assert "get_rendezvous_handler" in source, f"torch {torch.__version__}: launch_agent no longer makes the handler"
    for field in ("nproc_per_node", "max_restarts", "role"):
        assert field in {f.name for f in dataclasses.fields(launcher_api.LaunchConfig)}, (
            f"torch {torch.__version__}: LaunchConfig has no {field!r}")
    assert run.run_script_path.__qualname__ == ti.RUN_PATH

    def launch_agent(config, entrypoint, args):   # the launcher's frame, as torch has it
        return ti.launch_settings()

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    config = launcher_api.LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=3, max_restarts=2, role="trainer",
                                       logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    assert launch_agent(config, python, ["-u", "train.py", "--lr", "1"]) == TorchLaunch(
        local_world_size=3, max_restarts=2, role="trainer", kind="python", script="train.py", script_args=("--lr", "1"))
    assert launch_agent(config, python, ["-u", "-m", "pkg.train"]).kind == "module"
    assert launch_agent(config, "/bin/run.sh", ["a"]).kind == "program"
    assert launch_agent(config, run.run_script_path, ["t.py"]).kind == "run-path"
    assert launch_agent(object(), python, []) is None            # not torch's LaunchConfig: never guessed
    assert ti.launch_settings() is None                           # no launcher below us


def test_a_stores_timeout_is_readable(tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    store.set_timeout(timedelta(seconds=7))
    assert ti.store_timeout(store).total_seconds() == 7


def test_the_store_types_are_the_ones_torch_distributed_exports():
    dist = sys.modules["torch.distributed"]
    assert (ti.Store, ti.TCPStore, ti.PrefixStore) == (dist.Store, dist.TCPStore, dist.PrefixStore)
