"""A node's own snapshots served to the node taking its place while it lives (node_agent/copies/own.py): fetched
with the node's own token from its ranks' memory directories, by step or the newest; a wrong or missing token gets
nothing, a drop of them is answered and leaves them, a push in its name is refused, and a snapshot written over
while it is sent is refused rather than passed on. A real store behind a loopback listener
(tests/unit/test_copy_store.py's)."""
from __future__ import annotations

import os
import ssl

from node_agent.copies import client
from node_agent.copies.own import OwnSnapshots
from node_agent.copies.store import CopyStore
from node_agent.training import fetched, snapshot
from tests.unit.test_copy_store import FAR, KEY, Everyone, blob, holder, snap, tls_of_nodes_and_stranger

ME = "suspect"
MINE = "suspect-copy-token-0123"


def setup(tmp_path, key: str = MINE, said: list[str] | None = None
          ) -> tuple[CopyStore, dict[int, str], dict[tuple[int, int], bytes]]:
    """A node of 2 local ranks holding steps 4 and 6 each (as `protect` leaves them)."""
    dirs = {rank: str(tmp_path / f"mem-{rank}") for rank in (0, 1)}
    data = {}
    for rank, where in dirs.items():
        os.makedirs(where)
        for step in (4, 6):
            data[rank, step] = blob(70_000 + rank, seed=step * 10 + rank)
            snapshot.save(data[rank, step], step, where=where)
    own = OwnSnapshots(ME, key=lambda: key, dirs=lambda: dirs)
    say = (said if said is not None else []).append
    store = CopyStore(str(tmp_path / "held"), 64 * 2**20, Everyone(lambda: KEY), say, round_now=lambda: 10**6,
                      reach=lambda: FAR, own=own)
    return store, dirs, data


async def fetch(port: int, tmp_path, rank: int, *, key: str = MINE, step: int | None = None,
                tls: ssl.SSLContext | None = None) -> tuple[client.FetchResult, bytes]:
    dest = tmp_path / f"dest-{rank}-{step}-{key[:4]}-{id(tls)}"
    dest.mkdir()
    got = await client.fetch("127.0.0.1", port, key=key, node_id=ME, local_rank=rank, dest_dir=str(dest), step=step,
                             tls=tls, timeout_s=5.0)
    return got, (dest / f"step-{got.step}").read_bytes() if got.step is not None else b""


async def test_the_newest_or_a_named_step_of_each_rank_is_fetched_with_the_nodes_own_token(tmp_path):
    said: list[str] = []
    store, _, data = setup(tmp_path, said=said)
    async with holder(store) as port:
        for rank in (0, 1):
            got, back = await fetch(port, tmp_path, rank)
            assert got.step == 6 and back == data[rank, 6], got
            # marked a copy: agreed_step counts the rank behind replicas holding newer steps (training/fetched.py)
            assert fetched.is_copy(str(tmp_path / f"dest-{rank}-None-{MINE[:4]}-{id(None)}"), 6)
        got, back = await fetch(port, tmp_path, 1, step=4)
        assert got.step == 4 and back == data[1, 4], got
        got, _ = await fetch(port, tmp_path, 0, step=5)
        assert got.step is None, got                       # a step it does not hold
        got, _ = await fetch(port, tmp_path, 2)
        assert got.step is None, got                       # a rank it does not have
    assert store.held() == {} and not any("refused" in line for line in said)   # from memory, nothing stored
    assert said[:2] == ["sent local rank 0's snapshot of step 6 (0.1 MiB) to 127.0.0.1, the node taking this "
                        "node's place", "sent local rank 1's snapshot of step 6 (0.1 MiB) to 127.0.0.1, the node "
                        "taking this node's place"], said


async def test_over_tls_the_node_taking_its_place_fetches_them_and_a_stranger_gets_nothing(tmp_path):
    """Nodes started with --tls-cert serve their own snapshots over the same mutual TLS as held copies."""
    ours, stranger = tls_of_nodes_and_stranger(tmp_path)
    store, _, data = setup(tmp_path)
    async with holder(store, ours.listen) as port:
        got, back = await fetch(port, tmp_path, 1, tls=ours.connect)
        assert got.step == 6 and back == data[1, 6], got
        for tls in (None, stranger.connect):       # in the clear, or signed by another CA: no handshake, nothing
            got, back = await fetch(port, tmp_path, 1, tls=tls)
            assert got.step is None and back == b"", got


