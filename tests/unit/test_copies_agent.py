"""The agent's side of peer copies (node_agent/copies/peers.py) against a real holder's store on loopback: what it
pushes, when the holder drops copies (the job went back; a fetched node's), and the fetch before a spawn."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from node_agent.copies import wire
from node_agent.copies.peers import PeerCopies
from node_agent.copies.store import CopyStore
from node_agent.training import snapshot
from node_agent.workers.memory import MemoryDirs
from protocol.messages import Assignment, PollRequest, Witness
from tests.unit.test_copy_store import FAR, Everyone

KEY = "job-key-for-copies-0123"
HONEST_WAIT_S = 10.0    # a push to an honest holder lands well within this on a loaded host


@contextlib.asynccontextmanager
async def on_loopback(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) \
        -> AsyncIterator[Witness]:
    """`handle` behind a port of its own on loopback, as a holder's copy port."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield Witness(addr="127.0.0.1", port=server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def serving(store: CopyStore) -> AsyncIterator[Witness]:
    """`store` behind a port of its own on loopback: where its copies are pushed and fetched."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        if wire.is_copy_request(line):
            await store.serve(line, reader, writer)
        writer.close()

    async with on_loopback(handle) as where:
        yield where


@contextlib.asynccontextmanager
async def holder(tmp_path) -> AsyncIterator[tuple[CopyStore, Witness]]:
    store = CopyStore(str(tmp_path / "held"), 64 * 2**20, Everyone(lambda: KEY), round_now=lambda: 10**6,
                         reach=lambda: FAR)
    async with serving(store) as where:
        yield store, where


def marked(dirs: dict[int, str]) -> list[bool]:
    return [os.path.exists(os.path.join(where, snapshot.FETCHING)) for where in dirs.values()]


def assignment(targets: tuple[Witness, ...], *, copies_of: str = "", copies_at: Witness | None = None,
               copies_also: Witness | None = None) -> Assignment:
    return Assignment(round_id=1, group_rank=1, group_world_size=2, rank_offset=2, world_size=4, local_world_size=2,
                      master_addr="127.0.0.1", master_port=1, restart_count=0, max_restarts=0, replicas=targets,
                      copy_token=KEY, copies_of=copies_of, copies_token=KEY, copies_at=copies_at,
                      copies_also=copies_also)


def agent_side(tmp_path, node: str, said: list[str], stepping=None) -> tuple[PeerCopies, dict[int, str]]:
    """`stepping`: whether the round's local ranks have each stepped (LocalWorkers.all_stepping)."""
    memory = MemoryDirs("job", 2, 8 * 2**20, say=said.append, base=str(tmp_path / node))
    return PeerCopies(memory, 2, node, said.append, bandwidth=0, stepping=stepping), memory.dirs_for(2, 2)


def pushing(copies: PeerCopies, at: Witness, dirs: dict[int, str], round_id: int = 1) -> None:
    """The round's settings as before_spawn takes them, without its push loop (the tests scan themselves)."""
    copies.key, copies.targets, copies._dirs, copies.round = KEY, (at,), dirs, round_id


async def pushed(tmp_path, at: Witness, said: list[str], data: bytes, step: int) -> tuple[PeerCopies, dict[int, str]]:
    """Node b, both its ranks holding `data` as snapshot `step`, pushed to the holder at `at`."""
    copies, dirs = agent_side(tmp_path, "b", said)
    pushing(copies, at, dirs)
    for where in dirs.values():
        snapshot.save(data, step, where=where)
    await copies._scan()
    return copies, dirs


async def test_both_ranks_newest_go_to_the_peer_and_a_job_gone_back_supersedes_the_newer(tmp_path) -> None:
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        copies, dirs = await pushed(tmp_path, at, said, b"s10", 10)
        assert store.held() == {("b", 0): 10, ("b", 1): 10}
        note = copies.note()
        assert note is not None and (note.local_step, note.copied_step) == (10, 10) and note.refused == 0
        for where in dirs.values():                  # the job went back to disk in round 2: step 5 now, 10 abandoned
            snapshot.agreed_step(lambda x: -1, where)
        await copies._scan()
        assert copies.note().copied_step == -1       # its copy is of an abandoned step: no copy of this run
        copies.round = 2
        for where in dirs.values():
            snapshot.save(b"s5", 5, where=where)
        await copies._scan()
        assert store.held() == {("b", 0): 5, ("b", 1): 5}      # round 2's step 5 superseded round 1's step 10
        assert copies.note().copied_step == 5 and copies.refused == 0
        await copies.close()


