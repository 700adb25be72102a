"""What a holder takes from a peer that has a node's token (issue 53): only that node's ranks, rounds that are not
older than the node's newest held nor past the holder's own, steps the job has reached, its share of the limit; a
newer round's copy supersedes an older round's; a flood of refusals is a few log lines. And a fetcher takes only
the step it asked for. A real store behind a loopback listener (tests/unit/test_copy_store.py's)."""
from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from node_agent.copies import client, stream, wire
from node_agent.copies.store import CopyStore
from protocol.messages import CopySource
from tests.unit.test_copy_store import FAR, KEY, NODE, SAID, blob, header, holder, raw_push, snap, troubles

pytestmark = pytest.mark.asyncio


def store_of(tmp_path, *, ranks: int = 2, round_now: int = 5, reach: list[int] | None = None,
             sources: tuple[str, ...] = (NODE,), limit: int = 2**20, said: list[str] | None = None) -> CopyStore:
    reached = reach if reach is not None else [FAR]
    said = said if said is not None else []
    tokens = {n: CopySource(node_id=n, token=KEY, ranks=ranks) for n in sources}
    store = CopyStore(str(tmp_path / "held"), limit, tokens, said.append, round_now=lambda: round_now,
                      reach=lambda: reached[0])
    SAID[store] = said
    return store


async def send(port: int, tmp_path, *, step: int, round_id: int, rank: int = 0, node: str = NODE,
               size: int = 100) -> client.PushResult:
    return await client.push("127.0.0.1", port, key=KEY, node_id=node, local_rank=rank, step=step, round_id=round_id,
                             path=snap(tmp_path, f"s-{node}-{rank}-{step}-{round_id}", blob(size, step)))


async def test_a_source_stores_only_its_own_ranks(tmp_path) -> None:
    store = store_of(tmp_path, ranks=1)
    async with holder(store) as port:
        assert (await send(port, tmp_path, step=1, round_id=1)).ok
        for rank in (1, 7, 4095):
            done = await send(port, tmp_path, step=1, round_id=1, rank=rank)
            assert done.reason == f"refused: \"rank {rank} is not one of node {NODE}'s 1 local ranks\"", done
    assert store.held() == {(NODE, 0): 1} and troubles(store) == {"rank"}


async def test_a_round_past_the_holders_own_is_refused_and_an_older_one_than_held_is_stale(tmp_path) -> None:
    store = store_of(tmp_path, round_now=5)
    async with holder(store) as port:
        ahead = await send(port, tmp_path, step=1, round_id=6)
        assert ahead.reason == "refused: \"round 6 is past this node's round (5): tried again later\""
        assert (await send(port, tmp_path, step=20, round_id=4)).ok
        assert (await send(port, tmp_path, step=10, round_id=5)).ok       # a newer round: supersedes step 20
        assert store.held() == {(NODE, 0): 10}
        old = await send(port, tmp_path, step=30, round_id=4, rank=1)     # the older incarnation, on any rank
        assert old.reason == "refused: \"stale round 4 (holding copies of round 5)\""
        same = await send(port, tmp_path, step=10, round_id=5)
        assert same.reason == "refused: \"stale step 10 (holding 10 of round 5)\""


async def test_a_newer_rounds_copy_supersedes_the_older_rounds_at_its_step_or_later_on_every_rank(tmp_path) -> None:
    """Round 2 left step 15 on both ranks and 25 on rank 0 (the node lost mid-push, say); the job went back to 15 in
    round 3 and saved 20: round 2's 25 is of an abandoned run of steps (25 comes again, other bytes) and goes; its
    15s, older than where round 3 started, stay the node's common step until round 3's steps are whole."""
    store = store_of(tmp_path)
    async with holder(store) as port:
        for rank in (0, 1):
            assert (await send(port, tmp_path, step=15, round_id=2, rank=rank)).ok
        assert (await send(port, tmp_path, step=25, round_id=2, rank=0)).ok
        assert (await send(port, tmp_path, step=20, round_id=3, rank=0)).ok
        assert store.held() == {(NODE, 0): 20, (NODE, 1): 15}
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(tmp_path),
                                 step=15)
        assert got.step == 15
        gone = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(tmp_path),
                                  step=25)
        assert gone.step is None and gone.reason == "no copy held"


