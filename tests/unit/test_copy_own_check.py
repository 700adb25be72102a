"""A restarted agent's check of the memory it took up against its holder's newest copy (node_agent/copies/own_check.py):
a rank's file of the node's newest common step cut short, or a step newer than that the rank lacks, is the holder's
copy now, marked fetched; a file of the same size stays (a copy of an older round may differ from it, and the job
abandoned those steps), a copy older than the memory or of steps that differ between ranks is dropped, and nothing
is left beside the ranks' files."""
from __future__ import annotations

import os

from node_agent.copies import client
from node_agent.copies.client import FetchResult
from node_agent.copies.own_check import SIDE, check_own, no_room_line, ours_stands, side_dirs, take_newer
from node_agent.training import fetched, snapshot
from tests.unit.test_copy_store import KEY, SAID, WAIT, blob, holder, make_store, snap
from tests.unit.test_listener import until


def node(tmp_path, held: dict[int, dict[int, bytes]]) -> dict[int, str]:
    """Each local rank's memory directory holding `held[rank]` (step -> bytes)."""
    dirs = {}
    for rank, steps in held.items():
        dirs[rank] = str(tmp_path / str(rank))
        os.makedirs(dirs[rank])
        for step, data in steps.items():
            snapshot.save(data, step, where=dirs[rank])
    return dirs


def holders_copy(dirs: dict[int, str], step: int, data: dict[int, bytes]) -> tuple[dict[int, str], list[FetchResult]]:
    """The holder's copy of `step` landed in each rank's side directory, as fetch_ranks leaves it."""
    side = side_dirs(dirs)
    for rank, where in side.items():
        with open(snapshot.path(step, where), "wb") as f:
            f.write(data[rank])
    return side, [FetchResult(step, f"fetched step={step}", len(data[rank])) for rank in sorted(dirs)]


def read(dirs: dict[int, str], rank: int, step: int) -> bytes:
    with open(snapshot.path(step, dirs[rank]), "rb") as f:
        return f.read()


def test_a_file_cut_short_is_the_holders_copy_and_a_whole_one_stays(tmp_path):
    whole = {0: b"a" * 100, 1: b"b" * 100}
    dirs = node(tmp_path, {0: {5: b"x", 10: b"a" * 40}, 1: {5: b"y", 10: b"B" * 100}})    # rank 0's 10 cut short
    side, got = holders_copy(dirs, 10, whole)
    assert take_newer(dirs, side, got, kept=10) == [0]
    assert read(dirs, 0, 10) == whole[0] and fetched.is_copy(dirs[0], 10)
    assert read(dirs, 1, 10) == b"B" * 100 and not fetched.is_copy(dirs[1], 10)      # the same size: its own
    assert not any(os.path.exists(os.path.join(where, SIDE)) for where in dirs.values())


def test_a_newer_step_a_rank_lacks_is_taken_and_one_it_holds_stays(tmp_path):
    dirs = node(tmp_path, {0: {5: b"x"}, 1: {5: b"y", 10: b"own"}})     # rank 0 lost its 10: the node's is 5
    side, got = holders_copy(dirs, 10, {0: b"held-0", 1: b"held-1"})
    assert take_newer(dirs, side, got, kept=5) == [0]
    assert read(dirs, 0, 10) == b"held-0" and read(dirs, 1, 10) == b"own"
    assert snapshot.steps(dirs[0]) == [5, 10]


def test_an_older_copy_or_one_of_steps_that_differ_leaves_the_memory_as_it_is(tmp_path):
    dirs = node(tmp_path, {0: {10: b"a"}, 1: {10: b"b"}})
    side, got = holders_copy(dirs, 5, {0: b"old-0", 1: b"old-1"})
    assert take_newer(dirs, side, got, kept=10) == []
    assert [snapshot.steps(where) for where in dirs.values()] == [[10], [10]]
    side, got = holders_copy(dirs, 10, {0: b"held-0", 1: b"held-1"})
    got[1] = FetchResult(None, "no copy held", 0)
    assert take_newer(dirs, side, got, kept=10) == [] and read(dirs, 0, 10) == b"a"
    assert not any(os.path.exists(os.path.join(where, SIDE)) for where in dirs.values())