async def test_a_restarted_agent_copies_again_and_a_refusal_is_never_a_copy(tmp_path) -> None:
    """Its predecessor's copy of step 30 (round 1) is on the holder; the new agent, in round 2, resumed from 25:
    its pushes land. A refused push (here: an older round's) is counted and shown, never taken for a copy."""
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        before, dirs = agent_side(tmp_path, "b", said)
        pushing(before, at, dirs, round_id=1)
        for where in dirs.values():
            snapshot.save(b"s25", 25, where=where, keep=3)
            snapshot.save(b"s30", 30, where=where, keep=3)
        await before._scan()
        assert store.held() == {("b", 0): 30, ("b", 1): 30}
        for where in dirs.values():
            snapshot.agreed_step(lambda x: min(x, 25), where)      # the job resumed from 25
        restarted = PeerCopies(before.memory, 2, "b", said.append, bandwidth=0)
        pushing(restarted, at, dirs, round_id=2)
        await restarted._scan()
        assert store.held() == {("b", 0): 25, ("b", 1): 25} and restarted.note().copied_step == 25
        stale = PeerCopies(before.memory, 2, "b", said.append, bandwidth=0)      # a zombie of round 1
        pushing(stale, at, dirs, round_id=1)
        await stale._scan()
        note = stale.note()
        assert note is not None and (note.copied_step, note.refused) == (-1, 2), note
        assert "stale round 1 (holding copies of round 2)" in note.last_refusal
        await restarted.close()


async def test_the_node_taking_a_place_fetches_its_copies_before_spawning_and_the_holder_lets_them_go(
        tmp_path) -> None:
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        await pushed(tmp_path, at, said, b"b's shard", 25)
        spare, dirs = agent_side(tmp_path, "s", said, stepping=lambda round_id, ranks: True)   # its ranks stepped
        await spare.before_spawn(assignment((at,), copies_of="b", copies_at=at), dirs)
        assert marked(dirs) == [True, True]
        await spare.fetched()             # agreed_step in its workers waits for this
        assert marked(dirs) == [False, False]
        assert [snapshot.steps(where) for where in dirs.values()] == [[25], [25]]
        assert any("fetched node b's snapshots of step 25" in line for line in said), said
        # Dropped once the server heard the spare's own copies of that step landed, not before: till then a loss of
        # the spare hands their fetch to the next node (a review: dropped at the landing, the spare lost before its
        # next poll, the next node found none and every rank went back to disk)
        before = spare.note()                        # a poll before its copies landed
        await spare._flush()
        assert store.held() == {("b", 0): 25, ("b", 1): 25, ("s", 0): 25, ("s", 1): 25}, store.held()
        spare.heard(before)                          # answered: the server knows of no copy yet, they stay
        assert ("b", 0) in store.held() and spare._dropping is None
        spare.heard(spare.note())                    # the poll saying they landed was answered: they go
        await spare._dropping
        assert store.held() == {("s", 0): 25, ("s", 1): 25}, store.held()
        await spare.close()


async def test_a_holder_without_room_for_both_lets_the_fetched_copies_go_for_the_spares_own(tmp_path) -> None:
    """The fetched node's copies stay till the spare's own copy lands; where the holder has no room for both, the
    spare's push is refused for its limit: the fetched ones go then (as before), and its own land next time."""
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        await pushed(tmp_path, at, said, b"b's shard", 25)
        store.limit_bytes = store.held_bytes() + 10          # room for b's copies only
        spare, dirs = agent_side(tmp_path, "s", said, stepping=lambda round_id, ranks: True)
        await spare.before_spawn(assignment((at,), copies_of="b", copies_at=at), dirs)
        await spare.fetched()
        await spare._flush()
        held = store.held()
        assert ("b", 0) not in held and ("b", 1) not in held and spare.refused, (held, said)    # refused: b's go
        spare._retry_at.clear()
        await spare._flush()
        assert store.held() == {("s", 0): 25, ("s", 1): 25}, store.held()
        await spare.close()


async def test_no_copy_left_is_said_and_the_spawn_goes_on(tmp_path) -> None:
    said: list[str] = []
    async with holder(tmp_path) as (_, at):
        spare, dirs = agent_side(tmp_path, "s", said)
        await spare.before_spawn(assignment((), copies_of="b", copies_at=at), dirs)
        await spare.fetched()
        assert [snapshot.steps(where) for where in dirs.values()] == [[], []]
        assert any("no copy of node b's snapshots" in line and "no copy held" in line for line in said), said


