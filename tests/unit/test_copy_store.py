"""Snapshot copies between agents (node_agent/copies): the wire's lines, the holder's store behind a real
loopback listener, the pushing and fetching client, and a raw-socket client that uses none of our client."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import re
import socket
import ssl
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from node_agent.copies import client, stream, wire
from node_agent.copies import files as copies_files
from node_agent.copies.store import CopyStore
from node_agent.copies.wire import GO, FetchRequest, PushRequest, WireError
from protocol.messages import CopySource
from protocol.tokens import copy_verifier
from tests.ports import loopback_server

KEY = "job-7_replica-key-0123"
NODE = "node-a"
WAIT = 10.0        # a bound on each await, so a broken server fails the test rather than hanging it


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def sha(data: bytes) -> bytes:
    return b"sha256=%s\n" % hashlib.sha256(data).hexdigest().encode()


def header(step: int, size: int, *, node: str = NODE, rank: int = 0, key: str = KEY, round_id: int = 0) -> bytes:
    return b"rdzv-agent push key=%s node=%s rank=%d step=%d size=%d round=%d\n" % (
        key.encode(), node.encode(), rank, step, size, round_id)


def snap(directory, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


class Everyone:
    """Sources for a holder: every node, with `key()` as its token (a node of any ranks)."""
    def __init__(self, key: Callable[[], str]) -> None:
        self.key = key

    def get(self, node: str) -> CopySource | None:
        return CopySource(node_id=node, token=self.key()) if self.key() else None

    def __len__(self) -> int:
        return 1


FAR = 10**18 - 1       # a holder whose own ranks are that far: no push is ahead of the job


SAID: weakref.WeakKeyDictionary[CopyStore, list[str]] = weakref.WeakKeyDictionary()


def make_store(tmp_path, limit: int = 64 * 2**20, key: str = KEY, said: list[str] | None = None) -> CopyStore:
    said = said if said is not None else []
    store = CopyStore(str(tmp_path / "held"), limit, Everyone(lambda: key), said.append, round_now=lambda: 10**6,
                      reach=lambda: FAR)
    SAID[store] = said
    return store


def troubles(store: CopyStore) -> set[str]:
    """The kinds of trouble the store's log named (each said once a minute: the kinds, not how many)."""
    return {m.group(1) for line in SAID[store] for m in [re.search(r"this kind: (\w+)", line)] if m}


@contextlib.asynccontextmanager
async def holder(store: CopyStore, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """A tiny listener as the agent's: read the first line, hand copy requests to the store, close."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(OSError):        # a TLS handshake refused: nothing to serve
                line = await reader.readline()
                if wire.is_copy_request(line):
                    await store.serve(line, reader, writer)
        finally:
            writer.close()

    async with loopback_server(handle, tls) as port:
        yield port


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def line_of(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readline(), WAIT)


async def raw_push(port: int, head: bytes, body: bytes = b"", trailer: bytes | None = None,
                   eof: bool = False) -> list[bytes]:
    """A hand-written pusher: the header, then (after `go`) body and trailer as given; the lines answered."""
    async with connection(port) as (reader, writer):
        writer.write(head)
        first = await line_of(reader)
        if first != GO:
            return [first]
        writer.write(body + (trailer or b""))
        if eof:
            writer.write_eof()
        await writer.drain()
        return [first, await line_of(reader)]


async def fetch_bytes(port: int, tmp_path, node: str = NODE, rank: int = 0) -> tuple[client.FetchResult, bytes]:
    dest = tmp_path / f"dest-{random.random()}"
    dest.mkdir()
    got = await client.fetch("127.0.0.1", port, key=KEY, node_id=node, local_rank=rank, dest_dir=str(dest))
    assert not [n for n in os.listdir(dest) if n.endswith(".tmp")]
    data = (dest / f"step-{got.step}").read_bytes() if got.step is not None else b""
    return got, data


def exists(path: str) -> bool:
    return os.path.exists(path)


def flip(path: str, at: int) -> None:
    """Corrupt one byte of a file in place, as memory or a disk might."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def files(store: CopyStore, node: str = NODE, rank: int = 0) -> list[str]:
    where = os.path.join(store.root, node, str(rank))
    return sorted(os.listdir(where)) if os.path.isdir(where) else []


# --- the wire, pure ------------------------------------------------------------------------------------------

def test_lines_round_trip_and_answers_parse():
    push = PushRequest(KEY, "n:1@x", 4095, 10**18 - 1, 2**40)
    assert wire.parse_request(wire.push_line(push)) == push
    fetch = FetchRequest(KEY, "n.1", 0)
    assert wire.parse_request(wire.fetch_line(fetch)) == fetch
    assert wire.is_copy_request(wire.push_line(push)) and wire.is_copy_request(wire.fetch_line(fetch))
    assert not wire.is_copy_request(b"rdzv-agent ask round=3\n")
    assert wire.parse_answer(GO).kind == "go" and wire.parse_answer(wire.NONE).kind == "none"
    assert wire.parse_answer(wire.stored_line(7)) == wire.Answer("stored", step=7)
    assert wire.parse_answer(wire.copy_line(7, 99)) == wire.Answer("copy", step=7, size=99)
    assert wire.parse_answer(wire.refused_line("no\nway\x00" + "x" * 300)).reason == "no?way?" + "x" * 193
    hexd = hashlib.sha256(b"a").hexdigest()
    assert wire.parse_trailer(wire.trailer_line(hexd)) == hexd
    for bad in (b"rdzv-agent copy step=1 size=%d\n" % (2**40 + 1), b"rdzv-agent stored step=01\n", b"go\n",
                b"rdzv-agent refused \n", b"rdzv-agent go"):
        with pytest.raises(WireError):
            wire.parse_answer(bad)
    for bad in (b"sha256=" + hexd.upper().encode() + b"\n", b"sha256=abc\n", sha(b"a")[:-1]):
        with pytest.raises(WireError, match="bad trailer"):
            wire.parse_trailer(bad)


@pytest.mark.parametrize(("line", "field"), [
    (header(1, 1, node=".."), "bad node"),
    (header(1, 1, node="a/b"), "bad node"),
    (header(1, 1, node="x" * 129), "bad node"),
    (header(1, 1, node=""), "bad node"),
    (header(1, 1, rank=4096), "bad rank"),
    (header(1, 1, key="short"), "bad key"),
    (header(1, 1).replace(b"step=1", b"step=-1"), "bad step"),
    (header(1, 1).replace(b"step=1", b"step=1e3"), "bad step"),
    (header(1, 1).replace(b"step=1", b"step=01"), "bad step"),
    (header(1, 1).replace(b"step=1", b"step=" + b"9" * 19), "bad step"),
    (header(1, 1).replace(b"size=1", b"size=%d" % (2**40 + 1)), "bad size"),
    (header(1, 1).replace(b" size=1", b""), "wants the fields"),
    (header(1, 1).replace(b"rank=", b"rnak="), "wants the field rank="),
    (header(1, 1).replace(b"node=", b"node= "), "wants the fields"),
    (header(1, 1)[:-1], "not ended by a newline"),
    (header(1, 1, node="n" * 120).replace(b"key=", b"key=" + b"k" * 400), "longer than 512"),
    (b"rdzv-agent fetch key=%s node=n\xe9 rank=0\n" % KEY.encode(), "not ASCII"),
    (b"rdzv-agent pull key=x\n", "not a peer-copy request"),
])
def test_every_field_is_bounded_and_named(line, field):
    with pytest.raises(WireError, match=field) as caught:
        wire.parse_request(line)
    assert KEY not in str(caught.value)          # the key is never quoted back


def test_our_own_requests_are_checked_before_they_are_sent():
    for bad in (dict(node=".."), dict(rank=-1), dict(step=10**18), dict(size=-5), dict(key="k" * 129)):
        fields = dict(key=KEY, node=NODE, rank=0, step=1, size=1) | bad
        with pytest.raises(WireError):
            PushRequest(**fields)    # type: ignore[arg-type]


def test_pacing_sleeps_what_keeps_the_sender_to_its_rate():
    assert stream.pace(0, 0.0, 100.0) == 0.0
    assert stream.pace(1000, 0.0, 100.0) == 10.0
    assert stream.pace(1000, 4.0, 100.0) == 6.0
    assert stream.pace(1000, 20.0, 100.0) == 0.0         # behind: no sleep, never a negative one
    with pytest.raises(ValueError):
        stream.pace(1, 1.0, 0.0)


# --- the store behind a listener -----------------------------------------------------------------------------

async def test_a_fetch_never_writes_through_a_symlink_named_as_its_file(tmp_path):
    store = make_store(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours\n")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(victim, dest / "step-5.tmp")
    data = blob(1000)
    async with holder(store) as port:
        await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=5,
                          path=snap(tmp_path, "step-5", data))
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(dest))
    assert got.step == 5 and (dest / "step-5").read_bytes() == data
    assert victim.read_bytes() == b"not yours\n"

