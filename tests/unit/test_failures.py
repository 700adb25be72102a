"""What the agent reports about a failed worker: from an exit (and its error file), a hang, a spawn error."""
from __future__ import annotations

import json
import signal

from node_agent.workers.failures import SPAWN_FAILED_EXITCODE, exit_failure, hang_failure, spawn_failure
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.process import WorkerExit
from protocol.messages import MAX_MESSAGE, MAX_TRACEBACK


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


def test_a_hang_and_a_spawn_error() -> None:
    launch = WorkerLaunch(local_rank=2, rank=6, argv=["python"], env={}, log_dir=None)
    hang = hang_failure(launch, silent_s=7.25, hang_timeout_s=5, host="h1", node_id="n1")
    assert (hang.local_rank, hang.rank, hang.reason, hang.signal, hang.exitcode) == \
        (2, 6, "hang", "SIGTERM", -signal.SIGTERM)
    assert hang.message == "no heartbeat for 7.2s (hang timeout 5s); stopped"
    spawn = spawn_failure(FileNotFoundError(2, "No such file or directory"), local_rank=0, rank=3,
                          program="/no/python", host="h1", node_id="n1")
    assert (spawn.rank, spawn.exitcode, spawn.reason) == (3, SPAWN_FAILED_EXITCODE, "spawn failed")
    assert spawn.message == "cannot start '/no/python': No such file or directory"