async def test_copies_of_a_node_lost_mid_push_are_fetched_at_the_step_all_its_ranks_have(tmp_path) -> None:
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        _, dirs_b = await pushed(tmp_path, at, said, b"b's 20", 20)
        snapshot.save(b"b's 25", 25, where=dirs_b[0])      # rank 0's copy of 25 landed, rank 1's never did
        from node_agent.copies.client import push
        done = await push(at.addr, at.port, key=KEY, node_id="b", local_rank=0, step=25,
                          path=snapshot.path(25, dirs_b[0]), round_id=1)
        assert done.ok and store.held() == {("b", 0): 25, ("b", 1): 20}
        spare, dirs = agent_side(tmp_path, "s", said)
        await spare.before_spawn(assignment((at,), copies_of="b", copies_at=at), dirs)
        await spare.fetched()
        assert all(20 in snapshot.steps(where) for where in dirs.values())
        assert any("fetched node b's snapshots of step 20" in line for line in said), said
        await spare.close()


async def test_a_node_without_memory_directories_takes_no_copies(tmp_path) -> None:
    off = PeerCopies(MemoryDirs("job", 2, 0, say=lambda s: None, base=str(tmp_path)), 2, "n", lambda s: None, 0)
    assert await off.listen("127.0.0.1", 4000) == 0
    on = PeerCopies(MemoryDirs("job", 2, 2**20, say=lambda s: None, base=str(tmp_path)), 2, "n", lambda s: None, 0)
    assert await on.listen("127.0.0.1", 4000) == 4000          # the witnesses' port, in the clear


async def test_a_node_whose_copies_go_nowhere_says_so_once(tmp_path) -> None:
    said: list[str] = []
    copies, dirs = agent_side(tmp_path, "b", said)
    await copies.before_spawn(msgspec.structs.replace(assignment(()), group_world_size=1), dirs)
    assert not [line for line in said if "peer copies" in line], said    # alone in its round: nobody to hold them
    for _ in range(2):                                # every round, said once
        await copies.before_spawn(assignment(()), dirs)
    assert len([line for line in said if "no member takes this node's copies" in line]) == 1, said
    off: list[str] = []
    copies_off, dirs_off = agent_side(tmp_path, "c", off)
    a = assignment(())
    await copies_off.before_spawn(msgspec.structs.replace(a, copy_token=""), dirs_off)
    assert any("peer copies off for this job (--replicas 0)" in line for line in off), off
    await copies.close()
    await copies_off.close()


async def test_a_static_launch_says_it_makes_no_copies_not_that_domains_are_one(tmp_path) -> None:
    # A static launch's coordinator is the node alone: --failure-domain cannot help, and there is no job page.
    said: list[str] = []
    memory = MemoryDirs("job", 2, 8 * 2**20, say=lambda s: None, base=str(tmp_path))
    copies = PeerCopies(memory, 2, "n", said.append, 0, static=True)
    await copies.before_spawn(assignment(()), memory.dirs_for(2, 2))
    assert [line for line in said if "peer copies" in line] == [
        "peer copies: none in a static launch (--node-rank: no rendezvous server pairs the nodes), so a lost node's "
        "ranks resume from disk"], said
    await copies.close()


async def test_a_first_source_that_fails_leaves_the_fetch_to_the_peer_copy(tmp_path) -> None:
    """The gone node itself first (here: gone too, nothing listens), its peer copies' holder second."""
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        await pushed(tmp_path, at, said, b"b's shard", 30)
        with socket.socket() as probe:       # a port nothing listens on: refused at once
            probe.bind(("127.0.0.1", 0))
            nobody = Witness(addr="127.0.0.1", port=probe.getsockname()[1])
        spare, dirs = agent_side(tmp_path, "s", said, stepping=lambda round_id, ranks: True)
        await spare.before_spawn(assignment((at,), copies_of="b", copies_at=nobody, copies_also=at), dirs)
        await spare.fetched()
        assert [snapshot.steps(where) for where in dirs.values()] == [[30], [30]]
        failed = [line for line in said if line.startswith(f"no copy of node b's snapshots for every rank at "
                                                           f"127.0.0.1:{nobody.port}")]
        assert len(failed) == 1 and "resume from disk" not in failed[0], said
        assert any(f"fetched node b's snapshots of step 30 from {at.addr}:{at.port}" in line for line in said), said
        await spare._flush()                         # its own copies landed, and the server heard: b's go
        spare.heard(spare.note())
        await spare._dropping
        assert ("b", 0) not in store.held() and ("s", 0) in store.held()
        await spare.close()