async def test_a_push_then_a_fetch_returns_the_same_bytes(tmp_path):
    store = make_store(tmp_path)
    data = blob(2 * stream.CHUNK + 12345)        # several chunks
    async with holder(store) as port:
        sent = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=2, step=5,
                                 path=snap(tmp_path, "step-5", data))
        assert sent == client.PushResult(True, "stored step=5", len(data))
        assert store.held() == {(NODE, 2): 5} and store.held_bytes() == len(data)
        got, back = await fetch_bytes(port, tmp_path, rank=2)
    assert got == client.FetchResult(5, "fetched step=5", len(data)) and back == data
    assert troubles(store) == set()
    assert files(store, rank=2) == ["step-5", "step-5.sha256"]
    assert os.stat(store.root).st_mode & 0o777 == 0o700


async def test_a_push_that_trickles_gives_way_to_a_newer_step_of_the_rank(tmp_path):
    """A holder of the node's token sending a byte before each stall bound held the rank's slot for as long as it
    liked ("busy" to every real push): the node's copies froze. A push of a newer step of the rank takes the slot;
    the one under way ends, and nothing of it is left."""
    store = make_store(tmp_path)
    new = blob(70_000, 2)
    async with holder(store) as port:
        async with connection(port) as (reader, writer):
            writer.write(header(2, 1_000_000))
            assert await line_of(reader) == GO
            writer.write(b"x")                      # and nothing more for a while: under the stall bound
            await writer.drain()
            await asyncio.sleep(0.2)
            sent = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=3,
                                     path=snap(tmp_path, "b", new))
            assert sent == client.PushResult(True, "stored step=3", len(new))
            assert await asyncio.wait_for(reader.read(), 10) == b""       # the trickle was let go
        assert store.held() == {(NODE, 0): 3} and files(store) == ["step-3", "step-3.sha256"]


async def test_a_newer_push_replaces_the_copy_only_once_it_is_whole(tmp_path):
    store = make_store(tmp_path)
    old, new = blob(50_000, 1), blob(70_000, 2)
    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=1,
                                  path=snap(tmp_path, "a", old))).ok
        async with connection(port) as (reader, writer):
            writer.write(header(2, len(new)))
            assert await line_of(reader) == GO
            writer.write(new[:30_000])
            await writer.drain()
            # half-way: the old copy is what is held and fetched; the new one is an invisible .tmp
            assert store.held() == {(NODE, 0): 1}
            assert files(store) == ["step-1", "step-1.sha256", "step-2.tmp"]
            got, back = await fetch_bytes(port, tmp_path)
            assert got.step == 1 and back == old
            busy = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=2,
                                     path=snap(tmp_path, "b", new))         # the same step, again: under way
            assert busy == client.PushResult(False, "refused: \"busy\"", 0)
            writer.write(new[30_000:] + sha(new))
            assert await line_of(reader) == b"rdzv-agent stored step=2\n"
        # step 1 stays beside it as a spare while room allows (files.spares): the newest is what a fetch gets
        assert store.held() == {(NODE, 0): 2} and files(store) == ["step-1", "step-1.sha256", "step-2", "step-2.sha256"]
        got, back = await fetch_bytes(port, tmp_path)
    assert got.step == 2 and back == new and troubles(store) == {"busy"}


