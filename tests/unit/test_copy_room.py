"""How much a holder takes (node_agent/copies/room.py): pure, from what it holds."""
from __future__ import annotations

from node_agent.copies import room
from node_agent.copies.files import Copy
from node_agent.copies.wire import PushRequest

KEY = "job-key-for-copies-0123"


def push(rank: int, step: int, size: int = 100) -> PushRequest:
    return PushRequest(KEY, "b", rank, step, size)


def test_a_ranks_copy_no_restore_could_use_is_superseded_by_its_next_push() -> None:
    """A review (a small /dev/shm): b's rank 1 push was refused by the file system's reserve while rank 0's landed;
    the holder kept rank 0's newest (10) beside the common step (5), and refused every later push at its limit: b's
    copies stayed hundreds of steps behind for good. Rank 0's 10 is of no use without rank 1's: its next push
    supersedes it; the common step stays."""
    held = [Copy("b", 0, 10, 100, 1), Copy("b", 0, 5, 100, 1), Copy("b", 1, 5, 100, 1)]
    assert room.superseded(push(0, 15), held) == [Copy("b", 0, 10, 100, 1)]
    assert room.superseded(push(1, 15), held) == []                # rank 1 holds only the common step
    assert room.superseded(push(0, 8), held) == []                 # (an older push supersedes nothing)


def test_a_copy_every_rank_holds_is_never_superseded() -> None:
    held = [Copy("b", 0, 5, 100, 1), Copy("b", 1, 5, 100, 1), Copy("c", 0, 3, 100, 1)]
    assert room.superseded(push(0, 10), held) == []
    assert room.superseded(PushRequest(KEY, "b", 0, 10, 100), [Copy("b", 0, 5, 100, 1)]) == []   # one rank: common


def test_under_dev_shm_the_free_space_is_no_more_than_the_memory_available(monkeypatch, tmp_path) -> None:
    """A review: /dev/shm sized past the host's memory, a member's copy of 10 GiB was taken (the file system's reserve
    measured against /dev/shm alone) and the kernel killed a process for memory."""
    from node_agent.copies import files
    monkeypatch.setattr(files, "ram", lambda: (1000, 4000))
    assert files.space("/dev/shm") == (1000, 4000)
    assert files.space(str(tmp_path))[0] > 1000                       # a disk: its own free space
    assert "less than 25% of its 4000 bytes free" in (room.refusal(push(0, 5, size=100), [], {}, 10**6, 1,
                                                                   *files.space("/dev/shm")) or "")


def test_moving_copies_make_room_only_where_enough_and_after_long_silent_ones() -> None:
    """A member's copies moving to another holder go for a source's push (the least recently renewed first), but
    only where dropping them makes room: kept, they are the second place a loss fetches from."""
    held = [Copy("m1", 0, 5, 300, 1), Copy("m2", 0, 5, 300, 1), Copy("old", 0, 2, 100, 1), Copy("b", 0, 5, 300, 1)]
    last = {"m1": 900.0, "m2": 800.0, "old": 1.0, "b": 900.0}
    assert room.evictions(held, 0, "b", last, 1000.0, 600.0, ["m1", "m2"]) == []       # it fits: all kept
    got = room.evictions(held, 350, "b", last, 1000.0, 600.0, ["m1", "m2"])
    assert [n for n, _ in got] == ["old", "m2"]              # the silent one first, then the older moving one
    assert [n for n, _ in room.evictions(held, 350, "b", last, 1000.0, 600.0, ["m1"])] == ["old", "m1"]
    assert [n for n, _ in room.evictions(held, 701, "b", last, 1000.0, 600.0, ["m1", "m2"])] == ["old"]  # not enough
    assert room.evictions(held, 200, "m1", last, 1000.0, 600.0, ["m1"])[1:] == []   # never the pusher's own
