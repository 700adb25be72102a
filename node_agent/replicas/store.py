"""The holder's side: copies of other agents' snapshots, kept under ROOT/NODE/RANK as `step-S` and its
checksum `step-S.sha256`, served one push or fetch per connection (the listener reads the first line).
Rules, so a fetcher only ever gets a whole copy that was whole when it came:
- Only `step-S` with its `.sha256` is held; a push lands in `step-S.tmp`, renamed once its bytes match the
  sender's trailer, and only then are older copies removed, but for the newest step all the node's ranks hold
  (files.settle): a broken push (short, stalled, corrupted, malformed trailer) leaves the previous copy in place.
- A push must carry the job's current key, a newer step than the one held, and fit the limit next to what
  is held (the current copy counts until the new one replaces it) and what other pushes have reserved.
- A copy is checked against its stored checksum as it is sent (the trailer is that checksum, so the fetcher
  refuses bytes changed at rest); one that no longer matches is deleted.
- Never a traceback to a peer: every failure is a `refused` line, logged at most once per kind and peer."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.replicas import files, stream, wire
from node_agent.replicas.stream import StreamError
from node_agent.replicas.wire import DropRequest, FetchRequest, PushRequest, WireError

STALL_S = 30.0          # a peer sending or reading nothing for this long is given up
FREE_RESERVE = 0.25     # copies never leave less of /dev/shm free than this share: its workers need some too
EVICT_AFTER_S = 600.0   # a node's copies not renewed this long may make room for another's (see _make_room)
ANSWER_S = 5.0          # the most an answer line waits for the peer to take it
_SAID_MAX = 4096        # peers x kinds remembered for the once-only log, then forgotten


class _Refusal(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class _Copy:
    node: str
    rank: int
    step: int
    size: int


class ReplicaStore:
    def __init__(self, root: str, limit_bytes: int, key: Callable[[str], str | None],
                 say: Callable[[str], None] = lambda s: None) -> None:
        """`key(node)`: the token a node's copies must come with now (None or "": it is no source of this holder
        now; a fetch or drop of copies held is then checked against the token they came with)."""
        self.root = root
        self.limit_bytes = limit_bytes
        self.stall_s = STALL_S
        self.bytes_in = 0
        self.bytes_out = 0
        self.refusals: dict[str, int] = {}
        self._key = key
        self._say = say
        self._pushing: dict[tuple[str, int], int] = {}    # (node, rank) -> bytes reserved by its push
        self._said: set[tuple[str, str]] = set()

    # --- what is held -------------------------------------------------------------------------------------

    def _dir(self, node: str, rank: int) -> str:
        return os.path.join(self.root, node, str(rank))

    def _copies(self) -> list[_Copy]:
        """Every complete copy on disk (a crash may leave two of one (node, rank): both count as bytes)."""
        found: list[_Copy] = []
        for node in files.listdir(self.root):
            if not wire.valid_node(node):
                continue
            for rank in files.listdir(os.path.join(self.root, node)):
                if files.RANK_DIR.fullmatch(rank) is None or int(rank) > wire.MAX_RANK:
                    continue
                where = self._dir(node, int(rank))
                found += [_Copy(node, int(rank), step, files.size(os.path.join(where, f"step-{step}")))
                          for step in files.complete_steps(where)]
        return found

    def held(self) -> dict[tuple[str, int], int]:
        """(node, rank) -> the step of its complete copy (the newest, should a crash have left two)."""
        return {(c.node, c.rank): c.step for c in sorted(self._copies(), key=lambda copy: copy.step)}

    def held_bytes(self) -> int:
        return sum(c.size for c in self._copies())

    def remove_node(self, node_id: str) -> None:
        """Drop every copy of a node (it left the job for good). ValueError for an id that is no node id."""
        wire.check_node(node_id)
        shutil.rmtree(os.path.join(self.root, node_id), ignore_errors=True)

    def clear(self) -> None:
        """Drop every copy (the job ended, or its key changed); the root is made again when needed."""
        shutil.rmtree(self.root, ignore_errors=True)

    # --- serving ------------------------------------------------------------------------------------------

    async def serve(self, first_line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer the push or fetch whose first line the listener read. Never raises (only a cancellation
        passes, after the push's .tmp is removed); the caller closes the connection."""
        peer = _peer(writer)
        try:
            request = _parse(first_line)
            self._check_key(request.key, request.node, isinstance(request, PushRequest))
            if isinstance(request, PushRequest):
                await self._push(request, reader, writer)
            elif isinstance(request, DropRequest):
                self.remove_node(request.node)       # copies only: a push of it still under way finishes alone
                writer.write(wire.DROPPED)
            else:
                await self._fetch(request, writer, peer, first_line)
        except _Refusal as r:
            self.refusals[r.kind] = self.refusals.get(r.kind, 0) + 1
            self._note(r.kind, peer, f"refused {r.reason}", first_line)
            writer.write(wire.refused_line(r.reason))
        except (StreamError, OSError) as exc:
            self._note("lost", peer, f"gave up: {exc}", first_line)
        except Exception as exc:     # a bug of ours: a line in our log, no traceback to the peer
            self._note("internal", peer, f"failed: {type(exc).__name__}: {exc}", first_line)
            writer.write(wire.refused_line("internal error"))
        with contextlib.suppress(StreamError, OSError):
            await stream.drain(writer, ANSWER_S)

    def _check_key(self, key: str, node: str, pushing: bool) -> None:
        """A push needs the node's token now; a fetch or drop the one its copies came with (or today's)."""
        current = self._key(node) or ("" if pushing else files.read_token(os.path.join(self.root, node)))
        if not current:
            raise _Refusal("key", f"no token for node {node} here (not a node whose copies this one holds)")
        if not hmac.compare_digest(key.encode(), current.encode()):
            raise _Refusal("key", "wrong key")

    def _note(self, kind: str, peer: str, what: str, first_line: bytes) -> None:
        """Log once per kind of trouble and peer address: a peer retrying must not flood the log."""
        if (peer, kind) in self._said:
            return
        if len(self._said) >= _SAID_MAX:
            self._said.clear()
        self._said.add((peer, kind))
        self._say(f"replica store: {what} for {peer}, which sent {wire.quote(first_line)} "
                  f"(said once per peer for this kind: {kind})")

    # --- push ---------------------------------------------------------------------------------------------

    async def _push(self, req: PushRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        slot = (req.node, req.rank)
        if slot in self._pushing:
            raise _Refusal("busy", "busy")
        copies = self._copies()
        mine = [c for c in copies if (c.node, c.rank) == slot]
        if mine and req.step <= max(c.step for c in mine):
            raise _Refusal("stale", f"stale step {req.step} (holding {max(c.step for c in mine)})")
        copies = self._make_room(req.node, req.size, copies)
        self._check_room(req.size, sum(c.size for c in copies), sum(c.size for c in mine))
        self._pushing[slot] = req.size
        try:
            await self._receive(req, reader, writer)
        finally:
            del self._pushing[slot]

    def _make_room(self, pusher: str, size: int, copies: list[_Copy]) -> list[_Copy]:
        """Where a push does not fit, the copies of nodes that stopped pushing (none for EVICT_AFTER_S: gone from
        the job, their place taken long since) go, the longest silent first; what is held then."""
        over = sum(c.size for c in copies) + sum(self._pushing.values()) + size - self.limit_bytes
        if over <= 0:
            return copies
        last: dict[str, float] = {}
        for c in copies:
            path = os.path.join(self._dir(c.node, c.rank), f"step-{c.step}")
            last[c.node] = max(last.get(c.node, 0.0), files.mtime(path))
        now = time.time()
        for node, at in sorted(last.items(), key=lambda item: item[1]):
            if over <= 0 or now - at < EVICT_AFTER_S:
                break
            if node != pusher:
                over -= sum(c.size for c in copies if c.node == node)
                self.remove_node(node)
                self._say(f"replica store: removed node {node}'s copies, not renewed for {now - at:.0f}s, to make "
                          f"room for node {pusher}'s")
        return self._copies()

    def _check_room(self, size: int, held: int, mine: int) -> None:
        reserved = sum(self._pushing.values())
        if size > self.limit_bytes:
            raise _Refusal("limit", f"memory limit full: the copy's {size} bytes exceed the limit of "
                                    f"{self.limit_bytes} bytes")
        if held + reserved + size > self.limit_bytes:
            raise _Refusal("limit", f"memory limit full: {held} bytes held ({mine} of them this rank's current "
                                    f"copy, kept until the new one is whole), {reserved} reserved by pushes under "
                                    f"way, {size} new; limit {self.limit_bytes} bytes")
        free, total = files.space(self.root)
        if free - reserved - size < total * FREE_RESERVE:
            raise _Refusal("limit", f"memory limit full: the holder's file system would keep less than "
                                    f"{FREE_RESERVE:.0%} of its {total} bytes free ({free} free, {reserved} reserved, "
                                    f"{size} new): left to its own workers (NCCL's and DataLoaders' shared memory)")

    async def _receive(self, req: PushRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        where = self._dir(req.node, req.rank)
        final = os.path.join(where, f"step-{req.step}")
        tmp = final + ".tmp"
        landed = False
        try:
            fd = files.open_new(self.root, req.node, str(req.rank), tmp)
            try:
                writer.write(wire.GO)
                got = await stream.receive(reader, fd, req.size, self.stall_s, self._count_in)
                sent = wire.parse_trailer(await stream.read_line(reader, self.stall_s))
            finally:
                os.close(fd)
            if not hmac.compare_digest(got, sent):
                raise _Refusal("checksum", "checksum mismatch")
            files.write_text(final + ".sha256", got)
            os.replace(tmp, final)
            landed = True
            files.note_token(os.path.join(self.root, req.node), req.key)   # for a later fetch or drop of them
        except (StreamError, WireError) as exc:
            raise _Refusal("checksum", str(exc)) from None
        except OSError as exc:
            raise _stored_failed(exc) from None
        finally:
            if not landed:
                files.remove(tmp)
                files.remove(final + ".sha256")     # a newer step than any held: never a held copy's checksum
        files.settle(os.path.dirname(where), where)
        writer.write(wire.stored_line(req.step))

    def _count_in(self, n: int) -> None:
        self.bytes_in += n

    def _count_out(self, n: int) -> None:
        self.bytes_out += n

    # --- fetch --------------------------------------------------------------------------------------------

    async def _fetch(self, req: FetchRequest, writer: asyncio.StreamWriter, peer: str, first_line: bytes) -> None:
        opened = self._open_held(req.node, req.rank, req.step)
        if opened is None:
            writer.write(wire.NONE)
            return
        fd, step, stored = opened
        try:
            size = os.fstat(fd).st_size
            writer.write(wire.copy_line(step, size))
            # The trailer is the checksum stored on receipt, the bytes what is held now: a copy corrupted at rest
            # fails the fetcher's check, and is removed here (one pass over the bytes, not two).
            sent = await stream.send(writer, fd, size, self.stall_s, count=self._count_out)
            writer.write(wire.trailer_line(stored))
            if not hmac.compare_digest(sent, stored):
                self._discard(req.node, req.rank, step)
                self.refusals["corrupt"] = self.refusals.get("corrupt", 0) + 1
                self._note("corrupt", peer, "sent a copy corrupted at rest (the fetcher refuses it); removed it",
                           first_line)
        finally:
            os.close(fd)

    def _open_held(self, node: str, rank: int, want: int | None = None) -> tuple[int, int, str] | None:
        """(open fd, step, stored checksum) of the held copy (the newest, or step `want`), or None. A push that
        lands meanwhile removes the older copy between looking and opening: look again."""
        for _ in range(3):
            held = files.complete_steps(self._dir(node, rank))
            step = max(held, default=None) if want is None else want if want in held else None
            if step is None:
                return None
            path = os.path.join(self._dir(node, rank), f"step-{step}")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                with open(path + ".sha256", encoding="ascii", errors="replace") as f:
                    stored = f.read(wire.MAX_LINE).strip()
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            if re.fullmatch(r"[0-9a-f]{64}", stored) is None:
                os.close(fd)
                self._discard(node, rank, step)
                raise _Refusal("corrupt", "copy corrupted at rest (its checksum file is unreadable)")
            return fd, step, stored
        return None

    def _discard(self, node: str, rank: int, step: int) -> None:
        final = os.path.join(self._dir(node, rank), f"step-{step}")
        files.remove(final)
        files.remove(final + ".sha256")


def _parse(first_line: bytes) -> PushRequest | FetchRequest | DropRequest:
    try:
        return wire.parse_request(first_line)
    except WireError as exc:
        raise _Refusal("bad_request", f"bad request: {exc}") from None


def _stored_failed(exc: OSError) -> _Refusal:
    """Our own file failed: a full file system is the memory limit; anything else is named as such."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return _Refusal("limit", "memory limit full: the holder's file system is full")
    return _Refusal("io", f"could not store the copy: {exc.strerror or type(exc).__name__}")


def _peer(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    return str(name[0]) if isinstance(name, tuple) and name else "an unknown peer"