async def test_a_wrong_key_or_no_key_yet_writes_nothing(tmp_path):
    said: list[str] = []
    key = [""]
    store = CopyStore(str(tmp_path / "held"), 2**20, Everyone(lambda: key[0]), said.append, round_now=lambda: 1,
                         reach=lambda: FAR)
    SAID[store] = said
    path = snap(tmp_path, "s", blob(1000))
    async with holder(store) as port:
        early = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=1, path=path)
        assert early == client.PushResult(False, "refused: \"wrong key\"", 0)    # the same to a stranger
        key[0] = "another-job-key-000"
        for _ in range(2):
            wrong = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=1, path=path)
            assert wrong == client.PushResult(False, "refused: \"wrong key\"", 0)
        got, _ = await fetch_bytes(port, tmp_path)
    assert got == client.FetchResult(None, "refused: \"wrong key\"", 0)
    assert not exists(store.root) and troubles(store) == {"key"}
    assert len(said) == 1 and "no key of node node-a" in said[0] and "key=<hidden>" in said[0]  # once per kind
    assert not any(KEY in s for s in said)


async def test_a_step_not_newer_than_the_held_one_is_stale(tmp_path):
    store = make_store(tmp_path)
    async with holder(store) as port:
        for step, ok in ((5, True), (5, False), (4, False), (6, True)):
            done = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=step,
                                     path=snap(tmp_path, f"s{step}", blob(100, step)))
            assert done.ok is ok
            if not ok:
                assert done.reason == f"refused: \"stale step {step} (holding 5 of round 0)\"" and done.sent == 0
    assert store.held() == {(NODE, 0): 6} and troubles(store) == {"stale"}


async def test_the_limit_counts_the_current_copy_until_it_is_replaced(tmp_path):
    store = make_store(tmp_path, limit=1000)
    async with holder(store) as port:
        async def push(node: str, step: int, size: int) -> client.PushResult:
            return await client.push("127.0.0.1", port, key=KEY, node_id=node, local_rank=0, step=step,
                                     path=snap(tmp_path, f"{node}-{step}", blob(size, step)))
        assert (await push(NODE, 1, 600)).ok
        full = await push(NODE, 2, 600)         # 600 held + 600 new > 1000, though 2 would replace 1
        assert not full.ok and full.reason.startswith("refused: \"memory limit full: 600 bytes held")
        other = await push("node-b", 1, 500)
        assert not other.ok and "limit 1000 bytes" in other.reason
        huge = await push("node-b", 1, 1001)
        assert huge.reason == "refused: \"memory limit full: the copy's 1001 bytes exceed the limit of 1000 bytes\""
        assert (await push(NODE, 2, 400)).ok
        got, back = await fetch_bytes(port, tmp_path)
    assert got.step == 2 and back == blob(400, 2) and troubles(store) == {"limit"}


@pytest.mark.parametrize(("line", "says"), [
    (header(1, 10, node=".."), "bad node: '..'"),
    (header(1, 10, node="a/b"), "bad node: 'a/b'"),
    (header(1, 10, node="x" * 129), "bad node: 'xxx"),
    (header(1, 10).replace(b"step=1", b"step=one"), "bad step: 'one'"),
    (header(1, 10).replace(b"key=", b"key=" + b"k" * 600), "line longer than 512 bytes"),
    (b"rdzv-agent fetch key=%s node=.. rank=0\n" % KEY.encode(), "bad node"),
])
async def test_a_bad_request_is_refused_with_the_field_named(tmp_path, line, says):
    store = make_store(tmp_path)
    async with holder(store) as port:
        answer = await raw_push(port, line)
    assert len(answer) == 1 and answer[0].startswith(b"rdzv-agent refused bad request: ")
    assert says in wire.parse_answer(answer[0]).reason and len(answer[0]) <= wire.MAX_LINE
    assert not exists(store.root) and troubles(store) == {"bad_request"}


async def test_a_hundred_broken_pushes_leave_the_previous_copy_fetchable(tmp_path):
    store = make_store(tmp_path)
    good = blob(20_000, 99)
    rng = random.Random(7)
    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=10,
                                  path=snap(tmp_path, "good", good))).ok
        for i in range(100):
            data = blob(rng.randint(1, 30_000), 1000 + i)
            head = header(11 + i, len(data))
            kind = i % 5
            if kind == 0:                       # one byte flipped on the way
                at = rng.randrange(len(data))
                flipped = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
                answer = await raw_push(port, head, flipped, sha(data))
            elif kind == 1:                     # the stream ends early
                answer = await raw_push(port, head, data[:rng.randrange(len(data))], eof=True)
            elif kind == 2:                     # a trailer for other bytes
                answer = await raw_push(port, head, data, sha(data + b"x"))
            elif kind == 3:                     # a malformed trailer, or bytes past the announced size
                answer = await raw_push(port, head, data, rng.choice([b"sha256=zz\n", b"\x00" * 3 + sha(data)]))
            else:                               # a step that is not newer
                answer = await raw_push(port, header(rng.randint(0, 10), len(data)), data, sha(data))
            assert answer[-1].startswith(b"rdzv-agent refused "), (i, answer)
            assert store.held() == {(NODE, 0): 10} and files(store) == ["step-10", "step-10.sha256"], i
            if i % 10 == 0:
                got, back = await fetch_bytes(port, tmp_path)
                assert got.step == 10 and back == good
        got, back = await fetch_bytes(port, tmp_path)
    assert got.step == 10 and back == good
    assert troubles(store) == {"checksum", "lost", "stale"}


async def test_a_push_cut_off_midway_does_not_mute_a_checksum_mismatch(tmp_path):
    """A pusher lost mid-stream (a network fault) is no corruption: said as a loss, so the corrupt push that follows
    within the minute is still said (each kind is said once a minute)."""
    store = make_store(tmp_path)
    data = blob(20_000, 5)
    async with holder(store) as port:
        cut = await raw_push(port, header(1, len(data)), data[:5000], eof=True)
        flipped = bytes([data[0] ^ 0xFF]) + data[1:]
        corrupt = await raw_push(port, header(2, len(data)), flipped, sha(data))
    assert cut[-1].startswith(b"rdzv-agent refused short stream") and corrupt[-1].startswith(b"rdzv-agent refused ")
    assert troubles(store) == {"lost", "checksum"}, SAID[store]
    assert any("checksum mismatch" in line for line in SAID[store]), SAID[store]


