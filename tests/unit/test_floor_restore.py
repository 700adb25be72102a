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