async def test_a_copy_that_lands_after_its_rank_let_its_step_go_is_said_once(tmp_path, monkeypatch) -> None:
    """The push of step 10 took so long that the ranks kept only 20 and 25 when it landed: were the node lost, its
    replacement would resume from a step the others may no longer keep. Said once, with what to change."""
    from node_agent.copies import peers
    said: list[str] = []
    real = peers.push

    async def slow(*args, **kwargs):
        result = await real(*args, **kwargs)
        for where in copies._dirs.values():         # the ranks went on while it was sent
            snapshot.save(b"s20", 20, where=where)
            snapshot.save(b"s25", 25, where=where)
        return result

    monkeypatch.setattr(peers, "push", slow)
    async with holder(tmp_path) as (store, at):
        copies, dirs = agent_side(tmp_path, "b", said)
        pushing(copies, at, dirs)
        for where in dirs.values():
            snapshot.save(b"s10", 10, where=where)
        await copies._scan()
        assert store.held() == {("b", 0): 10, ("b", 1): 10}
        lag = [line for line in said if "lag behind" in line]
        assert len(lag) == 1 and "kept only steps 20..25" in lag[0] and "--replica-bandwidth" in lag[0], said
        monkeypatch.setattr(peers, "push", real)
        await copies._scan()                         # step 25's copy lands while the ranks keep it: nothing said
        assert store.held() == {("b", 0): 25, ("b", 1): 25} and len([x for x in said if "lag behind" in x]) == 1
        await copies.close()


async def test_a_note_that_cannot_read_the_memory_shows_the_last_one_and_says_so_once(tmp_path,
                                                                                     monkeypatch) -> None:
    """Out of descriptors (idle connections flooding the copy port) the server's view keeps the last figures: the
    poll it rides on goes out, and the agent lives (it died here of an EMFILE in note())."""
    said: list[str] = []
    async with holder(tmp_path) as (_, at):
        copies, _ = await pushed(tmp_path, at, said, b"s10", 10)
        first = copies.note()
        assert first is not None and (first.local_step, first.copied_step) == (10, 10)

        def out_of_descriptors(dirs: dict[int, str]) -> dict[int, tuple[int, str]]:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr("node_agent.copies.peers.common_step", out_of_descriptors)
        assert copies.note() is first and copies.note() is first
        assert [line for line in said if "cannot read the memory directories for the server's view" in line] == [
            "peer copies: cannot read the memory directories for the server's view (Too many open files): it "
            "shows the last figures until they can be read"]
        monkeypatch.undo()
        assert copies.note() == first
        await copies.close()


async def test_with_copies_off_the_note_still_tells_the_newest_snapshot_and_that_nothing_is_copied(tmp_path) -> None:
    """--replicas 0, or one failure domain: no targets, no store. The server still learns that this node's memory
    holds state of its own (a member whose agent restarts is waited for: rdzv_server/core/awaiting.py)."""
    said: list[str] = []
    copies, dirs = agent_side(tmp_path, "b", said)
    assert copies.note() is None                         # no round yet: nothing to tell
    copies.key, copies.targets, copies._dirs, copies.round = KEY, (), dirs, 1
    assert copies.note() == msgspec.convert({"local_step": -1, "copying": False}, type(copies.note()))
    for where in dirs.values():
        snapshot.save(b"s10", 10, where=where)
    note = copies.note()
    assert note is not None and (note.local_step, note.copied_step, note.copying) == (10, -1, False)
    await copies.close()


async def test_a_new_round_pushes_only_what_it_wrote(tmp_path) -> None:
    """A review: b's restarted agent pushed its newest snapshot (step 30) tagged with the new round before its
    workers agreed on 20 and removed 30: the holder kept the abandoned 30 and refused the job's 20 and 25 of that
    round as stale, and a later loss of b sent every rank to step 0. A round pushes only what it wrote (its
    workers' snapshots, or copies it fetched)."""
    import time
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        copies, dirs = agent_side(tmp_path, "b", said)
        for where in dirs.values():
            snapshot.save(b"s30", 30, where=where)          # the previous agent's, of steps the job will abandon
            os.utime(snapshot.path(30, where), (time.time() - 5, time.time() - 5))
        await copies.before_spawn(assignment(()), dirs)      # round 1 begins (no targets: no push loop)
        pushing(copies, at, dirs)
        await copies._scan()
        assert store.held() == {}                            # not of this round: not pushed
        for where in dirs.values():
            snapshot.save(b"s25", 25, where=where)           # this round's workers, resumed from 20
            os.remove(snapshot.path(30, where))              # (agreed_step removed the abandoned one)
        await copies._scan()
        assert store.held() == {("b", 0): 25, ("b", 1): 25}


