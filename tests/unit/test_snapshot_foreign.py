"""Names in a memory directory that look like a snapshot's but are no file of ours (snapshot.steps, foreign): a
symlink, a directory, a step past what the agent may report. Ignored with one line: never read, written through,
removed, or reported."""
from __future__ import annotations

import os

import pytest
import torch

from node_agent.training import layout, resume, snapshot
from node_agent.training.capture import Capture


@pytest.fixture(autouse=True)
def said_afresh(monkeypatch) -> None:
    monkeypatch.setattr(snapshot, "_said", set())       # said once per process: once per test here


def take(capture: Capture, step: int) -> None:
    capture.take(step, {"w": torch.full((300, 7), float(step))})
    capture.wait()


def test_a_symlink_named_as_a_snapshot_is_never_written_through(memory, tmp_path, capsys) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours\n")
    before = Capture(memory)                    # a predecessor's files: written over in place by the next worker
    take(before, 2)
    take(before, 3)
    before._keep_slabs(lambda _: False)
    os.symlink(victim, snapshot.path(1))
    assert snapshot.steps() == [2, 3]
    assert snapshot.agreed_step(lambda x: x) == 3
    after = Capture(memory)
    take(after, 4)                              # drops steps 1 and 2: the link's target must not be the new file
    assert victim.read_bytes() == b"not yours\n"
    assert os.path.islink(snapshot.path(1)) and snapshot.steps() == [3, 4]
    back = layout.read(snapshot.path(4), 4)
    assert not isinstance(back, str) and torch.equal(back["w"], torch.full((300, 7), 4.0))
    assert capsys.readouterr().err.count("'step-1'") == 1


def test_directories_named_as_a_snapshot_or_a_write_are_ignored_with_one_line(memory, capsys) -> None:
    os.mkdir(snapshot.path(9))
    os.mkdir(snapshot.path(3) + ".tmp")
    snapshot.save(b"x" * 100, 2)
    assert snapshot.agreed_step(lambda x: x) == 2
    assert snapshot.steps() == [2] and snapshot.unfinished(memory) == []
    assert os.path.isdir(snapshot.path(9)) and os.path.isdir(snapshot.path(3) + ".tmp")
    err = capsys.readouterr().err
    assert "'step-3.tmp', 'step-9'" in err and "Traceback" not in err


def test_a_step_past_what_the_agent_may_report_is_no_snapshot(memory) -> None:
    huge = 2**53 + 1                    # past protocol.bounds.MAX_ROUND: the server refused the agent's polls
    snapshot.save(b"x" * 100, 5)
    with open(snapshot.path(huge), "wb") as f:
        f.write(b"x" * 100)
    assert snapshot.newest() == 5 and snapshot.steps() == [5]
    assert snapshot.foreign(memory) == [f"step-{huge}"]


def test_a_lent_file_is_never_written_through_a_symlink_named_as_its_write(memory, tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours\n")
    os.symlink(victim, snapshot.path(7) + ".tmp")
    lent = resume._Lent(7, memory)
    lent.write(memoryview(b"lent bytes"))
    assert lent.done()
    assert victim.read_bytes() == b"not yours\n"
    with open(snapshot.path(7), "rb") as f:
        assert f.read() == b"lent bytes"


def test_a_save_never_writes_through_a_symlink_named_as_its_write(memory, tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours\n")
    os.symlink(victim, snapshot.path(7) + ".tmp")
    snapshot.save(b"saved", 7)
    assert victim.read_bytes() == b"not yours\n"
    with open(snapshot.path(7), "rb") as f:
        assert f.read() == b"saved"
