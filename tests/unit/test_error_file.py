"""Reading the error file torch's @record writes (and the other shapes found in the wild)."""
from __future__ import annotations

import json
import os

from node_agent.core.actions import Exit
from node_agent.narration import reply_of
from node_agent.workers.error_file import read_error_file, write_reply_file
from protocol.messages import WorkerFailure


def test_read_error_file_variants(tmp_path) -> None:
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"message": "RuntimeError: plain"}))
    message, traceback, timestamp = read_error_file(str(plain)) or ("", "", 0.0)
    assert (message, traceback) == ("RuntimeError: plain", "") and timestamp == os.path.getmtime(plain)

    no_time = tmp_path / "no_time.json"
    no_time.write_text(json.dumps({"message": {"message": "E: x", "extraInfo": {"py_callstack": "tb"}}}))
    assert read_error_file(str(no_time)) == ("E: x", "tb", os.path.getmtime(no_time))

    for name, content in (("bad.json", "{not json"), ("empty.json", ""), ("other.json", '{"x": 1}'),
                          ("list.json", "[1, 2]"), ("num.json", '{"message": 5}')):
        (tmp_path / name).write_text(content)
        assert read_error_file(str(tmp_path / name)) is None, name
    assert read_error_file(str(tmp_path / "missing.json")) is None


def test_the_agents_reply_file_has_torchs_shape_for_a_failed_job_and_for_any_other_end(tmp_path) -> None:
    rc = WorkerFailure(local_rank=1, rank=3, exitcode=7, message="RuntimeError: boom", traceback="Traceback ...",
                       timestamp=1700000000.5, host="h2", node_id="n2")
    path = tmp_path / "reply.json"
    write_reply_file(str(path), *reply_of(Exit(1, "job j failed: ...", rc), 1))
    # what torch's launcher writes when it copies its first failed worker's error file
    assert json.loads(path.read_text()) == {"message": {
        "message": "RuntimeError: boom", "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"},
        "errorCode": 7}}
    assert read_error_file(str(path)) == ("RuntimeError: boom", "Traceback ...", 1700000000.0)

    silent = WorkerFailure(local_rank=0, rank=0, exitcode=-9, signal="SIGKILL", host="h1")   # no error file
    write_reply_file(str(path), *reply_of(Exit(1, "...", silent), 1))
    assert json.loads(path.read_text())["message"]["message"] == \
        "worker rank 0 (local 0) on h1 failed with signal SIGKILL"
    write_reply_file(str(path), *reply_of(Exit(143, "node-agent stopped by SIGTERM"), 143))
    body = json.loads(path.read_text())["message"]
    assert body["message"] == "node-agent stopped by SIGTERM" and "errorCode" not in body
    assert list(tmp_path.iterdir()) == [path]             # written whole: no temporary file left


def test_a_reply_file_that_cannot_be_written_is_said_once_and_changes_nothing(tmp_path, capsys) -> None:
    write_reply_file(str(tmp_path / "no" / "such" / "dir.json"), "m", "", 0.0, None)
    err = capsys.readouterr().err
    assert err.startswith("node-agent: cannot write the error file ") and err.count("\n") == 1