async def test_a_step_beyond_what_the_job_reached_is_refused_and_one_reached_meanwhile_lands(tmp_path) -> None:
    reach = [40]
    store = store_of(tmp_path, reach=reach)
    store.ahead_wait_s = 0.3
    async with holder(store) as port:
        frozen = await send(port, tmp_path, step=wire.MAX_STEP, round_id=5)      # a holder of the token, say
        assert frozen.reason == "refused: \"step 999999999999999999 is past what the job has reached (this node's " \
                                "ranks hold 40)\"" and frozen.sent == 0
        assert store.held() == {}
        store.ahead_wait_s = 10.0
        coming = asyncio.ensure_future(send(port, tmp_path, step=45, round_id=5))
        await asyncio.sleep(0.1)
        assert not coming.done()               # it waits for this node's own ranks to save step 45
        reach[0] = 45
        assert (await asyncio.wait_for(coming, 10)).ok and store.held() == {(NODE, 0): 45}
        assert (await send(port, tmp_path, step=45, round_id=5, rank=1)).ok


async def test_each_source_has_its_share_of_the_limit(tmp_path) -> None:
    store = store_of(tmp_path, sources=("node-a", "node-b"), limit=1000)
    async with holder(store) as port:
        assert (await send(port, tmp_path, step=1, round_id=1, node="node-a", size=300)).ok
        over = await send(port, tmp_path, step=1, round_id=1, node="node-a", rank=1, size=300)
        assert over.reason.startswith("refused: \"memory limit full: node node-a's share full: 300 bytes held"), over
        assert "its share is 500 bytes" in over.reason
        assert (await send(port, tmp_path, step=1, round_id=1, node="node-b", size=500)).ok


async def test_refusals_from_many_addresses_are_a_line_per_kind_not_a_line_each(tmp_path) -> None:
    said: list[str] = []
    store = store_of(tmp_path, said=said)
    async with holder(store) as port:
        for i in range(2, 52):                 # 50 sources, each its own loopback address
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(f"127.0.0.{i}", 0))
            writer.write(header(1, 10, node=".."))
            assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"rdzv-agent refused bad request")
            writer.close()
    assert troubles(store) == {"bad_request"}
    assert len([line for line in said if "bad_request" in line]) == 1, said


async def test_a_fetch_at_a_step_answered_with_another_takes_nothing(tmp_path) -> None:
    async def liar(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(wire.copy_line(15, 3) + b"abc" + wire.trailer_line("0" * 64))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(liar, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(tmp_path),
                                 step=10)
    finally:
        server.close()
        await server.wait_closed()
    assert got.step is None and got.reason == "asked for step 10, answered with step 15"
    assert os.listdir(tmp_path) == []


async def test_a_push_of_the_older_wire_without_a_round_is_refused_naming_the_field(tmp_path) -> None:
    async with holder(store_of(tmp_path)) as port:
        answer = await raw_push(port, header(1, 10).replace(b" round=0", b""))
    assert answer[0].startswith(b"rdzv-agent refused bad request: push wants the fields key= node= rank= step= size= "
                                b"round=")


async def test_a_push_waiting_for_a_step_never_reached_holds_up_no_real_push_of_that_rank(tmp_path) -> None:
    store = store_of(tmp_path, reach=[40])
    store.ahead_wait_s = 1.5
    async with holder(store) as port:
        frozen = asyncio.ensure_future(send(port, tmp_path, step=wire.MAX_STEP, round_id=5))
        deadline = asyncio.get_running_loop().time() + 10.0    # the wait seen begun: no sleep a loaded host outruns
        while not store._waiting.get(NODE):
            assert not frozen.done() and asyncio.get_running_loop().time() < deadline, "the far push never waited"
            await asyncio.sleep(0.01)
        assert (await send(port, tmp_path, step=40, round_id=5)).ok          # the node's own: lands meanwhile
        assert (await asyncio.wait_for(frozen, 10)).reason.startswith("refused: \"step 999999999999999999 is past")
    assert store.held() == {(NODE, 0): 40}


async def test_one_push_a_rank_waits_for_the_jobs_step_an_older_is_refused_a_newer_takes_its_place(tmp_path):
    """A node's pushes of steps the job has not reached each hold a connection at work: one per rank waits, so a
    node cannot fill the holder's listener with them (a review's 512 such pushes shut its witness out). A push of
    the same or a newer step ends the one waiting (a restarted agent's, whose predecessor's connection died)."""
    reach = [40]
    store = store_of(tmp_path, reach=reach, ranks=2)
    store.ahead_wait_s = 10.0
    async with holder(store) as port:
        first = asyncio.ensure_future(send(port, tmp_path, step=45, round_id=5))
        while not store._waiting.get(NODE):           # (the store's own record: no sleep standing in for it)
            assert not first.done(), first.result()
            await asyncio.sleep(0.01)
        older = await asyncio.wait_for(send(port, tmp_path, step=44, round_id=5), 5)
        assert older.reason == "refused: \"busy: a push of this rank already waits for the job to reach its step\""
        newer = asyncio.ensure_future(send(port, tmp_path, step=46, round_id=5))
        ended = await asyncio.wait_for(first, 5)                # without waiting for the job: ended at once
        assert not ended.ok, ended
        other = asyncio.ensure_future(send(port, tmp_path, step=45, round_id=5, rank=1))     # another rank waits
        while len(store._waiting.get(NODE, {})) < 2:
            assert not newer.done() and not other.done()
            await asyncio.sleep(0.01)
        reach[0] = 46
        assert (await asyncio.wait_for(newer, 10)).ok and (await asyncio.wait_for(other, 10)).ok
        store.ahead_wait_s = 0.2              # the rank's wait is over: the next push of it may wait again
        assert (await send(port, tmp_path, step=47, round_id=5)).reason.startswith("refused: \"step 47 is past")
    assert store.held() == {(NODE, 0): 46, (NODE, 1): 45} and store._waiting == {}


async def test_the_newest_fetch_of_a_rank_is_served_and_an_older_slow_one_ends(tmp_path) -> None:
    """A fetcher that reads slowly keeps the copy it was sent alive after a newer one replaced it (a /dev/shm file
    outside the limit): a newer fetch of the same rank ends it."""
    store = store_of(tmp_path, limit=96 << 20)
    data = blob(32 << 20, 3)               # more than loopback's socket buffers hold
    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=3, round_id=5,
                                  path=snap(tmp_path, "big", data))).ok
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(wire.fetch_line(wire.FetchRequest(KEY, NODE, 0)))
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"rdzv-agent copy ")   # then reads no more
        assert (NODE, 0) in store._sending               # (set before the answer line was written)
        dest = tmp_path / "dest"
        dest.mkdir()
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(dest))
        assert got.step == 3 and (dest / "step-3").read_bytes() == data
        received = 0
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):
                received += len(chunk)
        assert received < len(data)                                                 # the older one was ended
        writer.close()


