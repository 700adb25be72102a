"""A holder's spare: the common step before a node's newest, kept while room allows (files.spares), fetched beside
the newest (client.fetch_ranks) so that two nodes lost together whose copies landed a snapshot apart still share a
step every rank holds (snapshot.agreed_step)."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections.abc import AsyncIterator

from node_agent.copies import client, wire
from node_agent.copies import files as copies_files
from node_agent.copies.store import CopyStore
from node_agent.copies.wire import FetchRequest
from node_agent.training import snapshot
from protocol.messages import CopySource
from tests.ports import loopback_server
from tests.unit.test_copy_store import GO, KEY, WAIT, blob, connection, flip, header, holder, line_of, make_store, snap
from tests.unit.test_memory_dirs import reduce_min_of


async def push(tmp_path, port: int, node: str, rank: int, step: int, size: int = 1000) -> None:
    done = await client.push("127.0.0.1", port, key=KEY, node_id=node, local_rank=rank, step=step,
                             path=snap(tmp_path, f"{node}-{rank}-{step}", blob(size, seed=rank * 1000 + step)))
    assert done.ok, (node, rank, step, done)


def kept(store, node: str) -> list[tuple[int, int]]:
    return sorted((c.rank, c.step) for c in copies_files.copies(store.root) if c.node == node)


def agree(dirs: list[str]) -> list[int | None]:
    """agreed_step on every rank at once, one thread a rank (test_memory_dirs' stand-in for all_reduce)."""
    barrier, values, results = threading.Barrier(len(dirs)), [0] * len(dirs), [None] * len(dirs)

    def run(rank: int) -> None:
        results[rank] = snapshot.agreed_step(reduce_min_of(rank, barrier, values), dirs[rank])
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return results


async def test_two_nodes_lost_together_a_snapshot_apart_resume_from_the_step_all_can_get(tmp_path) -> None:
    """A review (test_peer_copies, 8 MB pushes at 1 MB/s, a snapshot each 0.5 s): lost node x's holder had x's step
    75, lost node y's holder y's 70 (x's push of 75 had landed, y's not yet); the survivors keep both steps. Each
    holder kept one step, the replacements shared none, and agreed_step sent every rank to step 0."""
    hold_x, hold_y = make_store(tmp_path / "hx"), make_store(tmp_path / "hy")
    dirs: list[str] = []
    for name in ("survivor-0", "survivor-1", "x-0", "x-1", "y-0"):
        os.makedirs(where := str(tmp_path / name))
        dirs.append(where)
    for where in dirs[:2]:
        for step in (70, 75):
            snapshot.save(b"s", step, where=where, keep=3)
    async with holder(hold_x) as port_x, holder(hold_y) as port_y:
        for step in (65, 70, 75):
            for rank in (0, 1):
                await push(tmp_path, port_x, "x", rank, step)
        for step in (65, 70):
            await push(tmp_path, port_y, "y", 0, step)
        assert kept(hold_x, "x") == [(0, 70), (0, 75), (1, 70), (1, 75)], "the step before the newest: a spare"
        got_x = await client.fetch_ranks("127.0.0.1", port_x, KEY, "x", {0: dirs[2], 1: dirs[3]}, None, WAIT, None)
        got_y = await client.fetch_ranks("127.0.0.1", port_y, KEY, "y", {0: dirs[4]}, None, WAIT, None)
    assert [r.step for r in got_x + got_y] == [75, 75, 70], "each replacement's newest as before"
    assert [snapshot.steps(where) for where in dirs[2:]] == [[70, 75], [70, 75], [65, 70]]
    assert (tmp_path / "x-0" / "step-70").read_bytes() == blob(1000, seed=70)
    assert snapshot.is_copy(dirs[2], 75) and not snapshot.is_copy(dirs[2], 70), "the newest is the fetched mark's"
    assert agree(dirs) == [70] * 5


async def test_a_spare_never_refuses_a_push_and_goes_first(tmp_path) -> None:
    """Room for the newest copies only: the spares make way for a push, another node's as well as the pusher's,
    and a node's share counts them not."""
    store = make_store(tmp_path, limit=3000)
    async with holder(store) as port:
        await push(tmp_path, port, "a", 0, 5)
        await push(tmp_path, port, "a", 0, 10)
        assert kept(store, "a") == [(0, 5), (0, 10)]
        await push(tmp_path, port, "b", 0, 5)
        assert kept(store, "a") == [(0, 5), (0, 10)] and kept(store, "b") == [(0, 5)], "room enough: kept"
        await push(tmp_path, port, "b", 0, 10)      # 4000 bytes with a's spare: a's spare goes, b's newest stays
        assert kept(store, "a") == [(0, 10)] and kept(store, "b") == [(0, 5), (0, 10)]
        await push(tmp_path, port, "a", 0, 15)
        assert kept(store, "a") == [(0, 10), (0, 15)] and kept(store, "b") == [(0, 10)]


async def test_a_spare_is_fetched_only_whole_on_every_rank_and_checked(tmp_path) -> None:
    """A spare corrupted at rest fails the fetcher's check: no rank keeps its spare (nothing half there), the
    newest stands, and the holder removes the bad one. Where a rank's spare would not fit its limit beside the
    newest, it is not taken."""
    store = make_store(tmp_path)
    async with holder(store) as port:
        for step in (5, 10):
            for rank in (0, 1):
                await push(tmp_path, port, "a", rank, step)
        flip(os.path.join(store.root, "a", "1", "step-5"), 10)
        dirs = {rank: str(tmp_path / f"r{rank}") for rank in (0, 1)}
        for where in dirs.values():
            os.makedirs(where)
        got = await client.fetch_ranks("127.0.0.1", port, KEY, "a", dirs, None, WAIT, None)
        assert [r.step for r in got] == [10, 10]
        assert [snapshot.steps(where) for where in dirs.values()] == [[10], [10]]
        assert kept(store, "a") == [(0, 5), (0, 10), (1, 10)]
        tight = {rank: str(tmp_path / f"t{rank}") for rank in (0, 1)}
        for where in tight.values():
            os.makedirs(where)
        got = await asyncio.wait_for(client.fetch_ranks("127.0.0.1", port, KEY, "a", tight, 1500, WAIT, None), WAIT)
        assert [r.step for r in got] == [10, 10] and [snapshot.steps(w) for w in tight.values()] == [[10], [10]]


def test_the_ask_for_the_step_before_round_trips_and_an_older_holder_answers_nothing() -> None:
    line = wire.fetch_line(FetchRequest(KEY, "a", 1, 75, before=True))
    assert line == b"rdzv-agent fetch-before key=%s node=a rank=1 step=75\n" % KEY.encode()
    assert wire.parse_request(line) == FetchRequest(KEY, "a", 1, 75, before=True)
    assert wire.parse_request(line.replace(b"fetch-before", b"fetch-at")) == FetchRequest(KEY, "a", 1, 75)


async def test_a_spare_not_all_there_in_its_time_leaves_the_newest_alone(tmp_path) -> None:
    """The spare has what is left of the fetch's bound (the caller's bound on the whole): one rank's in, another's
    still coming at that bound, and neither stays; the newest is untouched, so a slow spare never costs it."""
    dirs = [str(tmp_path / str(rank)) for rank in (0, 1)]
    for where in dirs:
        os.makedirs(where)
        snapshot.save(b"s", 10, where=where)
    stuck = asyncio.Event()

    async def one(rank: int, where: str, room: int | None) -> client.FetchResult:
        if rank == 1:
            await stuck.wait()       # never set: a holder that sends no more
        snapshot.save(b"s", 5, where=where)
        return client.FetchResult(5, "fetched step=5", 1)
    await asyncio.wait_for(client._fetch_spares(list(enumerate(dirs)), 10, None, 0.2, one), WAIT)
    assert [snapshot.steps(where) for where in dirs] == [[10], [10]]


class Some:
    """Sources for a holder: the nodes named in `nodes` now, each with the test's key."""
    def __init__(self, *nodes: str) -> None:
        self.nodes = set(nodes)

    def get(self, node: str) -> CopySource | None:
        return CopySource(node_id=node, token=KEY) if node in self.nodes else None

    def __len__(self) -> int:
        return len(self.nodes)


async def test_a_lost_nodes_spare_is_the_last_spare_to_make_room(tmp_path) -> None:
    """Its place's fetch may want it (the step the job agrees on): a live source's spare goes first, though newer."""
    sources = Some()
    store = CopyStore(str(tmp_path / "held"), 6000, sources, round_now=lambda: 10**6, reach=lambda: 10**18 - 1)
    async with holder(store) as port:
        for node, steps in (("lost", (3, 8)), ("a", (10, 15)), ("b", (10, 15))):
            sources.nodes.add(node)
            for step in steps:
                await push(tmp_path, port, node, 0, step)
        sources.nodes.discard("lost")
        sources.nodes.add("c")
        assert kept(store, "lost") == [(0, 3), (0, 8)] and kept(store, "a") == [(0, 10), (0, 15)]
        await push(tmp_path, port, "c", 0, 5)
    assert kept(store, "lost") == [(0, 3), (0, 8)]
    assert sorted(kept(store, "a") + kept(store, "b")) == [(0, 10), (0, 15), (0, 15)], "a live source's spare went"


async def test_a_nodes_share_counts_its_spare_not(tmp_path) -> None:
    """Two sources, a share of 2000 bytes each: a's spare and newest fill a's share; its next push still lands."""
    store = CopyStore(str(tmp_path / "held"), 4000, Some("a", "b"), round_now=lambda: 10**6, reach=lambda: 10**18 - 1)
    async with holder(store) as port:
        for step in (5, 10, 15, 20):
            await push(tmp_path, port, "a", 0, step)
            assert kept(store, "a") == ([(0, step - 5), (0, step)] if step > 5 else [(0, 5)])


async def test_an_older_holder_that_takes_no_ask_for_the_step_before_leaves_the_newest_fetched(tmp_path) -> None:
    """An older agent's listener closes on a line it does not know (client/witness.py): the newest is fetched as
    before, nothing else."""
    store = make_store(tmp_path)

    async def older(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if wire.is_copy_request(line) and not line.startswith(b"rdzv-agent fetch-before "):
                await store.serve(line, reader, writer)
        finally:
            writer.close()
    async with holder(store) as port:
        for step in (5, 10):
            await push(tmp_path, port, "a", 0, step)
    dest = str(tmp_path / "dest")
    os.makedirs(dest)
    async with loopback_server(older) as port:
        got = await asyncio.wait_for(client.fetch_ranks("127.0.0.1", port, KEY, "a", {0: dest}, None, WAIT, None),
                                     WAIT)
    assert [r.step for r in got] == [10] and snapshot.steps(dest) == [10]


async def test_a_lone_losss_taker_fetches_no_spare_one_lost_with_another_does(tmp_path, monkeypatch) -> None:
    """A spare doubles what a taker fetches while its workers wait: only where another gone node's copies are
    wanted in the round too (their newest may be a snapshot apart), never for a node lost alone."""
    from protocol.messages import Witness
    from tests.unit.test_copies_agent import agent_side, assignment
    asked: list[bool] = []

    async def fake_fetch_ranks(*args, **kwargs) -> list[client.FetchResult]:
        bound = inspect.signature(client.fetch_ranks).bind(*args, **kwargs)
        bound.apply_defaults()
        asked.append(bound.arguments["spares"])
        return [client.FetchResult(None, "none held", 0)]

    monkeypatch.setattr("node_agent.copies.peers.fetch_ranks", fake_fetch_ranks)
    at = Witness(addr="127.0.0.1", port=9)
    # y wanted as well: lost with x (fetched in the round too), or in an earlier round (a review: its fetch not
    # ended, it is wanted still, and a lone loss soon after fetched a spare); None: an older server's round
    for wanted, moving, spares, fetched in ((("x",), (), False, None), (("x", "m"), ("m",), False, None),
                                            (("x", "y"), (), True, None), (("x", "y"), (), True, ("x", "y")),
                                            (("x", "y"), (), False, ("x",))):
        copies, dirs = agent_side(tmp_path / f"{'-'.join(wanted)}-{len(fetched or ())}", "b", [])
        a = assignment((), copies_of="x", copies_at=at)
        a = type(a)(**{**{f: getattr(a, f) for f in a.__struct_fields__}, "copies_wanted": wanted,
                       "copies_moving": moving, "copies_fetched": fetched})
        await copies.before_spawn(a, dirs)
        await copies.fetched()
        assert asked[-1] is spares, (wanted, moving, fetched, asked)


@contextlib.asynccontextmanager
async def lost_spare_held(tmp_path, limit: int) -> AsyncIterator[tuple[CopyStore, int]]:
    """A holder of `limit` bytes with a lost node's rank 0 at steps 3 (its spare) and 8, its sources a and b now."""
    sources = Some("lost")
    store = CopyStore(str(tmp_path / "held"), limit, sources, round_now=lambda: 10**6, reach=lambda: 10**18 - 1)
    async with holder(store) as port:
        for step in (3, 8):
            await push(tmp_path, port, "lost", 0, step)
        sources.nodes = {"a", "b"}
        yield store, port


async def test_a_pushers_share_full_with_its_own_spares_takes_no_other_nodes_spare(tmp_path) -> None:
    """A hostile re-review: a's two ranks' spares and newest fill a's share (3000 of 6000 bytes, room enough in
    all); a's next push needs only a's own spare gone, yet every spare went, the lost node's (its place's fetch may
    want it) with them. Only what makes the push fit goes, the pusher's first."""
    async with lost_spare_held(tmp_path, 6000) as (store, port):
        for step in (5, 10):
            for rank in (0, 1):
                await push(tmp_path, port, "a", rank, step, size=750)
        assert kept(store, "lost") == [(0, 3), (0, 8)] and len(kept(store, "a")) == 4
        await push(tmp_path, port, "a", 0, 15, size=750)
        assert kept(store, "lost") == [(0, 3), (0, 8)], "a lost node's spare went for another node's share"
        assert (0, 15) in kept(store, "a")


async def test_a_push_the_file_systems_reserve_refuses_anyway_takes_no_spare(tmp_path, monkeypatch) -> None:
    """Spares go for a push only where their going makes it fit: one the reserve refuses whatever goes (a holder
    of a node's token can send such a size at will) leaves every spare in place."""
    store = make_store(tmp_path)
    async with holder(store) as port:
        for step in (5, 10):
            await push(tmp_path, port, "a", 0, step)
        monkeypatch.setattr(copies_files, "space", lambda path: (10**6, 10**7))     # 10% free: under the reserve
        done = await client.push("127.0.0.1", port, key=KEY, node_id="b", local_rank=0, step=5,
                                 path=snap(tmp_path, "b-5", blob(1000)))
        assert not done.ok and "free" in done.reason, done
        assert kept(store, "a") == [(0, 5), (0, 10)], "a spare went for a push refused anyway"


def dir_bytes(where: str) -> int:
    return sum(os.path.getsize(os.path.join(where, f"step-{step}")) for step in snapshot.steps(where))


async def test_a_spare_fits_the_ranks_limit_beside_all_its_directory_holds(tmp_path) -> None:
    """A hostile re-review: rank 0's newest (75) came before the ranks were fetched again at their common step (70),
    so its directory held both; the spare's room counted only the step, and the directory went to 3000 bytes over
    a limit of 2500. The room is the limit less all the rank's directory holds."""
    store = make_store(tmp_path)
    async with holder(store) as port:
        for step in (65, 70):
            for rank in (0, 1):
                await push(tmp_path, port, "a", rank, step)
        await push(tmp_path, port, "a", 0, 75)
        dirs = {rank: str(tmp_path / f"r{rank}") for rank in (0, 1)}
        for where in dirs.values():
            os.makedirs(where)
        got = await asyncio.wait_for(client.fetch_ranks("127.0.0.1", port, KEY, "a", dirs, 2500, WAIT, None), WAIT)
    assert [r.step for r in got] == [70, 70]
    held = [dir_bytes(where) for where in dirs.values()]
    assert max(held) <= 2500, (held, [snapshot.steps(w) for w in dirs.values()])


async def test_no_spare_of_an_older_round_than_the_step_it_is_asked_below(tmp_path) -> None:
    """A hostile re-review: round 1's 70 and 75 held; the job went back to 70 in round 2, whose 75 never landed here
    (pushes skip to the newest) and whose 80 did. Round 1's 75 stayed as the spare (settle keeps the common step
    before) and a fetch-before 80 served it: a step of the abandoned line beside round 2's, which survivors hold
    as round 2's 75 (a taker resuming there mixes two lines). A spare is of its newest's round or none."""
    store = make_store(tmp_path)
    async with holder(store) as port:
        for step, round_id in ((70, 1), (75, 1), (80, 2)):
            done = await client.push("127.0.0.1", port, key=KEY, node_id="a", local_rank=0, step=step,
                                     round_id=round_id, path=snap(tmp_path, f"a-{step}", blob(1000, seed=step)))
            assert done.ok, done
        dest = str(tmp_path / "dest")
        os.makedirs(dest)
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id="a", local_rank=0, dest_dir=dest, step=80,
                                 before=True)
        assert got.step is None, got
        for step, round_id in ((85, 2), (90, 2)):
            done = await client.push("127.0.0.1", port, key=KEY, node_id="a", local_rank=0, step=step,
                                     round_id=round_id, path=snap(tmp_path, f"a-{step}", blob(1000, seed=step)))
            assert done.ok, done
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id="a", local_rank=0, dest_dir=dest, step=90,
                                 before=True)
    assert got.step == 85, "a spare of the same round is served"


async def test_a_push_the_limit_refuses_anyway_takes_no_spare(tmp_path) -> None:
    """A hostile re-review: 4000 bytes, the lost node's spare and newest 2000 of them, b's push of 2000 under way
    (reserved). a's push of 2000 needs 2000 freed: the lost node's spare (1000) went, nothing else could, and the
    push was refused all the same. Spares go only where the push then fits."""
    async with lost_spare_held(tmp_path, 4000) as (store, port):
        async with connection(port) as (reader, writer):
            writer.write(header(5, 2000, node="b"))
            assert await line_of(reader) == GO      # b's push under way: 2000 bytes reserved
            done = await client.push("127.0.0.1", port, key=KEY, node_id="a", local_rank=0, step=5,
                                     path=snap(tmp_path, "a-5", blob(2000)))
            assert not done.ok and "limit" in done.reason, done
        assert kept(store, "lost") == [(0, 3), (0, 8)], "a spare went for a push refused anyway"