async def test_a_stalled_push_is_given_up_and_cleaned(tmp_path):
    store = make_store(tmp_path)
    store.stall_s = 0.2                          # the holder's own clock; the test waits on its answer
    async with holder(store) as port:
        async with connection(port) as (reader, writer):
            writer.write(header(1, 1000))
            assert await line_of(reader) == GO
            writer.write(b"x" * 10)
            answer = await line_of(reader)
    assert answer.startswith(b"rdzv-agent refused stalled: no bytes for 0.2 s after 10 of 1000")
    assert files(store) == [] and store.held() == {}


async def test_a_copy_corrupted_at_rest_fails_the_fetchers_check_and_is_removed(tmp_path):
    store = make_store(tmp_path)
    data = blob(5000)
    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=1, step=3,
                                  path=snap(tmp_path, "s", data))).ok
        flip(os.path.join(store.root, NODE, "1", "step-3"), 1234)
        got, _ = await fetch_bytes(port, tmp_path, rank=1)
        assert got == client.FetchResult(None, "checksum mismatch", 5000)     # the bytes, then the stored sum
        assert store.held() == {} and files(store, rank=1) == []     # fetch_bytes: and no file at the fetcher
        again, _ = await fetch_bytes(port, tmp_path, rank=1)
    assert again.reason == "no copy held" and troubles(store) == {"corrupt"}


async def test_nothing_held_answers_none_and_other_nodes_are_apart(tmp_path):
    store = make_store(tmp_path)
    async with holder(store) as port:
        got, _ = await fetch_bytes(port, tmp_path)
        assert got == client.FetchResult(None, "no copy held", 0)
        for node in ("n1", "n2"):
            assert (await client.push("127.0.0.1", port, key=KEY, node_id=node, local_rank=0, step=1,
                                      path=snap(tmp_path, node, node.encode() * 10))).ok
        store.remove_node("n1")
        assert store.held() == {("n2", 0): 1}
        assert (await fetch_bytes(port, tmp_path, node="n2"))[1] == b"n2" * 10
        with pytest.raises(WireError):
            store.remove_node("..")
        store.clear()
        assert store.held() == {} and store.held_bytes() == 0 and not exists(store.root)
        assert (await client.push("127.0.0.1", port, key=KEY, node_id="n1", local_rank=0, step=1,
                                  path=snap(tmp_path, "again", b"x"))).ok    # the root is made again


async def test_the_raw_wire_with_plain_sockets(tmp_path):
    """An independent client: blocking sockets and the wire as documented, nothing of client.py."""
    store = make_store(tmp_path)
    data = blob(300_000, 5)

    def speak(port: int) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s, s.makefile("rwb") as f:
            f.write(b"rdzv-agent push key=%s node=host-1.example:29400 rank=3 step=42 size=%d round=7\n"
                    % (KEY.encode(), len(data)))
            f.flush()
            go = f.readline()
            f.write(data + sha(data))
            f.flush()
            stored = f.readline()
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s, s.makefile("rwb") as f:
            f.write(b"rdzv-agent fetch key=%s node=host-1.example:29400 rank=3\n" % KEY.encode())
            f.flush()
            copy = f.readline()
            body = f.read(len(data))
            trailer = f.readline()
            rest = f.read()
        return go, stored, copy, body, trailer, rest

    async with holder(store) as port:
        go, stored, copy, body, trailer, rest = await asyncio.to_thread(speak, port)
    assert go == b"rdzv-agent go\n" and stored == b"rdzv-agent stored step=42\n"
    assert copy == b"rdzv-agent copy step=42 size=%d\n" % len(data)
    assert body == data and trailer == sha(data) and rest == b""     # then the holder closes


# --- the client against fake holders -------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def fake_holder(answer) -> AsyncIterator[int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await answer(await reader.readline(), reader, writer)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_the_fetcher_keeps_nothing_that_does_not_match_its_trailer(tmp_path):
    data = blob(10_000)

    async def lying(line, reader, writer) -> None:
        writer.write(wire.copy_line(8, len(data)) + data + sha(data[:-1]))

    async def short(line, reader, writer) -> None:
        writer.write(wire.copy_line(8, len(data)) + data[:5000])

    async def big(line, reader, writer) -> None:
        writer.write(wire.copy_line(8, 2**40))

    async def garbled(line, reader, writer) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n")

    dest = tmp_path / "mem"
    dest.mkdir()
    results = []
    for fake in (lying, short, big, garbled):
        async with fake_holder(fake) as port:
            results.append(await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0,
                                              dest_dir=str(dest), max_bytes=2**30))
        assert os.listdir(dest) == []
    assert results[0] == client.FetchResult(None, "checksum mismatch", len(data))
    assert results[1].step is None and results[1].reason.startswith("lost: short stream: 5000 of 10000")
    assert results[2].reason.startswith("too large: the copy of step 8 is 1099511627776 bytes")
    assert results[3].reason.startswith("lost: not an answer of the copy wire: b'HTTP/1.1")


async def test_a_push_reads_its_open_file_though_a_later_save_unlinks_it(tmp_path):
    data = blob(3 * stream.CHUNK // 2, 3)
    path = snap(tmp_path, "step-9", data)
    came: list[bytes] = []

    async def unlinking(line, reader, writer) -> None:
        os.unlink(path)                        # the worker's next save dropped it after the push opened it
        size = wire.parse_request(line).size   # type: ignore[union-attr]
        writer.write(GO)
        body = await reader.readexactly(size)
        came.append(body)
        assert await reader.readline() == sha(body)
        writer.write(wire.stored_line(9))

    async with fake_holder(unlinking) as port:
        done = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=9, path=path)
    assert done == client.PushResult(True, "stored step=9", len(data)) and came == [data]
    gone = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=9, path=path)
    assert gone == client.PushResult(False, "snapshot gone", 0)