def test_a_node_back_without_memory_says_what_it_costs_only_in_a_job_with_snapshots():
    line = no_room_line("b", "127.0.0.1", 4000, 15)
    assert "step 15" in line and "127.0.0.1:4000" in line and "every rank of the job goes back" in line
    assert "without --no-memory-dir" in line and "\n" not in line
    assert no_room_line("b", "127.0.0.1", 4000, -1) == ""        # no snapshot noted: nothing is lost


async def pushed(tmp_path, port: int, copies: dict[int, bytes]) -> None:
    """Node b's copies of step 10 (rank -> bytes) pushed to the holder at `port`."""
    for rank, data in copies.items():
        sent = await client.push("127.0.0.1", port, key=KEY, node_id="b", local_rank=rank, step=10,
                                 path=snap(tmp_path, f"push-{rank}", data))
        assert sent.ok, sent


async def test_a_restarts_check_brings_only_the_bytes_of_a_file_cut_short(tmp_path):
    """Against a real holder: a rank whose own file of the step stands takes only the answer's step and size (a
    restart's check costs a round trip, not a snapshot: the first version fetched every rank's whole copy on every
    agent restart, its workers waiting), a rank whose file is cut short the whole copy."""
    store = make_store(tmp_path)
    copies = {rank: blob(200_000, seed=rank) for rank in (0, 1)}
    dirs = node(tmp_path, {0: {10: copies[0]}, 1: {10: copies[1][:1000]}})        # rank 1's cut short
    said: list[str] = []
    async with holder(store) as port:
        await pushed(tmp_path, port, copies)
        side = side_dirs(dirs)
        got = await client.fetch_ranks("127.0.0.1", port, KEY, "b", side, None, WAIT, None, spares=False,
                                       keep=lambda rank, step, size: ours_stands(
                                           snapshot.path(step, dirs[rank]), step, size, 10))
        assert [(r.step, r.received) for r in got] == [(10, 0), (10, len(copies[1]))]
        assert take_newer(dirs, side, got, kept=10) == [1]
        os.truncate(snapshot.path(10, dirs[0]), 500)                                   # now rank 0's
        await check_own(dirs, 10, ("127.0.0.1", port, KEY, "b"), None, None, said.append)
    assert [read(dirs, rank, 10) for rank in (0, 1)] == [copies[0], copies[1]]
    assert len(said) == 1 and said[0].startswith("local rank(s) 0: the memory's file of step 10 was missing or cut")


async def test_a_restarts_check_closing_on_the_answer_is_no_trouble_at_the_holder(tmp_path):
    """Each rank's file stands, so the check closes on the holder's answer while the holder sends (copies past the
    sockets' buffers). The holder said "copy store: gave up: connection lost: Broken pipe" at every agent restart,
    taking the minute's slot of its kind ("lost") from a push really lost meanwhile."""
    store = make_store(tmp_path)
    copies = {rank: blob(32 << 20, seed=rank) for rank in (0, 1)}
    dirs = node(tmp_path, {rank: {10: data} for rank, data in copies.items()})
    said: list[str] = []
    async with holder(store) as port:
        await pushed(tmp_path, port, copies)
        await check_own(dirs, 10, ("127.0.0.1", port, KEY, "b"), None, None, said.append)
        await until(lambda: not store._sending, "the holder's fetches ended (then it notes)")
    assert said == [] and [read(dirs, rank, 10) for rank in (0, 1)] == [copies[0], copies[1]]
    assert not any("gave up" in line for line in SAID[store]), SAID[store]


def test_a_file_longer_than_the_holders_copy_is_not_cut_short_and_stays(tmp_path):
    """The holder's copy of step 10 is of an older round (the job went back and trained to 10 again; this node's new
    copy had not landed), 100 bytes where the rank's own whole file is 150: taken as "of another size", the old
    round's state replaced the rank's own file. Only a file shorter than the copy is cut short."""
    dirs = node(tmp_path, {0: {10: b"n" * 150}, 1: {10: b"m" * 150}})
    side, got = holders_copy(dirs, 10, {0: b"o" * 100, 1: b"p" * 100})
    assert take_newer(dirs, side, got, kept=10) == []
    assert read(dirs, 0, 10) == b"n" * 150 and not fetched.is_copy(dirs[0], 10)
    assert not ours_stands(snapshot.path(10, dirs[0]), 10, 200, kept=10)         # shorter than the copy: cut short