async def test_a_copy_it_fetched_goes_only_once_its_ranks_stepped(tmp_path) -> None:
    """A review: b and c of a 3-node job restarted at once, their memory gone; b's copy was at c, so b fetched only
    its own copy of step 20 from a and every rank went back to step 0. b's agent pushed that fetched 20, tagged with
    the new round, before its workers removed it (abandoned): a refused b's new 5, 10, 15 as stale, and b lost again
    at step 16 sent every rank to step 0 a second time. A fetched copy goes only once the ranks stepped past their
    agreement (it is then what they resumed from, or gone)."""
    said: list[str] = []
    stepped = {"now": False}
    async with holder(tmp_path) as (store, at):
        copies, dirs = agent_side(tmp_path, "b", said, stepping=lambda round_id, ranks: stepped["now"])
        await copies.before_spawn(assignment(()), dirs)      # round 1 begins (no targets: no push loop)
        pushing(copies, at, dirs)
        for where in dirs.values():
            snapshot.save(b"s20", 20, where=where)          # fetched: of steps the job is about to abandon
            snapshot.mark_fetched(where, 20)
        await copies._scan()
        assert store.held() == {}                            # not before its ranks agreed on a step
        for where in dirs.values():
            os.remove(snapshot.path(20, where))              # agreed_step went back to 0 and removed it
            snapshot.save(b"s5", 5, where=where)             # this round's workers
        stepped["now"] = True
        await copies._scan()
        assert store.held() == {("b", 0): 5, ("b", 1): 5}, (store.held(), said)


async def test_once_its_ranks_step_a_round_pushes_the_step_it_resumed_from(tmp_path) -> None:
    """A second review: a node whose holder changed in this round (a spare took the old holder's place) pushed
    nothing until its next snapshot, minutes away in a real job; lost meanwhile, every rank went to step 0. Once
    every local rank has stepped (past its agreement: nothing abandoned is left), the round's newest goes, whatever
    round wrote it."""
    import time
    said: list[str] = []
    stepped = {"now": False}
    async with holder(tmp_path) as (store, at):
        memory = MemoryDirs("job", 2, 8 * 2**20, say=said.append, base=str(tmp_path / "b"))
        copies = PeerCopies(memory, 2, "b", said.append, bandwidth=0,
                            stepping=lambda round_id, ranks: stepped["now"] and round_id == 1 and ranks == 2)
        dirs = memory.dirs_for(2, 2)
        for where in dirs.values():
            snapshot.save(b"s100", 100, where=where)          # an earlier round's: the step this one resumes from
            os.utime(snapshot.path(100, where), (time.time() - 5, time.time() - 5))
        await copies.before_spawn(assignment(()), dirs)
        pushing(copies, at, dirs)
        await copies._scan()
        assert store.held() == {}                             # its ranks not past their start yet
        stepped["now"] = True
        await copies._scan()
        assert store.held() == {("b", 0): 100, ("b", 1): 100}


