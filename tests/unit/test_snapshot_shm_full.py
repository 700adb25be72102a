"""/dev/shm that holds one snapshot (ENOSPC beside the one the keep rule kept): the last one makes room, said once,
rather than stay the only snapshot the rank ever holds (capture.Capture._alone)."""
from __future__ import annotations

import errno
import os

import torch

from node_agent.training import layout, snapshot
from node_agent.training.capture import Capture


def test_a_file_system_that_holds_one_snapshot_keeps_the_newest(memory, monkeypatch, capsys) -> None:
    real = os.posix_fallocate

    def one_only(fd: int, offset: int, size: int) -> None:      # room for one snapshot file, none beside it
        if snapshot.steps(memory):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", one_only)
    capture = Capture(memory, keep=2)
    for step in (1, 2, 3):
        capture.take(step, {"w": torch.full((300, 7), float(step))})
        capture.wait()
        assert snapshot.steps() == [step]
        back = layout.read(snapshot.path(step), step)
        assert not isinstance(back, str) and torch.equal(back["w"], torch.full((300, 7), float(step)))
    err = capsys.readouterr().err
    assert err.count("makes room before the next is written") == 1 and "does not fit" not in err