async def test_a_push_whose_file_is_renamed_away_while_sent_sends_no_trailer(tmp_path):
    """A worker renames its oldest snapshot to step-N.tmp and writes the next one over it (training/capture.py):
    the bytes sent may be a mix of two steps, so the holder gets no trailer and keeps nothing."""
    data = blob(3 * stream.CHUNK // 2, 4)
    path = snap(tmp_path, "step-9", data)
    after: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def renaming(line, reader, writer) -> None:
        os.rename(path, path.replace("step-9", "step-12.tmp"))
        writer.write(GO)
        await reader.readexactly(wire.parse_request(line).size)   # type: ignore[union-attr]
        after.set_result(await reader.readline())

    async with fake_holder(renaming) as port:
        done = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=9, path=path)
        assert await asyncio.wait_for(after, 10) == b""      # the connection closed where the trailer would be
    assert done == client.PushResult(False, "snapshot replaced while it was sent", len(data))


async def test_unreachable_bad_requests_and_pacing(tmp_path, monkeypatch):
    path = snap(tmp_path, "s", blob(2 * stream.CHUNK + 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]             # nothing listens there once it is closed
    nowhere = await client.push("127.0.0.1", closed, key=KEY, node_id=NODE, local_rank=0, step=1, path=path)
    assert not nowhere.ok and nowhere.reason.startswith("unreachable: 127.0.0.1:")
    fetched = await client.fetch("127.0.0.1", closed, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(tmp_path))
    assert fetched.step is None and fetched.reason.startswith("unreachable: ")
    bad = await client.push("127.0.0.1", closed, key=KEY, node_id="a/b", local_rank=0, step=1, path=path)
    assert not bad.ok and bad.reason.startswith("bad request: bad node: 'a/b'")
    assert (await client.fetch("127.0.0.1", closed, key="k", node_id=NODE, local_rank=0,
                               dest_dir=str(tmp_path))).reason.startswith("bad request: bad key")

    paced: list[tuple[int, float]] = []

    def fake_pace(sent_bytes: int, elapsed_s: float, rate: float) -> float:
        paced.append((sent_bytes, rate))
        return 0.0

    monkeypatch.setattr(stream, "pace", fake_pace)
    store = make_store(tmp_path)
    async with holder(store) as port:
        done = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=1, path=path,
                                 bandwidth_bytes_s=5e6)
    assert done.ok and paced == [(stream.CHUNK, 5e6), (2 * stream.CHUNK, 5e6), (2 * stream.CHUNK + 1, 5e6)]


async def test_a_drop_removes_that_nodes_copies_only_and_needs_the_key(tmp_path) -> None:
    store = make_store(tmp_path)
    async with holder(store) as port:
        for node in (NODE, "node-b"):
            done = await client.push("127.0.0.1", port, key=KEY, node_id=node, local_rank=0, step=5,
                                     path=snap(tmp_path, f"{node}-5", blob(1000)))
            assert done.ok, done
        assert not await client.drop("127.0.0.1", port, key="x" * 20, node_id=NODE)     # the wrong key: nothing
        assert store.held() == {(NODE, 0): 5, ("node-b", 0): 5}
        assert await client.drop("127.0.0.1", port, key=KEY, node_id=NODE)
        assert store.held() == {("node-b", 0): 5}
        async with connection(port) as (reader, writer):    # a bad node name is refused, nothing removed
            writer.write(b"rdzv-agent drop key=%s node=..\n" % KEY.encode())
            assert (await line_of(reader)).startswith(b"rdzv-agent refused bad request")
        assert store.held() == {("node-b", 0): 5}


async def test_copies_nobody_renewed_for_long_make_room_and_fresh_ones_never_do(tmp_path) -> None:
    said: list[str] = []
    store = make_store(tmp_path, limit=2500, said=said)
    async with holder(store) as port:
        for node in ("old", "fresh"):
            done = await client.push("127.0.0.1", port, key=KEY, node_id=node, local_rank=0, step=1,
                                     path=snap(tmp_path, f"{node}-1", blob(1000)))
            assert done.ok, done
        new = snap(tmp_path, "new-1", blob(1000))
        refused = await client.push("127.0.0.1", port, key=KEY, node_id="new", local_rank=0, step=1, path=new)
        assert not refused.ok and "memory limit full" in refused.reason     # both renewed just now: kept
        stale = os.path.join(store.root, "old", "0", "step-1")
        os.utime(stale, (1.0, 1.0))                          # "old" stopped pushing long ago
        done = await client.push("127.0.0.1", port, key=KEY, node_id="new", local_rank=0, step=1, path=new)
        assert done.ok, done
    assert store.held() == {("fresh", 0): 1, ("new", 0): 1}
    assert any("removed node old's copies" in line for line in said)


async def test_a_ranks_next_push_supersedes_its_copy_no_restore_could_use(tmp_path) -> None:
    """A review (a small /dev/shm): pushes refused by the file system's reserve left each rank's newest at another
    step beside the common one; holding two copies a rank, the holder refused every later push at its limit: the
    copies frozen hundreds of steps behind for good. A rank's newest that is not the common step is of no use to a
    restore (it needs one step on every rank): its next push supersedes it."""
    store = make_store(tmp_path, limit=4000)
    async with holder(store) as port:
        async def push(rank: int, step: int) -> client.PushResult:
            return await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=rank, step=step,
                                     path=snap(tmp_path, f"{rank}-{step}", blob(1000, step)))
        for rank, step in ((0, 5), (1, 5), (0, 10), (1, 7)):
            assert (await push(rank, step)).ok, (rank, step)
        assert sorted((c.rank, c.step) for c in copies_files.copies(store.root)) == [(0, 5), (0, 10), (1, 5), (1, 7)]
        assert (await push(0, 15)).ok, "rank 0's 10 (no use without rank 1's) makes room"
        assert sorted((c.rank, c.step) for c in copies_files.copies(store.root)) == [(0, 5), (0, 15), (1, 5), (1, 7)]
        assert (await push(1, 15)).ok     # step 5, the common step before 15, stays as a spare while room allows
        assert sorted((c.rank, c.step) for c in copies_files.copies(store.root)) == [(0, 5), (0, 15), (1, 5), (1, 15)]
        assert (await push(0, 20)).ok, "the spares go first"
        assert sorted((c.rank, c.step) for c in copies_files.copies(store.root)) == [(0, 15), (0, 20), (1, 15)]


