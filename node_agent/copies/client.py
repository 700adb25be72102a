"""The agents' side of the copy wire (wire.py): `push` sends a local rank's snapshot file to the holder,
`fetch` brings the held copy of a (lost) node's rank into a worker's memory directory. Rules:
- Never raises for the network or the holder: every outcome is a result with a reason a log can print.
- `push` opens the snapshot before it connects and reads that open file to the end: a later save may
  unlink it meanwhile (snapshot.py keeps two), and the bytes sent are still the ones hashed. A second name
  (files.pin) keeps a worker from writing over it in place meanwhile.
- `fetch` writes `step-S.tmp` and renames it to `step-S` only when its own hash matches the trailer, so
  the workers' readers (snapshot.py: `step-N` only) never see a partial or a corrupted copy.
- `timeout_s` bounds each wait (connecting, an answer, a stall in the bytes), not the whole transfer: a
  paced push of many GiB takes as long as its rate says."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from node_agent.copies import files, stream, wire
from node_agent.copies.stream import StreamError
from node_agent.copies.wire import Answer, WireError
from node_agent.training.snapshot import mark_fetched, remove
from node_agent.training.snapshot import steps as snapshot_steps
from protocol import keepalive

# A source answers a fetch at once (its file is there or not): one that does not connect and answer within this
# (a hung agent, a dead host) is given up, so the node taking a place resumes from disk in seconds, not a minute.
FETCH_ANSWER_S = 10.0
# A holder answers "busy" while an older fetch of the rank it ended still ends (its file read in a thread returns):
# asked again, a few times, before the fetch counts as failed and the ranks go to disk (a round change mid-fetch
# asks again at once).
FETCH_BUSY_TRIES = 5
FETCH_BUSY_WAIT_S = 0.2
# The copy before the newest (a spare: _fetch_spares) is taken only within this share of a fetch's bound, so a slow
# one never costs the newest (the caller's bound on the whole fetch is the same figure).
SPARE_BY = 0.9


@dataclass(frozen=True)
class PushResult:
    ok: bool
    reason: str
    sent: int           # payload bytes sent


@dataclass(frozen=True)
class FetchResult:
    step: int | None    # the step now in dest_dir, or None
    reason: str
    received: int       # payload bytes received


class _Unreachable(Exception):
    pass


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, n: int) -> None:
        self.n += n


async def _answer(reader: asyncio.StreamReader, timeout_s: float) -> Answer:
    return wire.parse_answer(await stream.read_line(reader, timeout_s))


@contextlib.asynccontextmanager
async def _ask(addr: str, port: int, line: bytes, timeout_s: float, tls: ssl.SSLContext | None,
               answer_s: float | None = None
               ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter, Answer]]:
    """Connect (over TLS with `tls`: both sides show certificates, copies/tls.py), send the request `line` and
    hand over the connection with the holder's first answer, closing it after. Raises _Unreachable (no
    connection), or StreamError or WireError (no answer, or a garbled one)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, port, limit=stream.CHUNK, ssl=tls),
                                                timeout_s)
    except asyncio.TimeoutError:
        raise _Unreachable(f"unreachable: no connection to {addr}:{port} within {timeout_s:g} s") from None
    except (OSError, ValueError) as exc:
        raise _Unreachable(f"unreachable: {addr}:{port}: {exc}") from None
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            keepalive.enable(sock)          # a holder whose host went: noticed in ~4 s, not at the stall bound
        writer.write(line)
        yield reader, writer, await _answer(reader, answer_s or timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 1.0)


