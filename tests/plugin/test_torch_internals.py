"""The plugin's reaches into torch's private parts (node_agent/plugin/torch_internals.py) still find what
they read in the installed torch: each test names the piece that moved, instead of failure reports
silently losing which rank failed."""
from __future__ import annotations

import inspect
import sys
from datetime import timedelta

import torch
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from node_agent.plugin import torch_internals as ti


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


def test_torchruns_own_parser_reads_the_flags_torch_does_not_pass_on():
    args = ti.torchrun_args(["--nproc-per-node", "3", "--max-restarts", "2", "--role", "trainer",
                             "--rdzv-backend", "rdzv-server", "--rdzv-id", "j1", "train.py"])
    assert args == ti.TorchrunArgs(rdzv_backend="rdzv-server", rdzv_id="j1", local_world_size=3, max_restarts=2,
                                   role="trainer")
    assert ti.torchrun_args(["--nproc-per-node", "not-a-count", "x.py"]) is None


def test_a_stores_timeout_is_readable(tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    store.set_timeout(timedelta(seconds=7))
    assert ti.store_timeout(store).total_seconds() == 7


def test_the_store_types_are_the_ones_torch_distributed_exports():
    dist = sys.modules["torch.distributed"]
    assert (ti.Store, ti.TCPStore, ti.PrefixStore) == (dist.Store, dist.TCPStore, dist.PrefixStore)
