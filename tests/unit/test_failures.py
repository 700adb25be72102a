"""What the agent reports about a failed worker: from an exit (and its error file), a spawn error."""
from __future__ import annotations

import json
import signal

from node_agent.workers.failures import EARLY_EXIT_S, SPAWN_FAILED_EXITCODE, early_exits, exit_failure, spawn_failure
from node_agent.workers.process import WorkerExit
from protocol.bounds import MAX_MESSAGE, MAX_TRACEBACK
from protocol.messages import WorkerFailure


def exited(code: int, error_file: str | None = None) -> WorkerExit:
    return WorkerExit(local_rank=1, rank=5, pid=123, exitcode=code, signal_name="SIGSEGV" if code < 0 else "",
                      error_file=error_file, seen_at=1700000000.5)


def test_an_exit_with_an_error_file_carries_its_message_and_traceback(tmp_path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": "ValueError: boom", "extraInfo": {
        "py_callstack": "Traceback ...\nValueError: boom\n", "timestamp": "1"}}}))
    f = exit_failure(exited(1, str(path)), host="h1", node_id="n1")
    assert (f.local_rank, f.rank, f.exitcode, f.signal, f.reason) == (1, 5, 1, "", "exited")
    assert (f.message, f.traceback) == ("ValueError: boom", "Traceback ...\nValueError: boom\n")
    assert (f.timestamp, f.host, f.node_id) == (1700000000.5, "h1", "n1")   # reaped time, not the file's


def test_a_killed_worker_without_error_file() -> None:
    f = exit_failure(exited(-signal.SIGSEGV), host="h1", node_id="n1")
    assert (f.exitcode, f.signal, f.message, f.traceback) == (-signal.SIGSEGV, "SIGSEGV", "", "")


def test_huge_texts_are_cut_to_the_protocols_bounds_keeping_the_traceback_end(tmp_path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": "M" * 10 * MAX_MESSAGE, "extraInfo": {
        "py_callstack": "T" * 10 * MAX_TRACEBACK + "\nRuntimeError: the end"}}}))
    f = exit_failure(exited(1, str(path)), host="h1", node_id="n1")
    assert len(f.message) == MAX_MESSAGE and f.message.endswith("...")
    assert len(f.traceback) == MAX_TRACEBACK and f.traceback.endswith("RuntimeError: the end")


def test_a_spawn_error() -> None:
    spawn = spawn_failure(FileNotFoundError(2, "No such file or directory"), local_rank=0, rank=3,
                          program="/no/python", host="h1", node_id="n1")
    assert (spawn.rank, spawn.exitcode, spawn.reason) == (3, SPAWN_FAILED_EXITCODE, "spawn failed")
    assert spawn.message == "cannot start '/no/python': No such file or directory"


def peer_failure(message: str = "", sig: str = "") -> WorkerFailure:
    return WorkerFailure(local_rank=1, rank=3, exitcode=-6 if sig else 1, signal=sig, message=message,
                         timestamp=1000.0, host="h", node_id="n")


def left(at: float, code: int = 0) -> WorkerExit:
    return WorkerExit(local_rank=0, rank=2, pid=9, exitcode=code, signal_name="", error_file=None, seen_at=at)


def test_a_rank_that_exited_0_just_before_a_peer_broke_is_the_cause() -> None:
    for message in ("", "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242",
                    "torch.distributed.DistBackendError: NCCL error in: ..."):
        blamed = early_exits([left(999.0)], peer_failure(message), host="h", node_id="n")
        assert [(f.rank, f.reason, f.exitcode, f.timestamp) for f in blamed] == [(2, "exited early", 0, 999.0)]
        assert "rank 3 failed 1.0s later" in blamed[0].message


def test_a_peer_with_an_error_of_its_own_stays_its_own_cause() -> None:
    own = [peer_failure("ValueError: rank 3 gives up"), peer_failure(sig="SIGKILL"), peer_failure(sig="SIGSEGV")]
    for failure in own:
        assert early_exits([left(999.0)], failure, host="h", node_id="n") == []
    assert early_exits([left(999.0)], peer_failure(sig="SIGABRT"), host="h", node_id="n") != []   # NCCL's abort


def test_only_exits_0_shortly_before_the_failure_are_blamed() -> None:
    exits = [left(1000.0 - EARLY_EXIT_S - 1), left(999.0, code=1), left(1000.5)]
    assert early_exits(exits, peer_failure(), host="h", node_id="n") == []