async def push(addr: str, port: int, *, key: str, node_id: str, local_rank: int, step: int, path: str,
               round_id: int = 0, bandwidth_bytes_s: float | None = None, timeout_s: float = 30.0,
               tls: ssl.SSLContext | None = None) -> PushResult:
    """Send the snapshot at `path` (step `step` of `local_rank` of this node, in round `round_id`) to the holder at
    addr:port. `timeout_s` bounds each wait; the holder's answer to the header may take wire.AHEAD_WAIT_S more
    (it waits for its own ranks to reach the step)."""
    if bandwidth_bytes_s is not None and not bandwidth_bytes_s > 0:
        return PushResult(False, f"bad request: bandwidth must be > 0 bytes/s, got {bandwidth_bytes_s}", 0)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return PushResult(False, "snapshot gone", 0)
    except OSError as exc:
        return PushResult(False, f"cannot read the snapshot: {exc.strerror or exc}", 0)
    pinned = None
    try:
        opened = os.fstat(fd)
        size = opened.st_size
        try:
            line = wire.push_line(wire.PushRequest(key, node_id, local_rank, step, size, round_id))
        except WireError as exc:
            return PushResult(False, f"bad request: {exc}", 0)
        pinned = files.pin(path, opened)
        return await _push_to(addr, port, line, fd, size, step, bandwidth_bytes_s, timeout_s, tls,
                              lambda: files.names(path, fd, opened.st_mtime_ns))
    finally:
        os.close(fd)
        if pinned is not None:
            remove(pinned)


async def _push_to(addr: str, port: int, line: bytes, fd: int, size: int, step: int, rate: float | None,
                   timeout_s: float, tls: ssl.SSLContext | None, unchanged: Callable[[], bool]) -> PushResult:
    sent = _Count()
    try:
        async with _ask(addr, port, line, timeout_s, tls, timeout_s + wire.AHEAD_WAIT_S) as (reader, writer, answer):
            if answer.kind != "go":
                return PushResult(False, _not_go(answer), 0)
            digest = await stream.send(writer, fd, size, timeout_s, rate=rate, count=sent)
            if not unchanged():       # no trailer: the holder drops what it got
                return PushResult(False, "snapshot replaced while it was sent", sent.n)
            writer.write(wire.trailer_line(digest))
            answer = await _answer(reader, timeout_s)
            if answer.kind == "stored" and answer.step == step:
                return PushResult(True, f"stored step={step}", sent.n)
            return PushResult(False, _not_go(answer), sent.n)
    except _Unreachable as exc:
        return PushResult(False, str(exc), 0)
    except (StreamError, WireError) as exc:
        return PushResult(False, f"lost: {exc}", sent.n)
    except OSError as exc:      # our own file: unreadable
        return PushResult(False, f"cannot read the snapshot: {exc.strerror or exc}", sent.n)


def _not_go(answer: Answer) -> str:
    if answer.kind == "refused":
        return f"refused: {json.dumps(answer.reason)}"      # the holder's words, quoted: they reach our log and page
    return f"unexpected answer: {answer.kind}" + (f" step={answer.step}" if answer.step is not None else "")


async def fetch(addr: str, port: int, *, key: str, node_id: str, local_rank: int, dest_dir: str,
                max_bytes: int | None = None, timeout_s: float = 60.0,
                tls: ssl.SSLContext | None = None, step: int | None = None, before: bool = False,
                keep: Callable[[int, int], bool] | None = None, answer_s: float | None = None) -> FetchResult:
    """Bring the holder's copy of (node_id, local_rank) into `dest_dir` as `step-S`: its newest, or `step` (with
    `before`, the newest below it: not marked fetched, the newest is). Where `keep(step, size)` of the holder's
    answer, no bytes come: the result names the step, with nothing in `dest_dir` (the caller's file stands).
    `answer_s`: the bound on connecting and on the answer (at most `timeout_s`; None: FETCH_ANSWER_S)."""
    try:
        line = wire.fetch_line(wire.FetchRequest(key, node_id, local_rank, step, before))
    except WireError as exc:
        return FetchResult(None, f"bad request: {exc}", 0)
    got = _Count()
    for _ in range(FETCH_BUSY_TRIES - 1):
        if (result := await _fetch_once(addr, port, line, dest_dir, max_bytes, timeout_s, tls, (step, before), got,
                                        keep, answer_s)):
            return result
        await _busy_back_off()
    return await _fetch_once(addr, port, line, dest_dir, max_bytes, timeout_s, tls, (step, before), got, keep,
                             answer_s) or \
        FetchResult(None, f"refused: the holder stayed busy ({FETCH_BUSY_TRIES} asks)", 0)