async def test_a_push_refused_whatever_is_evicted_evicts_nothing(tmp_path) -> None:
    """A review: a member's push too big to ever fit (a size of 2**40) first removed the copies of a lost node
    not renewed while the job waited for its replacement, those the replacement was about to fetch."""
    said: list[str] = []
    store = make_store(tmp_path, limit=2500, said=said)
    async with holder(store) as port:
        done = await client.push("127.0.0.1", port, key=KEY, node_id="old", local_rank=0, step=1,
                                 path=snap(tmp_path, "old-1", blob(1000)))
        assert done.ok, done
        os.utime(os.path.join(store.root, "old", "0", "step-1"), (1.0, 1.0))      # its node lost long ago
        refused = await client.push("127.0.0.1", port, key=KEY, node_id="new", local_rank=0, step=1,
                                    path=snap(tmp_path, "new-1", blob(3000)))
        assert not refused.ok and "exceed the limit of 2500 bytes" in refused.reason, refused
    assert store.held() == {("old", 0): 1} and not any("removed node old's copies" in line for line in said), said


def tls_of_nodes_and_stranger(tmp_path) -> tuple[Any, Any]:
    """Copy TLS (node_agent/copies/tls.py) of the job's nodes (one CA), and of a stranger signed by another CA."""
    from node_agent.copies.tls import copy_tls
    from tests.e2e.certs import make_ca, make_server_cert
    ca = make_ca(str(tmp_path))
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    other_ca = make_ca(str(tmp_path / "theirs"), "other-ca")
    return (copy_tls(*make_server_cert(str(tmp_path / "ours"), ca), ca[0]),
            copy_tls(*make_server_cert(str(tmp_path / "theirs"), other_ca), other_ca[0]))


async def test_over_tls_a_copy_goes_both_ways_and_a_peer_without_the_cas_certificate_gets_nothing(tmp_path) -> None:
    ours, stranger = tls_of_nodes_and_stranger(tmp_path)
    store = make_store(tmp_path)
    async with holder(store, ours.listen) as port:
        data = blob(3000)
        done = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=5,
                                 path=snap(tmp_path, "s", data), tls=ours.connect)
        assert done.ok, done
        dest = tmp_path / "dest"
        dest.mkdir()
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(dest),
                                 tls=ours.connect)
        assert got.step == 5 and (dest / "step-5").read_bytes() == data
        for tls in (None, stranger.connect):       # in the clear, or signed by another CA: no handshake, nothing
            refused = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=10,
                                        path=snap(tmp_path, "s10", blob(10)), tls=tls, timeout_s=2.0)
            assert not refused.ok and refused.sent == 0, refused
        assert store.held() == {(NODE, 0): 5}


async def test_a_nodes_common_step_stays_until_every_rank_has_a_newer_one_and_can_be_fetched(tmp_path) -> None:
    store = make_store(tmp_path)
    async with holder(store) as port:
        async def push(rank: int, step: int) -> None:
            done = await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=rank, step=step,
                                     path=snap(tmp_path, f"{rank}-{step}", blob(100, seed=rank * 1000 + step)))
            assert done.ok, done

        def held(rank: int) -> list[int]:
            return sorted(int(n[5:]) for n in os.listdir(os.path.join(store.root, NODE, str(rank)))
                          if n.startswith("step-") and n[5:].isdigit())

        await push(0, 5)
        await push(1, 5)
        await push(0, 10)                 # rank 1's copy of step 10 not there yet (the node lost meanwhile, say)
        assert (held(0), held(1)) == ([5, 10], [5]) and store.held() == {(NODE, 0): 10, (NODE, 1): 5}
        dest = tmp_path / "at5"
        dest.mkdir()
        got = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, dest_dir=str(dest), step=5)
        assert got.step == 5 and (dest / "step-5").read_bytes() == blob(100, seed=5)
        missing = await client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=1, dest_dir=str(dest),
                                     step=10)
        assert missing.step is None and missing.reason == "no copy held"
        await push(1, 10)                 # now every rank has step 10: step 5 is a spare (files.spares)
        assert (held(0), held(1)) == ([5, 10], [5, 10])
        await push(0, 15)
        await push(1, 15)                 # and goes once the next common step is whole
        assert (held(0), held(1)) == ([10, 15], [10, 15])


async def test_a_node_cannot_push_fetch_or_drop_under_another_nodes_id(tmp_path) -> None:
    """The holder is told its sources' verifiers, not their tokens (the server's CopySource): it checks keys and
    cannot present them, so a node that once held another's copies cannot act as it."""
    tokens = {"node-a": "token-of-node-a-0000", "node-b": "token-of-node-b-0000"}
    store = CopyStore(str(tmp_path / "held"), 2**20,
                      {n: CopySource(node_id=n, verifier=copy_verifier(t)) for n, t in tokens.items()},
                      round_now=lambda: 1, reach=lambda: FAR)
    async with holder(store) as port:
        mine = await client.push("127.0.0.1", port, key=tokens["node-a"], node_id="node-a", local_rank=0, step=1,
                                 path=snap(tmp_path, "a", blob(100)))
        assert mine.ok, mine
        forged = await client.push("127.0.0.1", port, key=tokens["node-b"], node_id="node-a", local_rank=0, step=2,
                                   path=snap(tmp_path, "b", blob(100)))
        assert forged == client.PushResult(False, "refused: \"wrong key\"", 0)
        dest = tmp_path / "dest"
        dest.mkdir()
        stolen = await client.fetch("127.0.0.1", port, key=tokens["node-b"], node_id="node-a", local_rank=0,
                                    dest_dir=str(dest))
        assert stolen.step is None and stolen.reason == "refused: \"wrong key\""
        assert not await client.drop("127.0.0.1", port, key=tokens["node-b"], node_id="node-a")
        told = await client.push("127.0.0.1", port, key=copy_verifier(tokens["node-a"]), node_id="node-a",
                                 local_rank=0, step=2, path=snap(tmp_path, "c", blob(100)))
        assert told == client.PushResult(False, "refused: \"wrong key\"", 0)     # what the holder knows is no key
        del tokens["node-a"]              # no source of this holder any more: its copies keep their key's verifier
        own = await client.fetch("127.0.0.1", port, key="token-of-node-a-0000", node_id="node-a", local_rank=0,
                                 dest_dir=str(dest))
        assert own.step == 1
    assert store.held() == {("node-a", 0): 1}
    assert b"token-of-node-a" not in every_byte_under(store.root)