async def test_a_wrong_or_missing_token_gets_nothing(tmp_path):
    store, _, _ = setup(tmp_path)
    async with holder(store) as port:
        got, _ = await fetch(port, tmp_path, 0, key=KEY)   # another node's token
        assert got.step is None and "wrong key" in got.reason, got
    store, _, _ = setup(tmp_path / "none", key="")         # a node that has no token: serves nothing
    async with holder(store) as port:
        got, _ = await fetch(port, tmp_path, 0)
        assert got.step is None and "wrong key" in got.reason, got


async def test_a_drop_leaves_them_and_a_push_in_the_nodes_name_is_refused(tmp_path):
    store, dirs, data = setup(tmp_path)
    async with holder(store) as port:
        await client.drop("127.0.0.1", port, key=MINE, node_id=ME, timeout_s=5.0)
        assert [snapshot.steps(where) for where in dirs.values()] == [[4, 6], [4, 6]]
        pushed = await client.push("127.0.0.1", port, key=MINE, node_id=ME, local_rank=0, step=9,
                                   path=snap(tmp_path, "forged", b"x" * 100))
        assert not pushed.ok and "wrong key" in pushed.reason, pushed
        assert snapshot.steps(dirs[0]) == [4, 6] and store.held() == {}
        got, back = await fetch(port, tmp_path, 0)
        assert got.step == 6 and back == data[0, 6]


async def test_a_snapshot_written_over_while_it_is_sent_is_refused(tmp_path, monkeypatch):
    store, dirs, _ = setup(tmp_path)
    path = snapshot.path(6, dirs[0])
    real = __import__("node_agent.copies.stream", fromlist=["send"]).send

    async def send_then_recycle(*args, **kwargs):
        sent = await real(*args, **kwargs)
        os.rename(path, path + ".tmp")      # what a running rank does before it writes a newer step into it
        return sent

    monkeypatch.setattr("node_agent.copies.stream.send", send_then_recycle)
    async with holder(store) as port:
        got, _ = await fetch(port, tmp_path, 0)
    assert got.step is None and "changed while it was sent" in got.reason, got


async def test_a_snapshot_sent_to_the_node_taking_its_place_has_a_second_name_meanwhile(tmp_path, monkeypatch):
    """(files.pin, as for a push): a running rank writes its next snapshots over other files meanwhile."""
    store, dirs, data = setup(tmp_path)
    real = __import__("node_agent.copies.stream", fromlist=["send"]).send
    links = []

    async def send(writer, fd, *args, **kwargs):
        links.append(os.fstat(fd).st_nlink)
        return await real(writer, fd, *args, **kwargs)

    monkeypatch.setattr("node_agent.copies.stream.send", send)
    async with holder(store) as port:
        got, back = await fetch(port, tmp_path, 0)
    assert got.step == 6 and back == data[0, 6] and links == [2]
    assert not [n for n in os.listdir(dirs[0]) if n.startswith(snapshot.SENDING)]


async def test_a_next_agent_serves_the_memory_it_took_up_with_the_token_its_predecessor_kept(tmp_path):
    """A member back with another number of workers waits as the spare, its agent in no round yet: it serves its
    predecessor's memory (its rank directories, 0 and 1) with the token that agent kept there (a review: refused
    for want of a key, the spare taking its place resumed from the older peer copy)."""
    from node_agent.copies.own import keep_token, left_dirs, left_key
    root = tmp_path / "node"
    data = {}
    for rank in (0, 1):
        (root / str(rank)).mkdir(parents=True)
        data[rank] = blob(50_000, seed=rank)
        snapshot.save(data[rank], 35, where=str(root / str(rank)))
    (root / "copies").mkdir()                           # what it holds for others: no rank's
    keep_token(str(root), MINE)
    assert os.stat(root / "copy-token").st_mode & 0o777 == 0o600 and left_key(str(root)) == MINE
    assert left_dirs(str(root)) == {0: str(root / "0"), 1: str(root / "1")}
    own = OwnSnapshots(ME, key=lambda: left_key(str(root)), dirs=lambda: left_dirs(str(root)))
    store = CopyStore(str(tmp_path / "held"), 2**20, Everyone(lambda: KEY), round_now=lambda: 1, reach=lambda: FAR,
                      own=own)
    async with holder(store) as port:
        for rank in (0, 1):
            got, back = await fetch(port, tmp_path, rank)
            assert got.step == 35 and back == data[rank], got
        got, _ = await fetch(port, tmp_path, 0, key="another-token-000000")
        assert got.step is None, got
    assert left_key(str(tmp_path / "none")) == "" and left_dirs(str(tmp_path / "none")) == {}
