"""The hold after a snapshot (node_agent/training/snapshot.py: hold_after): while the agent's mark is in the
memory directory, a rank that completed a snapshot says so and waits until the mark goes, at most HOLD_MAX_S;
without the mark it does not wait at all. The agent's side sets and clears the mark in every local rank's
directory (MemoryDirs.hold)."""
from __future__ import annotations

import os
import threading

from node_agent.training import heartbeat, snapshot
from node_agent.workers.memory import MemoryDirs


def test_a_rank_waits_after_its_snapshot_while_the_mark_is_there_and_goes_on_once_it_goes(memory, monkeypatch) -> None:
    said: list[tuple[str, int]] = []
    held = threading.Event()
    monkeypatch.setattr(heartbeat, "held", lambda step: (said.append(("held", step)), held.set()))
    mark = os.path.join(memory, snapshot.HOLD)
    open(mark, "w").close()
    saver = threading.Thread(target=snapshot.save, args=(b"state", 15))
    saver.start()
    assert held.wait(10), "the rank never said it holds"
    assert saver.is_alive() and os.path.exists(snapshot.path(15, memory))    # complete, and waiting after it
    os.remove(mark)
    saver.join(10)
    assert not saver.is_alive() and said == [("held", 15)]


def test_no_mark_no_wait_and_a_hold_nobody_ends_ends_by_itself(memory, monkeypatch, capsys) -> None:
    said: list[int] = []
    monkeypatch.setattr(heartbeat, "held", said.append)
    snapshot.save(b"state", 5)
    assert said == []
    open(os.path.join(memory, snapshot.HOLD), "w").close()
    monkeypatch.setattr(snapshot, "HOLD_MAX_S", 0.05)
    order: list[str] = []
    snapshot.hold_after(10, memory, lambda: order.append("written"))
    assert order == ["written"] and said == [10]
    assert "held after the snapshot of step 10 for 0.05s and no swap came: training goes on" in capsys.readouterr().out


def test_the_agent_sets_and_clears_the_mark_in_every_local_ranks_directory(tmp_path) -> None:
    dirs = MemoryDirs("job", 2, None, say=print, base=str(tmp_path), node_id="n")
    where = dirs.dirs(2)
    dirs.hold(True)
    assert all(os.path.exists(os.path.join(d, snapshot.HOLD)) for d in where.values())
    dirs.hold(False)
    dirs.hold(False)            # cleared twice: nothing to say
    assert not any(os.path.exists(os.path.join(d, snapshot.HOLD)) for d in where.values())
    dirs.close()


def test_the_agent_names_the_step_to_keep_from_in_every_local_ranks_directory(tmp_path) -> None:
    said: list[str] = []
    memory = MemoryDirs("job", 2, 2**20, say=said.append, base=str(tmp_path))
    dirs = memory.dirs_for(2, 0)
    memory.keep_from(25)
    assert [snapshot.keep_from(where) for where in dirs.values()] == [25, 25]
    memory.keep_from(30)
    assert [snapshot.keep_from(where) for where in dirs.values()] == [30, 30]
    memory.keep_from(-1)
    memory.keep_from(-1)          # cleared twice: nothing to say
    assert [snapshot.keep_from(where) for where in dirs.values()] == [None, None]
    assert not [line for line in said if "keep" in line], said
    memory.close()


def test_a_rank_reading_the_keep_from_mark_while_it_changes_sees_a_step(tmp_path, monkeypatch) -> None:
    """The mark is renamed into place: a rank never reads it empty (None would let it drop the step kept)."""
    memory = MemoryDirs("job", 1, 2**20, say=lambda s: None, base=str(tmp_path))
    where = memory.dirs_for(1, 0)[0]
    memory.keep_from(25)
    seen = []
    real = os.replace

    def replace(src, dst):               # a rank reads the mark just before the new one takes its place
        seen.append(snapshot.keep_from(where))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    memory.keep_from(30)
    assert seen == [25] and snapshot.keep_from(where) == 30
    memory.close()