async def fetch_ranks(addr: str, port: int, key: str, node_id: str, dirs: dict[int, str], max_bytes: int | None,
                      timeout_s: float, tls: ssl.SSLContext | None, want: int | None = None,
                      spares: bool = True, keep: Callable[[int, int, int], bool] | None = None,
                      answer_s: float | None = None) -> list[FetchResult]:
    """`fetch` of each local rank's newest copy (or step `want`) into its directory in `dirs`; where they differ (the
    node was lost while a step's copies were landing), the newer ones again at the oldest step, which the holder
    keeps for all of them (files.py). With `spares`, the copies before it too (_fetch_spares). `keep(rank, step,
    size)`: that rank's bytes are not wanted (fetch's keep); `answer_s` as fetch's."""
    def one(rank: int, where: str, step: int | None = None) -> Awaitable[FetchResult]:
        return fetch(addr, port, key=key, node_id=node_id, local_rank=rank, dest_dir=where, max_bytes=max_bytes,
                     timeout_s=timeout_s, tls=tls, step=step, answer_s=answer_s,
                     keep=None if keep is None else lambda at, size: keep(rank, at, size))
    ranks, began = sorted(dirs.items()), time.monotonic()
    got = list(await asyncio.gather(*(one(rank, where, want) for rank, where in ranks)))
    steps = [r.step for r in got]
    if None not in steps and len(set(steps)) > 1:
        common = min(s for s in steps if s is not None)
        again = await asyncio.gather(*(one(rank, where, common) for (rank, where), s in zip(ranks, steps, strict=True)
                                       if s != common))
        newer = iter(again)
        got = [r if r.step == common else next(newer) for r in got]
    if spares and (step := got[0].step if got else None) is not None and all(r.step == step for r in got):
        await _fetch_spares(ranks, step, max_bytes, timeout_s * SPARE_BY - (time.monotonic() - began),
                            lambda rank, where, room: fetch(addr, port, key=key, node_id=node_id, local_rank=rank,
                                                            dest_dir=where, max_bytes=room, timeout_s=timeout_s,
                                                            tls=tls, step=step, before=True))
    return got


async def _fetch_spares(ranks: list[tuple[int, str]], step: int, max_bytes: int | None, left_s: float,
                        one: Callable[[int, str, int | None], Awaitable[FetchResult]]) -> None:
    """Beside each rank's `step`, its copy before it where the holder kept one (files.spares), it fits the rank's
    `max_bytes` beside all its directory holds (a rank fetched again at the common step keeps its newer one too),
    and it comes within `left_s`: two nodes lost together whose copies landed a snapshot apart (75 and 70) then
    share 70, which agreed_step finds, where every rank went to step 0 (a review). Kept only where every rank got
    the same step (none half there); an older holder takes no such ask: none."""
    rooms = [None if max_bytes is None else max_bytes - sum(_size(os.path.join(where, f"step-{s}"))
                                                            for s in snapshot_steps(where)) for _, where in ranks]
    if left_s <= 0 or any(room is not None and room <= 0 for room in rooms):
        return
    had = [set(snapshot_steps(where)) for _, where in ranks]
    try:
        got = await asyncio.wait_for(asyncio.gather(*(one(rank, where, room) for (rank, where), room
                                                      in zip(ranks, rooms, strict=True))), left_s)
        if len({r.step for r in got}) == 1 and got[0].step is not None:
            return
    except asyncio.TimeoutError:     # (each fetch cancelled removes its .tmp) the newest stands, alone
        pass
    for (_, where), before in zip(ranks, had, strict=True):
        for old in set(snapshot_steps(where)) - before - {step}:
            remove(os.path.join(where, f"step-{old}"))


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


async def _busy_back_off() -> None:
    await asyncio.sleep(FETCH_BUSY_WAIT_S)      # a back-off: the holder's ended fetch ends on its own