def every_byte_under(root: str) -> bytes:
    out = b""
    for where, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(where, name), "rb") as f:
                out += f.read()
    return out


async def test_copies_an_older_agent_held_with_the_key_itself_are_still_fetched_with_it(tmp_path) -> None:
    store = make_store(tmp_path)
    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=3,
                                  path=snap(tmp_path, "a", blob(100)))).ok
    node_dir = os.path.join(store.root, NODE)
    os.remove(os.path.join(node_dir, ".verifier"))
    snap(node_dir, ".token", KEY.encode())      # an older agent's note: the key itself
    store = CopyStore(store.root, 2**20, {}, round_now=lambda: 1, reach=lambda: FAR)     # no source now
    async with holder(store) as port:
        got, _ = await fetch_bytes(port, tmp_path)
        assert got.step == 3
        dest = tmp_path / "other"
        dest.mkdir()
        other = await client.fetch("127.0.0.1", port, key="another-key-0000000", node_id=NODE, local_rank=0,
                                   dest_dir=str(dest))
        assert other.reason == "refused: \"wrong key\""
    store = make_store(tmp_path)
    store.root = os.path.dirname(node_dir)
    async with holder(store) as port:          # a push to the upgraded holder: its verifier noted, the key forgotten
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=4,
                                  path=snap(tmp_path, "b", blob(100)))).ok
    assert sorted(n for n in os.listdir(node_dir) if n.startswith(".")) == [".verifier"]


async def test_a_fetch_from_a_source_that_never_answers_is_given_up_at_the_answer_bound(tmp_path, monkeypatch):
    """A hung source (it accepts, reads, says nothing) costs the fetcher FETCH_ANSWER_S, not its whole limit."""
    monkeypatch.setattr(client, "FETCH_ANSWER_S", 0.3)
    hold = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        await hold.wait()
        writer.close()

    async with loopback_server(silent) as port:
        try:
            got = await asyncio.wait_for(client.fetch("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0,
                                                      dest_dir=str(tmp_path), timeout_s=600.0), WAIT)
        finally:
            hold.set()
    assert got.step is None and got.reason.startswith("lost:"), got


async def test_a_push_keeps_a_second_name_for_its_file_while_it_sends_and_none_after(tmp_path) -> None:
    """files.pin: a worker writes over no snapshot with two names (capture.py), so a slow push still lands."""
    store = make_store(tmp_path)
    source = tmp_path / "rank0"
    source.mkdir()
    path = snap(source, "step-1", blob(300_000))
    async with holder(store) as port:
        push = asyncio.create_task(client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=1,
                                               path=path, bandwidth_bytes_s=600_000))
        deadline = asyncio.get_running_loop().time() + WAIT
        while os.stat(path).st_nlink == 1 and not push.done():       # the file polled: it tells nobody
            assert asyncio.get_running_loop().time() < deadline, "no second name while the push ran"
            await asyncio.sleep(0.01)
        assert os.stat(path).st_nlink == 2 and [n for n in os.listdir(source) if n.startswith(".sending-")]
        os.unlink(path)                  # the keep rule drops it meanwhile: the push goes on with its bytes
        result = await asyncio.wait_for(push, WAIT)
    assert result.ok, result
    assert os.listdir(source) == [] and store.held() == {(NODE, 0): 1}


async def test_copies_that_came_with_a_nodes_old_token_are_fetched_with_it_while_it_is_a_source_anew(tmp_path) -> None:
    """A node back in the job with a token of a new epoch (rdzv_server/core/rounds.copy_epochs) is a source of this
    holder again before it pushed with it: the node fetching its copies of before is told the token they came with,
    and was refused (only the source's token now was checked); a push still needs the new one."""
    old, new = "token-of-node-a-0000", "token-of-node-a-0001"
    sources = {NODE: CopySource(node_id=NODE, verifier=copy_verifier(old))}
    store = CopyStore(str(tmp_path / "held"), 2**20, sources, round_now=lambda: 1, reach=lambda: FAR)
    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=old, node_id=NODE, local_rank=0, step=1,
                                  path=snap(tmp_path, "a", blob(100)))).ok
        sources[NODE] = CopySource(node_id=NODE, verifier=copy_verifier(new))
        dest = tmp_path / "dest"
        dest.mkdir()
        got = await client.fetch("127.0.0.1", port, key=old, node_id=NODE, local_rank=0, dest_dir=str(dest))
        assert got.step == 1, got
        stale = await client.push("127.0.0.1", port, key=old, node_id=NODE, local_rank=0, step=2,
                                  path=snap(tmp_path, "b", blob(100)))
        assert stale == client.PushResult(False, "refused: \"wrong key\"", 0)
        assert (await client.push("127.0.0.1", port, key=new, node_id=NODE, local_rank=0, step=2,
                                  path=snap(tmp_path, "c", blob(100)))).ok
        again = await client.fetch("127.0.0.1", port, key=old, node_id=NODE, local_rank=0, dest_dir=str(dest))
        assert again.reason == "refused: \"wrong key\""      # its copies came with the new token since


