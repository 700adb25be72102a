"""The agent's listeners face strangers (node_agent/client/listener.py): connections past the per-source cap are
closed at once, before any handshake; at the total cap the one waiting longest for its first line makes room, and
only connections at work make a newcomer wait its turn; a silent TLS connection is let go within the handshake
limit; a first line is read into a small buffer, and only then widened for a payload. Real sockets on loopback,
sources as 127.0.0.x."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from node_agent.client import listener as listening
from node_agent.client.listener import Listener
from node_agent.copies import stream
from protocol.accepting import EVICTED, MIN_TOTAL, TAKEN, Accepted, Caps, SayOnce, accept
from tests.e2e.certs import make_ca, make_server_cert

WAIT = 10.0
AT_WORK: list[asyncio.Task] = []      # the tasks of `busy` lines, as `serving` runs them


@contextlib.asynccontextmanager
async def serving(caps: Caps, tls: ssl.SSLContext | None = None, said: list[str] | None = None,
                  busy: asyncio.Event | None = None) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A listener whose handler answers each first line with `ok LINE` (what it was given, newline and all); a line
    `busy` keeps its handler at work until `busy` is set."""
    lines: list[bytes] = []

    async def echo(line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines.append(line)
        if line == b"busy\n" and busy is not None:
            AT_WORK.append(asyncio.current_task())
            await busy.wait()
        writer.write(b"ok " + line)
        await writer.drain()

    server = Listener(echo, caps, (said if said is not None else []).append, tls=tls)
    port = await server.start("127.0.0.1")
    assert port
    try:
        yield port, lines
    finally:
        await server.close()


def server_tls(tmp_path) -> tuple[tuple[Any, ...], ssl.SSLContext]:
    """A test CA (its files) and a listener's TLS context with a certificate it signed."""
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    return ca, tls


@contextlib.asynccontextmanager
async def answering_over_tls(tmp_path, monkeypatch) -> AsyncIterator[tuple[tuple[Any, ...], Listener, Caps, int]]:
    """A TLS listener answering `ok LINE`, caps of 8 (2 handshakes at once), the handshake's own limit made too
    long to end any here: its test CA, the listener, its caps and its port."""
    ca, tls = server_tls(tmp_path)
    monkeypatch.setattr(listening, "HANDSHAKE_S", 60.0)
    caps = Caps(total=8, per_source=8)

    async def answer(line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok " + line)
        await writer.drain()

    server = Listener(answer, caps, [].append, tls=tls)
    port = await server.start("127.0.0.1")
    try:
        yield ca, server, caps, port
    finally:
        await server.close()


async def hello_over_tls(port: int, ca: tuple[Any, ...]) -> bytes:
    """A peer's `hello` line over TLS, and the line it is answered."""
    client = ssl.create_default_context(cafile=ca[0])
    client.check_hostname = False
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    try:
        writer.write(b"hello\n")
        return await asyncio.wait_for(reader.readline(), WAIT)
    finally:
        writer.close()


def silent(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that says nothing (no line, no ClientHello)."""
    s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    s.setblocking(False)
    return s


def _client_hello() -> bytes:
    """A ClientHello's bytes, as a TLS client sends first."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with contextlib.suppress(ssl.SSLWantReadError):
        context.wrap_bio(incoming, outgoing).do_handshake()
    return outgoing.read()


def hello_only(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that sends a ClientHello and then nothing: its handshake waits for the rest."""
    s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    s.sendall(_client_hello())
    s.setblocking(False)
    return s


async def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the listener closed `s` within `seconds` (EOF or a reset; what it sent before, a handshake's
    answer, is read past)."""
    loop = asyncio.get_running_loop()

    async def eof() -> bool:
        while await loop.sock_recv(s, 65536):
            pass
        return True

    try:
        return await asyncio.wait_for(eof(), seconds)
    except asyncio.TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def until(condition, what: str) -> None:
    """Wait, bounded, until `condition()` holds: what the listener did is read from its caps, never timed."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT}s: {what}"
        await asyncio.sleep(0.01)


async def ask(port: int, line: bytes, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(line)
        return await asyncio.wait_for(reader.readline(), WAIT)
    finally:
        writer.close()


async def test_past_the_per_source_cap_with_all_of_its_at_work_a_connection_is_closed_at_once(monkeypatch) -> None:
    # A silent connection let go at its first-line limit would look the same: that limit is put out of reach, so
    # only the refusal can close it (timing the close instead broke on a loaded host).
    monkeypatch.setattr(listening, "FIRST_LINE_S", 10 * WAIT)
    caps, busy, said = Caps(total=100, per_source=3), asyncio.Event(), []
    async with serving(caps, said=said, busy=busy) as (port, _):
        AT_WORK.clear()
        working = [asyncio.ensure_future(ask(port, b"busy\n")) for _ in range(3)]
        await until(lambda: len(AT_WORK) == 3, "the three at work in their handlers")
        extra = silent(port)
        assert await closed_within(extra, WAIT)
        assert len(said) == 1 and "refused a connection from '127.0.0.1'" in said[0], said
        assert await ask(port, b"rdzv-agent ask round=1\n", source="127.0.0.2") == b"ok rdzv-agent ask round=1\n"
        busy.set()
        assert await asyncio.gather(*working) == [b"ok busy\n"] * 3
        extra.close()


async def test_at_the_per_source_cap_idle_ones_of_that_source_make_room_for_a_peer_from_it() -> None:
    """A review: a process on a peer's host (the peer's address) held the per-source cap with idle connections,
    reopened as they were closed, and every push of the peer's was closed at once for the whole attack. The one of
    that source waiting longest makes room, as at the total cap; the source still holds no more than its cap."""
    caps, said = Caps(total=100, per_source=3), []
    async with serving(caps, said=said) as (port, _):
        held = []
        for n in range(1, 4):
            held.append(silent(port))
            await until(lambda n=n: caps.count == n, "the idle ones accepted in turn")
        assert await ask(port, b"rdzv-agent ask round=1\n") == b"ok rdzv-agent ask round=1\n"
        assert await closed_within(held[0], 2.0)                    # the one waiting longest made room
        assert not any([await closed_within(s, 0.2) for s in held[1:]])
        assert len(said) == 1 and "closed the one idle longest" in said[0], said
        await until(lambda: caps.open == {"127.0.0.1": 2}, "the peer's place given back, the source under its cap")
        for s in held:
            s.close()


async def test_at_the_total_cap_idle_connections_make_room_for_a_question_on_any_listener() -> None:
    """Strangers holding every place an agent's listeners have, saying nothing, cannot shut out a witness's question
    or a copy: the connection waiting longest for its first line is closed for each newcomer."""
    caps, said = Caps(total=4, per_source=10), []
    async with serving(caps, said=said) as (a, _), serving(caps) as (b, _):
        held = [silent(a, f"127.0.0.{i}") for i in (2, 3)] + [silent(b, f"127.0.0.{i}") for i in (4, 5)]
        await until(lambda: caps.count == 4, "the four accepted")
        assert await ask(a, b"rdzv-agent ask round=1\n", source="127.0.0.6") == b"ok rdzv-agent ask round=1\n"
        assert await closed_within(held[0], 2.0)                              # the oldest made room
        assert len(said) == 1 and "closed the one idle longest" in said[0], said
        newcomers = [silent(b, "127.0.0.7"), silent(b, "127.0.0.8")]    # 3 held + 2: on the other listener ...
        assert await closed_within(held[1], 2.0)                              # ... the oldest, on a, makes room
        assert not await closed_within(held[2], 0.3) and not any([await closed_within(s, 0.1) for s in newcomers])
        assert caps.count == caps.total == 4
        for s in [*held, *newcomers]:
            s.close()


@pytest.mark.parametrize("flood_sources", [["127.0.0.9"] * 3, ["127.0.0.9", "127.0.0.10", "127.0.0.11"]])
async def test_at_the_total_cap_idle_ones_make_room_not_a_peers_from_one_source_or_many(flood_sources) -> None:
    """A review: one idle connection from each of 768 addresses, and a peer pushing two ranks at once was "the source
    with the most waiting": its pushes were closed for the flood's newcomers, and the node taking a lost one's place
    found no copy (step 0). Closed is the one waiting longest, whatever its source holds."""
    caps = Caps(total=5, per_source=10)
    async with serving(caps) as (port, _):
        flood = []
        for n, source in enumerate(flood_sources, 1):
            flood.append(silent(port, source))
            await until(lambda n=n: caps.count == n, "the flood accepted in turn")
        peer = [silent(port, "127.0.0.2") for _ in range(2)]       # its first lines not in yet
        await until(lambda: caps.count == 5, "the peer's two accepted")
        assert await ask(port, b"rdzv-agent ask round=1\n", source="127.0.0.3") == b"ok rdzv-agent ask round=1\n"
        assert await closed_within(flood[0], 2.0)
        assert not any([await closed_within(s, 0.2) for s in peer])
        for s in [*peer, *flood]:
            s.close()


async def test_at_the_total_cap_with_every_connection_at_work_a_newcomer_is_refused() -> None:
    caps, busy, said = Caps(total=2, per_source=10), asyncio.Event(), []
    async with serving(caps, said=said, busy=busy) as (port, _):
        AT_WORK.clear()
        working = [asyncio.ensure_future(ask(port, b"busy\n", source=f"127.0.0.{i}")) for i in (2, 3)]
        await until(lambda: len(AT_WORK) == 2, "both at work in their handlers")
        late = silent(port, "127.0.0.4")
        assert await closed_within(late, 2.0) and "refused" in said[0], said
        busy.set()
        assert await asyncio.gather(*working) == [b"ok busy\n", b"ok busy\n"]       # the work was never cut
        late.close()
        await until(lambda: caps.count == 0 and caps.open == {}, "every place given back")


async def test_a_line_that_comes_late_is_still_served_and_one_too_long_is_not() -> None:
    async with serving(listening.agent_caps()) as (port, lines):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(1.0)            # longer than any old wait for a question: still a request, not a probe
        writer.write(b"rdzv-agent push late\n")
        assert await asyncio.wait_for(reader.readline(), WAIT) == b"ok rdzv-agent push late\n"
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x" * (2 * listening.FIRST_LINE_LIMIT) + b"\n")
        with contextlib.suppress(ConnectionResetError):                    # closed with bytes unread: a reset
            assert await asyncio.wait_for(reader.read(), WAIT) == b""       # closed, nothing said
        writer.close()
    assert lines == [b"rdzv-agent push late\n"]


async def test_a_tls_connection_that_never_says_hello_is_let_go_within_the_handshake_limit(tmp_path,
                                                                                         monkeypatch) -> None:
    ca, tls = server_tls(tmp_path)
    monkeypatch.setattr(listening, "HANDSHAKE_S", 0.5)
    monkeypatch.setattr(listening, "FIRST_LINE_S", 10 * WAIT)     # out of reach: only the handshake's limit closes
    caps = Caps(total=10, per_source=2)
    async with serving(caps, tls=tls) as (port, _):
        quiet = [silent(port) for _ in range(2)]
        assert all([await closed_within(s, WAIT) for s in quiet])
        await until(lambda: caps.open == {}, "their places free again")
        assert await hello_over_tls(port, ca) == b"ok hello\n"
        for s in quiet:
            s.close()


def test_a_waiting_connection_closed_for_a_newcomer_is_never_the_newcomer_itself() -> None:
    """The server's TLS port closes a waiting handshake for a newcomer past its connection limit: where the newcomer's
    own is the only one waiting there is none to close (refused, and counted so), not the newcomer closed."""
    caps, closed = Caps(total=8, per_source=8), []
    newcomer, older = object(), object()
    caps.wait("a", older, lambda: closed.append("older"), lambda: True)
    caps.wait("b", newcomer, lambda: closed.append("newcomer"), lambda: False)
    assert caps.close_one_waiting(sparing=newcomer) and closed == ["older"]     # though the newcomer sent nothing
    assert not caps.close_one_waiting(sparing=newcomer) and closed == ["older"]
    assert caps.close_one_waiting() and closed == ["older", "newcomer"]


def test_caps_leave_most_descriptors_to_the_rest_of_the_agent() -> None:
    sized = listening.caps_for_descriptors
    assert sized(1024).total == 256 and sized(1 << 20).total == listening.MAX_CONNECTIONS
    assert sized(20).total == 16


async def test_a_reader_widened_after_its_first_line_takes_a_payloads_chunks() -> None:
    """stream.widen sets asyncio's own attribute for a StreamReader's limit: this fails should asyncio rename it."""
    reader = asyncio.StreamReader(limit=16)
    reader.feed_data(b"y" * 100)
    with pytest.raises(ValueError):
        await reader.readline()
    reader = asyncio.StreamReader(limit=16)
    stream.widen(reader, 4096)
    reader.feed_data(b"y" * 100 + b"\n")
    assert await reader.readline() == b"y" * 100 + b"\n"


async def test_a_tls_connection_ended_mid_request_frees_its_socket_for_the_next_at_once(tmp_path) -> None:
    """A connection at work over TLS is cancelled (the listener closing; a push superseded by a newer step): its
    socket must leave the loop at once. Closed under its TLS transport, which waits for the peer's close_notify,
    the descriptor number stayed registered, and the next connection given that number (on any listener) was not
    served: a witness's question went unanswered."""
    ca, tls = server_tls(tmp_path)
    caps, busy = listening.agent_caps(), asyncio.Event()
    AT_WORK.clear()
    async with serving(caps, tls=tls, busy=busy) as (secure, _), serving(caps) as (plain, _):
        client = ssl.create_default_context(cafile=ca[0])
        client.check_hostname = False

        def quiet_peer() -> ssl.SSLSocket:   # a peer that then reads nothing: no close_notify comes back
            s = client.wrap_socket(socket.create_connection(("127.0.0.1", secure), timeout=WAIT))
            s.sendall(b"busy\n")
            return s
        quiet = await asyncio.to_thread(quiet_peer)     # (blocking: its handshake needs the loop)
        await until(lambda: len(AT_WORK) == 1, "at work in its handler")
        AT_WORK.pop().cancel()               # as the listener closing, or a newer push, ends it
        await asyncio.sleep(0.1)
        answers = [await ask(plain, b"rdzv-agent ask round=1\n") for _ in range(3)]
        assert answers == [b"ok rdzv-agent ask round=1\n"] * 3
        quiet.close()


def test_a_source_is_an_address_and_an_ipv6_one_its_64() -> None:
    """An IPv6 host holds a whole /64: counted by address, one host would pass any per-source cap."""
    from protocol.accepting import source_of
    assert source_of(("2001:db8::1", 1, 0, 0)) == source_of(("2001:db8::ffff:2", 9, 0, 0)) == "2001:db8::/64"
    assert source_of(("::ffff:10.0.0.1", 1, 0, 0)) == "10.0.0.1" and source_of(("10.0.0.2", 5)) == "10.0.0.2"
    assert source_of(None) == "?"


def test_shrinking_closes_waiting_connections_of_the_biggest_source_first_and_never_one_at_work() -> None:
    caps, closed = Caps(total=40, per_source=40, shrinks=True), []
    for i in range(30):
        assert caps.take("flood") == "taken"
        caps.wait("flood", i, lambda i=i: (closed.append(i), caps.give("flood")))
    for i in range(3):
        caps.take("peer")
        caps.wait("peer", f"p{i}", lambda i=i: (closed.append(f"p{i}"), caps.give("peer")))
    for _ in range(4):
        caps.take("busy")                    # at work: never closed
    assert caps.shrink(20) == 17 and caps.total == 20 and caps.count == 20
    assert closed == list(range(17)) and caps.open == {"flood": 13, "peer": 3, "busy": 4}
    assert caps.shrink(1) == 4 and caps.total == MIN_TOTAL == caps.count     # never below MIN_TOTAL


async def test_out_of_descriptors_an_agents_listener_lowers_its_cap_and_a_servers_keeps_it(monkeypatch) -> None:
    loop = asyncio.get_running_loop()
    for caps, after in ((Caps(total=100, per_source=10, shrinks=True), 24), (Caps(total=100, per_source=10), 100)):
        for i in range(32):                  # 32 open, waiting for their first line
            caps.take(f"10.0.0.{i % 4}")
            caps.wait(f"10.0.0.{i % 4}", i, lambda i=i, caps=caps: caps.give(f"10.0.0.{i % 4}"))
        calls: list[int] = []
        said: list[str] = []

        async def sock_accept(sock: socket.socket, calls: list[int] = calls) -> tuple[socket.socket, object]:
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.EMFILE, "Too many open files")
            await asyncio.Event().wait()     # nothing more comes
            raise AssertionError

        monkeypatch.setattr(loop, "sock_accept", sock_accept)
        with socket.socket() as sock:
            task = asyncio.create_task(accept(sock, caps, "witness port", SayOnce(said.append), None, set()))
            for _ in range(200):             # the pause after the error (0.5 s), then the next accept
                if len(calls) >= 2:
                    break
                await asyncio.sleep(0.05)
            assert len(calls) == 2
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert caps.total == after and caps.count == min(32, after) and len(said) == 1
        assert ("at most 24 connections from now on (8 waiting closed)" in said[0]) == caps.shrinks, said


def test_at_the_total_cap_a_connection_whose_peer_has_sent_something_is_closed_last() -> None:
    """The same review, its flood reconnecting at ~7,000 connections/s: the one waiting longest was at times a peer's,
    its first line in the socket while the loop was busy accepting. One that has sent nothing goes first."""
    caps, closed = Caps(total=3, per_source=10), []
    for key, sent in (("peer", True), ("idle-1", False), ("idle-2", False)):
        assert caps.take("x") == TAKEN
        caps.wait("x", key, lambda key=key: (closed.append(key), caps.give("x")), lambda sent=sent: sent)
    assert caps.take("y") == EVICTED and closed == ["idle-1"]
    caps.wait("y", "peer-2", lambda: (closed.append("peer-2"), caps.give("y")), lambda: True)
    assert caps.take("z") == EVICTED and closed == ["idle-1", "idle-2"]
    assert caps.take("z") == EVICTED and closed == ["idle-1", "idle-2", "peer"]    # every one has: the longest


async def test_a_tls_peer_that_never_answers_the_close_holds_no_descriptor_past_the_caps(tmp_path,
                                                                                        monkeypatch) -> None:
    """A peer with a member's certificate sends a line, takes the answer and never answers the close (no close_notify,
    its socket kept open). Its places were given back at once while each connection waited 30 s for the close_notify:
    a review held 1,700 connections past the cap of 512 (600 MB, the agent out of descriptors). Now a close waits
    CLOSE_S, counted in the caps, and is then aborted."""
    import psutil
    ca, tls = server_tls(tmp_path)
    monkeypatch.setattr(listening, "CLOSE_S", 0.2, raising=False)
    caps = Caps(total=4, per_source=4)

    def served(port: int) -> int:       # the listener's side of its connections, open now
        return sum(1 for c in psutil.Process().net_connections("tcp")
                   if c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN)

    async with serving(caps, tls=tls) as (port, _):
        client = ssl.create_default_context(cafile=ca[0])
        client.check_hostname = False

        def quiet_peer() -> ssl.SSLSocket | None:       # answered, then silent: no close_notify, never closed
            raw = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            try:
                s = client.wrap_socket(raw)
                s.sendall(b"hello\n")
                if s.recv(64) == b"ok hello\n":
                    return s
            except OSError:
                pass
            raw.close()                 # refused (its source at the cap): tried again
            return None
        quiet: list[ssl.SSLSocket] = []
        most = 0
        while len(quiet) < 12:
            s = await asyncio.to_thread(quiet_peer)
            if s is not None:
                quiet.append(s)
            else:
                await asyncio.sleep(0.05)
            most = max(most, served(port))
        assert most <= caps.total, f"{most} connections open past the cap of {caps.total}"
        await until(lambda: served(port) == 0 and caps.count == 0, "every quiet peer's connection closed")
        for s in quiet:
            s.close()


async def test_past_a_quarter_of_the_cap_in_tls_handshakes_the_longest_under_way_gives_way(tmp_path,
                                                                                          monkeypatch) -> None:
    """A TLS handshake holds ~1 MiB while it lasts: a review's flood of strangers' handshakes took an agent from 49 to
    550 MiB. At most a quarter of the total cap go on at once; past that the one under way longest is ended, so a
    peer's handshake never waits behind a stranger's (the handshake's own limit is made too long to end any here)."""
    async with answering_over_tls(tmp_path, monkeypatch) as (ca, server, caps, port):   # 2 handshakes at once
        quiet = [hello_only(port) for _ in range(4)]  # a ClientHello, then nothing
        assert await closed_within(quiet[0], WAIT) and await closed_within(quiet[1], WAIT)
        await until(lambda: len(server._handshaking) == 2 and caps.count == 2, "the two newest handshakes left")
        assert await hello_over_tls(port, ca) == b"ok hello\n"
        assert await closed_within(quiet[2], WAIT)        # the peer's handshake ended the longest under way
        await until(lambda: len(server._handshaking) == 1 and caps.count == 1, "the last stranger's alone")
        for s in quiet:
            s.close()


async def test_a_tls_connection_that_sends_nothing_starts_no_handshake(tmp_path, monkeypatch) -> None:
    """A handshake holds ~1 MiB: one starts once the peer's first bytes came, not on its connect. A review: strangers
    connecting and closing at once, 2,400 a second, each started one (RSS 24 -> 231 MiB). Silent connections here
    hold their places in the caps, none a handshake (before, the share of 2 ended two of four as handshakes)."""
    async with answering_over_tls(tmp_path, monkeypatch) as (ca, server, caps, port):   # 2 handshakes at once
        quiet = [silent(port) for _ in range(4)]
        await until(lambda: caps.count == 4, "the four silent connections counted")
        assert not server._handshaking
        quiet[0].close()                          # a close, not a hello: let go without a handshake
        await until(lambda: caps.count == 3, "the closed one let go")
        assert await hello_over_tls(port, ca) == b"ok hello\n"
        for s in quiet[1:]:
            s.close()


async def test_past_the_handshake_share_a_strangers_handshake_gives_way_never_a_peers(tmp_path, monkeypatch) -> None:
    """A review: ClientHellos then silence from strangers (300 at once, from 10 or 150 addresses) ended a third to a
    half of a peer's handshakes at the copy port as the longest under way: its copy refused, tried again later. A
    source a handshake was done from is a peer's: a stranger's handshake ends for a newcomer first, and a stranger
    finding only peers' under way is closed itself."""
    async with answering_over_tls(tmp_path, monkeypatch) as (ca, server, caps, port):   # 2 handshakes at once

        def under_way() -> list[str]:
            return sorted(a.source for a in server._handshaking)

        assert await hello_over_tls(port, ca) == b"ok hello\n"       # 127.0.0.1: a peer's source from now on
        quiet = [hello_only(port)]                                        # a peer's handshake, the longest under way
        await until(lambda: under_way() == ["127.0.0.1"], "the peer's handshake under way")
        for source in ("127.0.0.2", "127.0.0.3"):
            quiet.append(hello_only(port, source))
            await until(lambda s=source: s in under_way(), f"{source}'s handshake under way")
        assert await closed_within(quiet[1], WAIT)                    # the stranger's gave way, not the peer's
        assert under_way() == ["127.0.0.1", "127.0.0.3"]
        quiet.append(hello_only(port))
        assert await closed_within(quiet[2], WAIT)
        await until(lambda: under_way() == ["127.0.0.1", "127.0.0.1"], "the peer's two handshakes alone")
        quiet.append(hello_only(port, "127.0.0.4"))
        assert await closed_within(quiet[-1], WAIT)                   # among peers' only: the stranger is closed
        assert under_way() == ["127.0.0.1", "127.0.0.1"]
        for s in quiet:
            s.close()


async def test_a_handshake_the_caps_closed_is_not_given_back_again_by_the_handshake_share(tmp_path,
                                                                                         monkeypatch) -> None:
    """At the total cap the accept loop closes the stranger waiting longest, mid-handshake; a newcomer's handshake,
    starting before that one's task has unwound, found it still under way and ended it again: its place was given
    back twice (the caps' count below the connections open)."""
    ca, tls = server_tls(tmp_path)
    monkeypatch.setattr(listening, "HANDSHAKE_S", 60.0)
    caps = Caps(total=8, per_source=8)            # 2 handshakes at once
    server = Listener(lambda *_: asyncio.sleep(0), caps, [].append, tls=tls)
    port = await server.start("127.0.0.1")
    a, b = socket.socketpair()
    try:
        quiet = [hello_only(port) for _ in range(2)]
        await until(lambda: len(server._handshaking) == 2 and caps.count == 2, "two handshakes under way")
        assert caps.close_one_waiting() and caps.count == 1          # the accept loop, at the total cap
        assert caps.take("127.0.0.1") == TAKEN
        newcomer = Accepted(a, "127.0.0.1", caps)
        task = asyncio.ensure_future(server._connect(asyncio.get_running_loop(),
                                                     lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()),
                                                     newcomer))
        await until(lambda: newcomer in server._handshaking, "the newcomer's handshake under way")
        await asyncio.sleep(0.1)
        assert caps.count == 2, f"{caps.count} counted: the other stranger's and the newcomer's are open"
        task.cancel()
        for s in quiet:
            s.close()
    finally:
        a.close()
        b.close()
        await server.close()


async def test_a_tls_connection_closed_for_room_as_its_handshake_ends_leaves_no_transport_on_a_reused_number(
        tmp_path, monkeypatch) -> None:
    """A review: strangers' ClientHellos at an agent's TLS copy port closed a peer's connection for room just as its
    handshake ended, before the listener had its transport. The listener closed the socket itself while asyncio's
    transport, left shutting TLS down (30 s for a close_notify), still read its number: the next socket given that
    number failed ("File descriptor N is used by transport"), a traceback in the agent's log, and its push lost."""
    ca, tls = server_tls(tmp_path)
    caps = Caps(total=8, per_source=8)
    evicted: list[bool] = []

    class EvictedAsItConnects(asyncio.StreamReaderProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:   # the handshake just ended
            super().connection_made(transport)
            if not evicted:
                evicted.append(caps.close_one_waiting())

    async with serving(caps, tls=tls) as (port, _):
        with monkeypatch.context() as patched:
            patched.setattr(asyncio, "StreamReaderProtocol", EvictedAsItConnects)
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await hello_over_tls(port, ca)
        assert evicted == [True]
        await until(lambda: caps.count == 0, "the evicted connection's place given back")
        # The lowest free descriptor numbers, the evicted one's among them, go to new sockets: each connects
        for _ in range(4):
            assert await hello_over_tls(port, ca) == b"ok hello\n"
