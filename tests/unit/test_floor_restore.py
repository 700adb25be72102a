from unittest.mock import patch

from rdzv_server.core import floors
from tests.unit.test_copies_rounds import CFG, JOB, noted, started


def test_a_servers_time_away_makes_no_member_look_stuck_to_the_held_floor():
    """b, a snapshot behind a, noted 35 just before the server went away for 3 minutes; a's first note after it
    comes back must not find b stuck for the minute it was not heard (nobody is blamed for the time away)."""
    rz = started({"a": "1", "b": "1"}, CFG)
    noted(rz, "a", 1.0, -1, local=40)
    noted(rz, "b", 1.6, -1, local=35)
    assert rz.view(JOB, "a", 1.6).held_floor == 35
    rz.restored(182.0, 180.0, True)
    noted(rz, "a", 183.0, -1, local=45)
    assert rz.view(JOB, "a", 183.0).held_floor == 35


def test_a_note_below_a_floor_brings_it_down_at_once_and_rises_wait_their_turn():
    """Each copy's note worked both floors out again over every member (O(members) a note, unthrottled): a rise
    now waits HELD_EVERY_S, as a newest snapshot's does; a note below a floor still brings it down at once."""
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    noted(rz, "a", 1.0, 40)
    noted(rz, "b", 1.1, 40)
    noted(rz, "c", 1.2, 40)
    assert rz.view(JOB, "a", 1.2).copies_floor == 40
    looks = []
    real = floors.copies_floor
    with patch.object(floors, "copies_floor", lambda job, now: looks.append(now) or real(job, now)):
        for i, n in enumerate("abc"):
            noted(rz, n, 1.25 + i / 100, 41)                    # each copy moves: one look, not three
        assert len(looks) == 0 and rz.view(JOB, "a", 1.3).copies_floor == 40
        noted(rz, "b", 1.35, 20)                               # below the floor: worked out at once
        assert looks == [1.35] and rz.view(JOB, "a", 1.35).copies_floor == 20


def test_notes_of_no_copy_yet_under_a_floor_of_0_are_not_each_worked_out():
    """-1 (no copy yet) counts 0: under a floor of 0 it brings nothing down, so it waits its turn too."""
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    for n in "abc":
        noted(rz, n, 0.9, -1, local=39)                       # (a first note is worked out at once)
    looks = []
    real = floors.copies_floor
    with patch.object(floors, "copies_floor", lambda job, now: looks.append(now) or real(job, now)):
        for i in range(9):
            noted(rz, "abc"[i % 3], 1.0 + i / 100, -1, local=40 + i)
    assert len(looks) == 0 and rz.view(JOB, "a", 1.1).copies_floor == 0


def test_one_failed_write_of_a_slower_member_keeps_it_in_the_held_floor_where_snapshots_are_far_apart():
    """Snapshots 40 s apart: b's write of 80 fails (its memory directory full, once). When a makes room for 120, b
    still holds only 40, and a must keep it (a failure during the write of 120 then finds 40 on every rank). A
    minute without a move is not b's writes failing for good where one interval is 40 s: b missed one snapshot."""
    rz = started({"a": "1", "b": "1"}, CFG)
    noted(rz, "a", 1.0, -1, local=0)
    noted(rz, "b", 1.6, -1, local=0)
    noted(rz, "a", 41.0, -1, local=40)
    noted(rz, "b", 41.6, -1, local=40)
    assert rz.view(JOB, "a", 41.6).held_floor == 40
    noted(rz, "a", 81.0, -1, local=80)                  # b's write of 80 failed: b holds 40 only
    noted(rz, "b", 81.6, -1, local=40)
    assert rz.view(JOB, "a", 81.6).held_floor == 40
    noted(rz, "a", 110.0, -1, local=80)                 # a's held poll, just before it makes room for 120
    assert rz.view(JOB, "a", 110.0).held_floor == 40    # b still counts: a keeps 40 for it
    noted(rz, "a", 121.0, -1, local=120)
    noted(rz, "b", 121.6, -1, local=40)                 # b's write of 120 failed too: two in a row
    noted(rz, "a", 150.0, -1, local=120)
    noted(rz, "a", 161.0, -1, local=160)
    assert rz.view(JOB, "a", 161.0).held_floor == 160   # b's writes fail: no more is kept for it
