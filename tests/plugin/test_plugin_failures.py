"""torch's worker failures -> the plugin's failure report (plugin/failures.py), with torch's own
ProcessFailure and error-file format."""
from __future__ import annotations

import json
import signal
from types import SimpleNamespace

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from node_agent.plugin.failures import worker_failures
from node_agent.plugin.torch_internals import run_loop_failures as agent_failures
from protocol.messages import Assignment

ROUND = Assignment(round_id=3, group_rank=1, group_world_size=2, rank_offset=4, world_size=8, local_world_size=4,
                   master_addr="10.0.0.1", master_port=1, restart_count=0, max_restarts=3)


def test_failures_carry_torchs_exit_code_signal_and_record_message(tmp_path):
    error_file = tmp_path / "error.json"     # what @record writes
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: boom", "extraInfo": {
        "py_callstack": "Traceback (most recent call last): ...", "timestamp": "1700000000"}}}))
    failures = {6: ProcessFailure(local_rank=2, pid=11, exitcode=1, error_file=str(error_file)),
                5: ProcessFailure(local_rank=1, pid=12, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none"))}
    crashed, killed = sorted(worker_failures(failures, ROUND, "host-b"), key=lambda f: f.rank, reverse=True)
    assert (crashed.rank, crashed.local_rank, crashed.exitcode, crashed.message) == (6, 2, 1, "RuntimeError: boom")
    assert crashed.traceback.startswith("Traceback") and crashed.timestamp == 1700000000 and crashed.host == "host-b"
    assert (killed.rank, killed.exitcode, killed.signal) == (5, -9, "SIGKILL")


def test_without_torchs_failures_the_report_says_the_node_failed():
    (only,) = worker_failures(None, ROUND, "host-b")
    assert (only.rank, only.local_rank, only.exitcode) == (4, 0, 1)
    assert "which worker, torch did not say" in only.message


def test_only_a_worker_that_ended_on_its_own_failed_at_start(tmp_path):
    """Its probe said so (at_start), and torch did not stop it (SIGTERM, SIGKILL): a worker torch stopped before its
    process group did not fail; one that crashed by itself (SIGSEGV) did."""
    none = str(tmp_path / "none")
    failures = {4: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=none),
                5: ProcessFailure(local_rank=1, pid=2, exitcode=-signal.SIGTERM, error_file=none),
                6: ProcessFailure(local_rank=2, pid=3, exitcode=-signal.SIGSEGV, error_file=none),
                7: ProcessFailure(local_rank=3, pid=4, exitcode=1, error_file=none)}
    report = worker_failures(failures, ROUND, "host-b", at_start=lambda local_rank: local_rank != 3)
    assert {f.rank: f.before_group for f in report} == {4: True, 5: False, 6: True, 7: False}
    assert not any(f.before_group for f in worker_failures(failures, ROUND, "host-b"))


def test_failures_are_found_on_childfailederror_or_in_torchs_run_loop():
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file="/nonexistent")
    assert agent_failures(ChildFailedError("train.py", {7: failure})) == {7: failure}

    def _invoke_run():   # named as torch's agent loop, holding its result as torch does
        run_result = SimpleNamespace(failures={3: failure})   # noqa: F841 (read through the frame)
        return handler_next_rendezvous()

    def handler_next_rendezvous():
        return agent_failures(None)
    assert _invoke_run() == {3: failure}
    assert agent_failures(None) is None


def test_the_report_names_first_the_failure_torch_names_the_root_cause(tmp_path):
    """torch captures the worker that failed first, then the ones it stopped (SIGTERM), all stamped in whole
    seconds: the report's order within a second is torch's, so the server's root cause is torch's (a review: a
    crashed rank 3 was reported after its node's rank 2, stopped by torch, and the job failed naming rank 2)."""
    def error_file(name: str, message: str) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "Traceback ...", "timestamp": "1700000000"}}}))
        return str(path)
    failures = {7: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=error_file("7.json", "injected")),
                6: ProcessFailure(local_rank=0, pid=12, exitcode=-signal.SIGTERM,
                                  error_file=error_file("6.json", "gloo: Connection closed by peer"))}
    root, _ = ChildFailedError("train.py", failures).get_first_failure()
    report = worker_failures(failures, ROUND, "host-b")
    first = sorted(report, key=lambda f: f.timestamp)[0]     # the server's order (rdzv_server/core/reports.py)
    assert (root, first.rank, first.message) == (7, 7, "injected")