async def test_a_loop_of_fetches_of_one_rank_holds_two_connections_at_work_not_the_cap(tmp_path, monkeypatch) -> None:
    """A member fetching its copy in a loop, reading nothing: each newer fetch ended the older, but an older one
    ends only once its read of the file (in a thread) returns, so they piled up at work: a review's loop of them
    filled an agent's cap of 64 and its other peers' pushes were refused. While an older one is ending, a newer
    fetch of the rank is refused at once. Here every read of the file waits until released: the ended one cannot
    end meanwhile."""
    import threading
    store = store_of(tmp_path, limit=96 << 20)
    release = threading.Event()
    real = stream._read_and_hash

    def held_read(digest, fd: int, n: int, offset: int) -> bytes:
        release.wait(10)
        return real(digest, fd, n, offset)

    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=3, round_id=5,
                                  path=snap(tmp_path, "big", blob(4 << 20, 3)))).ok
        monkeypatch.setattr(stream, "_read_and_hash", held_read)
        conns = []
        try:
            answers = []
            for _ in range(8):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                conns.append(writer)
                writer.write(wire.fetch_line(wire.FetchRequest(KEY, NODE, 0)))
                answers.append(await asyncio.wait_for(reader.readline(), 5))
            assert [a.split(b" step=")[0] for a in answers[:2]] == [b"rdzv-agent copy"] * 2, answers
            assert answers[2:] == [b"rdzv-agent refused busy: a fetch of this rank is still ending\n"] * 6, answers
        finally:
            release.set()
            for writer in conns:
                writer.close()


async def test_a_fetch_answered_busy_asks_again_while_the_older_one_ends(tmp_path, monkeypatch) -> None:
    """"busy" (an older fetch of the rank, ended, still ending) is asked again after a back-off, not taken for a
    failed fetch: that would send the fetching node's ranks, and with them every rank, to disk. Here the back-off
    is where the older fetch ends."""
    store = store_of(tmp_path, limit=96 << 20)
    slot = (NODE, 0)
    waits = []

    async def older_ends() -> None:
        waits.append("back-off")
        store._ending.discard(slot)

    async def never_ends() -> None:
        waits.append("back-off")

    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=3, round_id=5,
                                  path=snap(tmp_path, "s", blob(1 << 16, 3)))).ok
        store._ending.add(slot)
        monkeypatch.setattr(client, "_busy_back_off", older_ends)
        dest = tmp_path / "fetched"
        dest.mkdir()
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(dest))
        assert got.step == 3 and waits == ["back-off"], (got, waits)
        store._ending.add(slot)                    # never ends: a bounded number of asks, then a failed fetch
        monkeypatch.setattr(client, "_busy_back_off", never_ends)
        again = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(dest))
        assert again.step is None and "stayed busy" in again.reason and len(waits) == 1 + (client.FETCH_BUSY_TRIES - 1)
