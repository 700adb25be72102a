"""Reading the error file torch's @record writes (and the other shapes found in the wild)."""
from __future__ import annotations

import json
import os

from node_agent.error_file import read_error_file


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