async def test_a_drop_of_copies_already_gone_is_refused_but_not_said_as_trouble(tmp_path) -> None:
    """A review (a member's worker crashed, it was excluded, the next member took its place from its copies and
    dropped them at its holder, itself): at the job's end the excluded node dropped its copies too, and the holder,
    holding none, said "refused wrong key (no key of node ...)" as trouble. Nothing is lost: the drop is still
    refused (the answer a stranger gets), but not said. A fetch or push for such a node is still said."""
    said: list[str] = []
    sources: dict[str, CopySource] = {NODE: CopySource(node_id=NODE, token=KEY)}
    store = CopyStore(str(tmp_path / "held"), 2**20, sources, said.append, round_now=lambda: 1, reach=lambda: FAR)
    async with holder(store) as port:
        assert (await client.push("127.0.0.1", port, key=KEY, node_id=NODE, local_rank=0, step=5,
                                  path=snap(tmp_path, "s", blob(1000)))).ok
        assert await client.drop("127.0.0.1", port, key=KEY, node_id=NODE)       # the node taking its place
        sources.clear()                                                          # the next round: no source
        assert not await client.drop("127.0.0.1", port, key=KEY, node_id=NODE)   # the node itself, its job over
        assert said == [] and store.held() == {}
        got, _ = await fetch_bytes(port, tmp_path)
    assert got == client.FetchResult(None, "refused: \"wrong key\"", 0)
    assert len(said) == 1 and "no key of node node-a" in said[0] and "fetch" in said[0], said


async def test_copies_no_node_can_fetch_make_way_and_the_rest_stay(tmp_path) -> None:
    """A soak review: a holder kept the copies of every replaced node of a 2-node job (nobody fetched them) and then
    refused the live member's pushes at its limit. Told which gone nodes' copies may still be fetched (the server
    knows), it drops the others; a current source's, a wanted one's and one being fetched stay."""
    sources = {n: CopySource(node_id=n, token=KEY) for n in ("b", "q0", "q1", "c")}
    store = CopyStore(str(tmp_path / "held"), 2**20, sources, round_now=lambda: 10**6, reach=lambda: FAR)
    data = blob(1000)
    async with holder(store) as port:
        for n in sources:
            sent = await client.push("127.0.0.1", port, key=KEY, node_id=n, local_rank=0, step=5,
                                     path=snap(tmp_path, "step-5", data))
            assert sent.ok, sent
    del sources["b"], sources["q0"], sources["q1"]    # gone: c alone is a source now
    store._sending[("q1", 0)] = store._sending.get(("q1", 0))  # type: ignore[assignment]   # a fetch of q1's under way
    assert store.drop_unwanted(["b"]) == ["q0"]
    assert sorted(store.held()) == [("b", 0), ("c", 0), ("q1", 0)]
    del store._sending[("q1", 0)]
    assert store.drop_unwanted([]) == ["b", "q1"] and sorted(store.held()) == [("c", 0)]


async def test_a_moving_members_copy_makes_room_for_a_current_sources_push_and_stays_while_there_is_room(
        tmp_path) -> None:
    """A review (--memory-dir-limit for fewer than three copies): an old holder kept a moved member's copy (the
    second place a loss fetches from) for the whole round, and refused its own current source's pushes at its limit
    until the copy went unrenewed for EVICT_AFTER_S: that source's copies ten minutes stale. Told which of the copies
    it keeps are of members moving to another holder (Assignment.copies_moving), it drops one to make room for a
    current source's push, and only then; a gone node's copy (one a replacement fetches) still stays."""
    said: list[str] = []
    sources = {n: CopySource(node_id=n, token=KEY) for n in ("m", "g", "s")}
    moving: tuple[str, ...] = ()
    store = CopyStore(str(tmp_path / "held"), 3500, sources, said.append, round_now=lambda: 10**6,
                      reach=lambda: FAR, moving=lambda: moving)
    async with holder(store) as port:
        async def push(node: str, step: int) -> client.PushResult:
            return await client.push("127.0.0.1", port, key=KEY, node_id=node, local_rank=0, step=step,
                                     path=snap(tmp_path, f"{node}-{step}", blob(1000, step)))
        assert (await push("g", 1)).ok and (await push("m", 1)).ok
        del sources["m"], sources["g"]          # the next round: m's copies go elsewhere, g is gone; s is a source
        assert (await push("s", 2)).ok, "room for s's first copy: m's is kept beside it"
        refused = await push("s", 3)            # not told m moves (an older server): m's copy is kept
        assert not refused.ok and "memory limit full" in refused.reason, refused
        moving = ("m",)
        assert store.held() == {("g", 0): 1, ("m", 0): 1, ("s", 0): 2}
        got, _ = await fetch_bytes(port, tmp_path, node="m")
        assert got.step == 1                     # still the second place m's loss fetches from
        assert (await push("s", 3)).ok, "m's copy, moving elsewhere, makes room for s's newer one"
        assert store.held() == {("g", 0): 1, ("s", 0): 3}
        assert any("removed node m's copies" in line and "node s's" in line for line in said), said
        assert (await push("s", 4)).ok           # the gone node's copy is no moving one: kept
    assert store.held() == {("g", 0): 1, ("s", 0): 4}


async def test_a_moving_members_copy_being_fetched_makes_no_room(tmp_path) -> None:
    """A moving member's copy that a node taking its place fetches now stays: the push waits for the next snapshot."""
    sources = {n: CopySource(node_id=n, token=KEY) for n in ("m", "s")}
    store = CopyStore(str(tmp_path / "held"), 2500, sources, round_now=lambda: 10**6, reach=lambda: FAR,
                      moving=lambda: ("m",))
    async with holder(store) as port:
        async def push(node: str, step: int) -> client.PushResult:
            return await client.push("127.0.0.1", port, key=KEY, node_id=node, local_rank=0, step=step,
                                     path=snap(tmp_path, f"{node}-{step}", blob(1000, step)))
        assert (await push("m", 1)).ok and (await push("s", 1)).ok
        del sources["m"]                                   # its old holder now
        store._sending[("m", 0)] = store._sending.get(("m", 0))  # type: ignore[assignment]   # a fetch of m's
        refused = await push("s", 2)
        assert not refused.ok and "memory limit full" in refused.reason, refused
        assert store.held() == {("m", 0): 1, ("s", 0): 1}
        del store._sending[("m", 0)]
        assert (await push("s", 2)).ok and store.held() == {("s", 0): 2}