async def test_a_slow_holder_holds_back_its_own_copies_only(tmp_path, monkeypatch) -> None:
    """A review: with --replicas 2 every push of a scan waited for the others, and a member reading its pushes at a
    trickle (inside every stall bound) held back the copies to the honest holder too: the node, lost, resumed a
    snapshot back. Each holder's pushes go on their own."""
    stuck: list[asyncio.StreamWriter] = []

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        stuck.append(writer)                  # holds the push: no answer, nothing read

    slow = await asyncio.start_server(never_answers, "127.0.0.1", 0)
    said: list[str] = []
    try:
        async with holder(tmp_path) as (store, at):
            copies, dirs = agent_side(tmp_path, "b", said)
            pushing(copies, at, dirs)
            copies.targets = (Witness(addr="127.0.0.1", port=slow.sockets[0].getsockname()[1]), at)
            for step in (5, 10):
                for where in dirs.values():
                    snapshot.save(b"s%d" % step, step, where=where)
                # Polled to a deadline, not 200 tries of 10 ms (2 s a loaded host can spend): under the pusher's
                # 30 s stall bound, so a push held behind the slow holder's still fails here
                deadline = asyncio.get_running_loop().time() + HONEST_WAIT_S
                while store.held() != {("b", 0): step, ("b", 1): step} and \
                        asyncio.get_running_loop().time() < deadline:
                    copies._start_pushes()
                    await asyncio.sleep(0.01)
                assert store.held() == {("b", 0): step, ("b", 1): step}, (step, said)
            slow_at = ("127.0.0.1", slow.sockets[0].getsockname()[1])
            assert stuck and not copies._to_holder[slow_at].done()      # its step 5, still under way
            monkeypatch.setattr("node_agent.copies.peers.FLUSH_LIMIT_S", 0.1)
            await copies.close()             # its leave's last pushes wait for the slow holder: bounded, said
            assert any("did not reach its holders within 0.1s" in line and "else from disk or step 0" in line
                       for line in said), said
    finally:
        for writer in stuck:
            writer.close()
        slow.close()
        await slow.wait_closed()


def test_a_node_without_memory_directories_says_it_holds_nothing_so_no_floor_waits_for_its_copy(tmp_path) -> None:
    """A node run with --no-memory-dir sends a note of no snapshot and no copy: with none the server counted it as a
    member whose first copy was still coming, and the copies floor stayed 0 (every other rank kept every snapshot)."""
    from tests.unit.test_copies_rounds import CFG, JOB, noted, started

    said: list[str] = []
    note = PeerCopies(MemoryDirs("job", 2, 0, say=said.append, base=str(tmp_path / "c")), 2, "c", said.append,
                      bandwidth=0).note()
    assert note is not None and (note.local_step, note.copied_step) == (-1, -1)
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    noted(rz, "a", 1.0, 40)
    noted(rz, "b", 1.1, 30)
    rz.handle(JOB, PollRequest(v=1, node_id="c", credential="secret-c", copies=note), 1.2)
    assert rz.view(JOB, "a", 1.2).copies_floor == 30


async def test_a_restarted_agent_takes_no_copy_past_the_step_the_job_went_back_to(tmp_path) -> None:
    """Node b's copies of step 20 at its holder; the job's replicas diverged after step 15 (resume_at_most), so b's
    restarted agent removed its step 20 (agent.py: forget_after) and checks the memory it took up against its holder
    (own_check.py). The holder's 20 is of the steps the job abandoned: the check took it into every rank as a step
    they lacked, which with `lend` a majority of such ranks hands to every replica."""
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        restarted, dirs = await pushed(tmp_path, at, said, b"b's diverged state", 20)    # its memory, taken up
        assert store.held() == {("b", 0): 20, ("b", 1): 20}, store.held()
        for where in dirs.values():
            snapshot.save(b"b's state of 15", 15, where=where)
            snapshot.forget_after(15, where)
        await restarted.before_spawn(msgspec.structs.replace(assignment((at,), copies_of="b", copies_at=at),
                                                             resume_at_most=15), dirs)
        await restarted.fetched()
        assert [snapshot.steps(where) for where in dirs.values()] == [[15], [15]], said
        assert not any("took the holder's copy" in line for line in said), said
        await restarted.close()


async def test_a_restarted_agents_check_gives_a_holder_that_never_answers_up_soon_and_says_so(tmp_path) -> None:
    """The holder's copy port takes the connection and answers nothing (its agent stalled): the restarted agent's
    workers waited on the check the fetch's answer bound, 10 s, where before the check they waited for nothing, and
    nothing said why. Now the check's own bound, and a line; the memory stands."""
    said: list[str] = []

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()           # till the agent gives up and closes
        writer.close()

    copies, dirs = agent_side(tmp_path, "b", said)
    for where in dirs.values():
        snapshot.save(b"b's state of 10", 10, where=where)
    async with on_loopback(never_answers) as at:
        await copies.before_spawn(assignment((), copies_of="b", copies_at=at), dirs)
        assert marked(dirs) == [True, True]
        await copies.fetched()
    assert marked(dirs) == [False, False] and [snapshot.steps(where) for where in dirs.values()] == [[10], [10]]
    assert any("memory could not be checked against its copies' holder (lost: no line within 2 s)" in line
               for line in said), said
    await copies.close()
