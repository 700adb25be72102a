"""`node-agent` itself: bad input ends it with one line and exit status 2, before anything connects."""
from __future__ import annotations

import pytest

from node_agent import main as cli
from protocol.ids import job_id_problem, node_id_problem


@pytest.mark.parametrize("argv, line", [
    (["--job-id", "no spaces", "t.py"], f"node-agent: error: --job-id: {job_id_problem('no spaces')}"),
    (["--rdzv_id=a%b", "t.py"], f"node-agent: error: --rdzv_id: {job_id_problem('a%b')}"),
    (["--node-id", "x" * 129, "t.py"], f"node-agent: error: --node-id: {node_id_problem('x' * 129)}"),
    (["--max-restarts", "-2", "t.py"], "node-agent: error: --max-restarts: must be >= 0, got '-2'"),
])
def test_bad_input_is_one_line_and_exit_2_without_connecting(argv: list[str], line: str, capsys,
                                                              monkeypatch) -> None:
    def no_connecting(*args: object) -> None:
        raise AssertionError("the agent connected despite bad input")

    monkeypatch.setattr(cli, "_run", no_connecting)
    assert cli.main(["--endpoint", "127.0.0.1:1", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line] and captured.out == ""


@pytest.mark.parametrize("under, says", [
    ("", "is a file, not a directory"),          # mkdir's own words were "File exists"
    ("sub", "a part of the path is a file, not a directory"),
])
def test_a_log_dir_that_is_a_file_is_named_as_one(under: str, says: str, tmp_path, capsys, monkeypatch) -> None:
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    in_the_way = tmp_path / "logs"
    in_the_way.write_text("")
    log_dir = str(in_the_way / under) if under else str(in_the_way)

    def no_connecting(*args: object) -> None:
        raise AssertionError("the agent started despite a bad --log-dir")

    monkeypatch.setattr(cli, "_run", no_connecting)
    assert cli.main(["--endpoint", "127.0.0.1:1", "--log-dir", log_dir, str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"node-agent: error: --log-dir {log_dir}: {says}"]