async def _fetch_once(addr: str, port: int, line: bytes, dest_dir: str, max_bytes: int | None, timeout_s: float,
                      tls: ssl.SSLContext | None, want: tuple[int | None, bool], got: _Count,
                      keep: Callable[[int, int], bool] | None = None,
                      answer_s: float | None = None) -> FetchResult | None:
    """One ask of `fetch`'s (`want`: its step, and whether below it); None where the holder answered busy."""
    step, before = want
    try:
        async with _ask(addr, port, line, min(timeout_s, answer_s or FETCH_ANSWER_S), tls) as (reader, _, answer):
            if answer.kind == "none":
                return FetchResult(None, "no copy held", 0)
            if answer.kind == "refused" and (answer.reason or "").startswith("busy"):
                return None
            if answer.kind != "copy" or answer.step is None or answer.size is None:
                return FetchResult(None, _not_go(answer), 0)
            if step is not None and (answer.step >= step if before else answer.step != step):
                return FetchResult(None, f"asked for step {'below ' * before}{step}, answered with step "
                                         f"{answer.step}", 0)
            if max_bytes is not None and answer.size > max_bytes:
                return FetchResult(None, f"too large: the copy of step {answer.step} is {answer.size} bytes, "
                                         f"over the {max_bytes} allowed", 0)
            if keep is not None and keep(answer.step, answer.size):     # closed unread: the holder stops sending
                return FetchResult(answer.step, f"kept: this node's own file of step {answer.step}", 0)
            return await _receive_copy(reader, dest_dir, answer.step, answer.size, timeout_s, got, mark=not before)
    except _Unreachable as exc:
        return FetchResult(None, str(exc), 0)
    except (StreamError, WireError, OSError) as exc:
        return FetchResult(None, f"lost: {exc}", got.n)


async def _receive_copy(reader: asyncio.StreamReader, dest_dir: str, step: int, size: int, timeout_s: float,
                        got: _Count, mark: bool = True) -> FetchResult:
    """The copy's bytes into `step-S.tmp`, renamed to `step-S` only when they match the trailer."""
    final = os.path.join(dest_dir, f"step-{step}")
    tmp = final + ".tmp"
    landed = False
    try:
        with contextlib.suppress(FileNotFoundError):    # a new file: never written through a symlink of its name
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            mine = await stream.receive(reader, fd, size, timeout_s, got)
            theirs = wire.parse_trailer(await stream.read_line(reader, timeout_s))
        finally:
            os.close(fd)
        if not hmac.compare_digest(mine, theirs):
            return FetchResult(None, "checksum mismatch", got.n)
        os.replace(tmp, final)
        landed = True
        if mark:
            mark_fetched(dest_dir, step)     # a copy, which may lag the job: agreed_step counts its rank behind
        return FetchResult(step, f"fetched step={step}", got.n)
    except OSError as exc:      # our own file (stream errors are StreamError): no room, or no directory
        return FetchResult(None, f"could not write {tmp}: {exc.strerror or exc}", got.n)
    finally:
        if not landed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


async def drop(addr: str, port: int, *, key: str, node_id: str, timeout_s: float = 2.0,
               tls: ssl.SSLContext | None = None) -> bool:
    """Ask the holder at addr:port to remove `node_id`'s copies (no longer needed there); whether it did."""
    try:
        async with _ask(addr, port, wire.drop_line(wire.DropRequest(key, node_id)), timeout_s, tls) as (_, _, answer):
            return answer.kind == "dropped"
    except (_Unreachable, StreamError, WireError, OSError):
        return False


async def drop_all(holders: list[tuple[str, int]], key: str, node_id: str, timeout_s: float,
                   tls: ssl.SSLContext | None = None) -> None:
    """`drop` at each (addr, port), together: a node taking a gone node's place lets that node's copies go."""
    await asyncio.gather(*(drop(addr, port, key=key, node_id=node_id, timeout_s=timeout_s, tls=tls)
                           for addr, port in holders))
