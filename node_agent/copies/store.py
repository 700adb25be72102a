"""The holder's side: copies of other agents' snapshots, kept under ROOT/NODE/RANK as `step-S` and its
checksum `step-S.sha256`, served one push or fetch per connection (the listener reads the first line).
Rules, so a fetcher only ever gets a whole copy that was whole when it came:
- Only `step-S` with its `.sha256` is held; a push lands in `step-S.tmp`, renamed once its bytes match the
  sender's trailer, and only then are older copies removed, but for the newest step all the node's ranks hold
  and the one before it (files.settle): a broken push (short, stalled, corrupted, malformed trailer) leaves the
  previous copy in place. The one before is a spare (files.spares): kept while room allows, the first to go.
- A push must carry its node's current key and be of one of that node's ranks, of a round no older than the
  newest held of the node's and not past this node's own, of a step past the one held of its round and no further
  than this node's own ranks have reached (wire.AHEAD_WAIT_S to get there) or the server says the node, gone, noted
  itself, and fit its node's share of the limit and the limit itself next to what is held (the current copy counts
  until the new one replaces it) and what other pushes have reserved. A round is the pusher's incarnation: once a
  copy of a newer round is whole, the node's copies of older rounds at its step or later are of steps the job
  abandoned (it went back), and go.
- A copy is checked against its stored checksum as it is sent (the trailer is that checksum, so the fetcher
  refuses bytes changed at rest); one that no longer matches is deleted.
- This node's own snapshots are fetched with its own token by the node taking its place (own.py).
- What one key can hold: one push a rank waiting for the job's step (more are refused at once: each holds a
  connection at work), and one fetch a rank (a newer one ends the older: a slow reader keeps no replaced copy's
  file alive; while the older is ending a newer is refused, so a loop of fetches holds two connections, not the cap).
- Never a traceback to a peer: every failure is a `refused` line, logged once per kind and SAY_EVERY_S with the
  count since (a flood from many addresses is a few lines)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import shutil
import time
from collections.abc import Callable, Collection, Mapping

from node_agent.copies import files, room, stream, wire
from node_agent.copies.own import OwnSnapshots
from node_agent.copies.refusal import NO_KEY, Refusal, parse, stored_failed, unheard
from node_agent.copies.sources import Sources
from node_agent.copies.stream import StreamError
from node_agent.copies.wire import DropRequest, FetchRequest, PushRequest, WireError
from node_agent.training.snapshot import remove
from protocol.tokens import copy_verifier

STALL_S = 30.0          # a peer sending or reading nothing for this long is given up
EVICT_AFTER_S = 600.0   # a node's copies not renewed this long may make room for another's (see _make_room)
ANSWER_S = 5.0          # the most an answer line waits for the peer to take it
SAY_EVERY_S = 60.0      # a kind of refusal is logged at most once in this long, with how many came since


class CopyStore:
    def __init__(self, root: str, limit_bytes: int, sources: Sources, say: Callable[[str], None] = lambda s: None,
                 *, round_now: Callable[[], int], reach: Callable[[], int], own: OwnSnapshots | None = None,
                 noted: Mapping[str, int] | None = None, moving: Callable[[], Collection[str]] = tuple) -> None:
        """`sources`: a node's token and ranks now (absent: it is no source of this holder now; a fetch or drop of
        copies held is then checked against the token they came with). `round_now()`: this node's round;
        `reach()`: the newest step its own ranks hold (-1: none), how far the job is known to have come. `own`:
        this node's own snapshots, fetched by the node taking its place (own.py). `noted`: a source gone from the
        job -> the step the server says its own last note told (NodeStatus.sources_noted): its pushes reach that far.
        `moving()`: the members whose copies go to another holder now (Assignment.copies_moving): theirs held here
        make room for a source's push."""
        self.root, self.limit_bytes = root, limit_bytes
        self.stall_s = STALL_S
        self.ahead_wait_s = wire.AHEAD_WAIT_S
        self._sources, self._round_now = sources, round_now
        self._reach, self._noted = reach, noted if noted is not None else {}
        self._moving = moving
        self._own = own
        self._say = say
        self._pushing: dict[tuple[str, int], int] = {}    # (node, rank) -> bytes reserved by its push
        self._under_way: dict[tuple[str, int], tuple[int, asyncio.StreamWriter]] = {}   # -> its step, its stream
        self._waiting: dict[str, dict[int, tuple[int, asyncio.StreamWriter]]] = {}   # node -> rank -> a push
        # waiting for the job to reach its step: the step, its stream
        self._sending: dict[tuple[str, int], asyncio.StreamWriter] = {}     # (node, rank) -> the fetch it serves
        self._ending: set[tuple[str, int]] = set()      # ranks whose older fetch, ended for a newer, still runs
        self._said: dict[str, tuple[float, int]] = {}     # kind -> (when last said, how many since)

    # --- what is held -------------------------------------------------------------------------------------

    def _dir(self, node: str, rank: int) -> str:
        return files.rank_dir(self.root, node, rank)

    def _copies(self) -> list[files.Copy]:
        return files.copies(self.root)

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

    def drop_unwanted(self, wanted: Collection[str]) -> list[str]:
        """Drop the copies of every node no node can fetch them for now (Assignment.copies_wanted: the server's, which
        knows): neither one of this node's sources, nor `wanted`, nor being fetched. The nodes dropped."""
        busy = {node for node, _ in self._sending} | set(wanted)
        gone = sorted({c.node for c in self._copies() if c.node not in busy and self._sources.get(c.node) is None
                       and not self._is_own(c.node)})
        for node in gone:
            self.remove_node(node)
        return gone

    # --- serving ------------------------------------------------------------------------------------------

    async def serve(self, first_line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer the push or fetch whose first line the listener read. Never raises (only a cancellation
        passes, after the push's .tmp is removed); the caller closes the connection."""
        peer = _peer(writer)
        try:
            request = parse(first_line)
            self._check_key(request.key, request.node, isinstance(request, PushRequest))
            if isinstance(request, PushRequest):
                await self._push(request, reader, writer)
            elif isinstance(request, DropRequest):
                if not self._is_own(request.node):   # own snapshots are no copies: kept
                    self.remove_node(request.node)   # copies only: a push of it still under way finishes alone
                writer.write(wire.DROPPED)
            else:
                await self._fetch(request, writer, peer, first_line)
        except Refusal as r:
            if not unheard(r, first_line):
                self._note(r.kind, peer, f"refused {r.reason}{r.detail}", first_line)
            writer.write(wire.refused_line(r.reason))
        except (StreamError, OSError) as exc:     # a fetcher closing says why itself (own_check's: on the answer)
            if not (stream.closed_by_peer(exc) and first_line.startswith(b"rdzv-agent fetch")):
                self._note("lost", peer, f"gave up: {exc}", first_line)
        except Exception as exc:     # a bug of ours: a line in our log, no traceback to the peer
            self._note("internal", peer, f"failed: {type(exc).__name__}: {exc}", first_line)
            writer.write(wire.refused_line("internal error"))
        with contextlib.suppress(StreamError, OSError):
            await stream.drain(writer, ANSWER_S)

    def _check_key(self, key: str, node: str, pushing: bool) -> None:
        """A push needs the node's token now; a fetch or drop the one its copies came with (or today's); this
        node's own snapshots, its own token (nobody pushes them). Checked against verifiers (copy_verifier): this
        node knows no other node's token. One reason for every refusal: it tells a stranger nothing."""
        source = self._sources.get(node)
        if self._own is not None and self._is_own(node):
            expected = ["" if pushing else copy_verifier(self._own.key())]
        else:
            # (a fetch told a node's copies while the node is back with a new token: the one they came with)
            expected = [source.verifier or copy_verifier(source.token) if source is not None else "",
                        "" if pushing else files.read_verifier(os.path.join(self.root, node))]
        if not any(expected):
            raise Refusal("key", "wrong key", f"{NO_KEY}{node} here: no node whose copies this one holds)")
        given = copy_verifier(key).encode()
        if not any([hmac.compare_digest(given, v.encode()) for v in expected if v]):
            raise Refusal("key", "wrong key")

    def _note(self, kind: str, peer: str, what: str, first_line: bytes) -> None:
        """Log a kind of trouble once per SAY_EVERY_S, with how many came since: peers retrying, or a flood from
        many addresses, must not flood the log."""
        now = time.monotonic()
        said_at, since = self._said.get(kind, (-SAY_EVERY_S, 0))
        if now - said_at < SAY_EVERY_S:
            self._said[kind] = (said_at, since + 1)
            return
        self._said[kind] = (now, 0)
        more = f"; {since} more of this kind since it was last said" if since else ""
        self._say(f"copy store: {what} for {peer}, which sent {wire.quote(first_line)} (said once a minute for "
                  f"this kind: {kind}{more})")

    # --- push ---------------------------------------------------------------------------------------------

    async def _push(self, req: PushRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        slot = (req.node, req.rank)
        self._check_incarnation(req, self._copies())
        if self._reached(req.node) < req.step:
            await self._wait_for_step(req, writer)
        under_way = self._under_way.get(slot)
        if under_way is not None and req.step <= under_way[0]:
            raise Refusal("busy", "busy")
        # A newer step of the rank: the older push gives way (its room counted free), so one that trickles (a holder
        # of the node's token can send a byte before each stall bound) cannot hold the rank's copies back past the
        # next snapshot. Only once this one is taken: refused, it leaves the older one be.
        reserved = self._pushing.pop(slot, 0) if under_way is not None else 0
        try:
            spare = files.spares(held := self._copies())        # room allowing: never a push refused for them
            beyond = room.beyond_share(req, [c for c in held if c not in spare], self._pushing, self.limit_bytes,
                                       len(self._sources))
            if beyond is not None:          # refused whatever is evicted: nothing is
                raise Refusal("limit", f"memory limit full: {beyond}")
            copies = self._make_room(req, self._copies())
            self._check_incarnation(req, copies)      # (a push of the same node may have landed meanwhile)
            self._check_room(req, copies)
        except Refusal:
            if under_way is not None and self._under_way.get(slot) is under_way:
                self._pushing[slot] = reserved
            raise
        if under_way is not None:
            # Its connection ends at once; its receive ends on that (its file closed after the write under way).
            under_way[1].transport.abort()
        mine = (req.step, writer)
        self._pushing[slot], self._under_way[slot] = req.size, mine
        try:
            await self._receive(req, reader, writer)
        finally:
            if self._under_way.get(slot) is mine:       # (not when a newer push took the slot)
                del self._pushing[slot], self._under_way[slot]

    def _check_incarnation(self, req: PushRequest, copies: list[files.Copy]) -> None:
        source = self._sources.get(req.node)
        room.check_incarnation(req, copies, source.ranks if source is not None else 0, self._round_now())

    async def _wait_for_step(self, req: PushRequest, writer: asyncio.StreamWriter) -> None:
        """Waiting holds no slot: a push of a step the job never reaches must not hold up the node's real ones. One
        wait a rank, so a node's pushes of far steps cannot fill the listener (each a connection at work): a push of
        the same step or a newer one ends the one waiting (it may be a dead connection's), an older one is refused."""
        waiting = self._waiting.setdefault(req.node, {})
        older = waiting.get(req.rank)
        source = self._sources.get(req.node)
        if older is not None and req.step < older[0] or \
                older is None and len(waiting) >= (source.ranks if source is not None and source.ranks else 64):
            raise Refusal("busy", "busy: a push of this rank already waits for the job to reach its step")
        if older is not None:
            older[1].transport.abort()
        waiting[req.rank] = mine = (req.step, writer)
        try:
            await self._until_reached(req.step, lambda: waiting.get(req.rank) is mine, req.node)
        finally:
            if waiting.get(req.rank) is mine:
                del waiting[req.rank]
            if not waiting and self._waiting.get(req.node) is waiting:
                del self._waiting[req.node]

    def _reached(self, node: str) -> int:   # how far `node`'s pushes may go: the job's reach, or its own noted step
        return max(self._reach(), self._noted.get(node, -1))

    async def _until_reached(self, step: int, still: Callable[[], bool] = lambda: True, node: str = "") -> None:
        """Until this node's own ranks hold `step` (they save at the same steps as their peers, and a moment apart):
        a step beyond what the job has reached, as a holder of a node's token could push to freeze its copies,
        is refused after `ahead_wait_s`, and one `still()` no longer wants at once. Polled: another process's files
        tell nobody when they appear."""
        deadline = time.monotonic() + self.ahead_wait_s
        while (reached := self._reached(node)) < step:
            if not still():
                raise Refusal("busy", "busy: a newer push of this rank came")
            if time.monotonic() >= deadline:
                raise Refusal("ahead", f"step {step} is past what the job has reached (this node's ranks hold "
                                        f"{reached if reached >= 0 else 'none'})")
            await asyncio.sleep(0.05)

    def _make_room(self, req: PushRequest, copies: list[files.Copy]) -> list[files.Copy]:
        """Where a push does not fit, the pushing rank's copies it supersedes (room.superseded), then the copies of
        nodes that stopped pushing or of members moving to another holder (room.evictions: neither a source of this
        node now nor being fetched) go; what is held then."""
        over = sum(c.size for c in copies) + sum(self._pushing.values()) + req.size - self.limit_bytes
        if over <= 0:
            return copies
        gone = room.superseded(req, copies)
        for old in gone:                                  # its own dead weight first
            files.drop(self._dir(old.node, old.rank), old.step)
            over -= old.size
        # The spares count as room here: _check_room drops the fewest that make the push fit, none where it never
        # would (a review: a push refused all the same had taken a lost node's spare)
        over -= sum(c.size for c in files.spares(copies) if c not in gone)
        copies = self._copies()
        last: dict[str, float] = {}
        for c in copies:
            path = os.path.join(self._dir(c.node, c.rank), f"step-{c.step}")
            last[c.node] = max(last.get(c.node, 0.0), files.mtime(path))
        busy = {node for node, _ in self._sending}
        moving = [n for n in self._moving() if n not in busy and self._sources.get(n) is None and not self._is_own(n)]
        for node, why in room.evictions(copies, over, req.node, last, time.time(), EVICT_AFTER_S, moving):
            self.remove_node(node)
            self._say(f"copy store: removed node {node}'s copies, {why}, to make room for node {req.node}'s")
        return self._copies()

    def _spares_in_order(self, req: PushRequest, copies: list[files.Copy]) -> list[files.Copy]:
        """The spares in the order they make room: the pusher's, live sources', a lost node's last."""
        return sorted(files.spares(copies), key=lambda c: (c.node != req.node, self._sources.get(c.node) is None,
                                                           c.step))

    def _check_room(self, req: PushRequest, copies: list[files.Copy]) -> None:
        held, space = (self._pushing, self.limit_bytes, len(self._sources)), files.space(self.root)
        why = room.refusal(req, copies, *held, *space)
        if why and (go := room.spares_to_go(req, copies, self._spares_in_order(req, copies), *held, *space)):
            for old in go:
                files.drop(self._dir(old.node, old.rank), old.step)
            why = room.refusal(req, self._copies(), *held, *files.space(self.root))
        if why is not None:
            raise Refusal("limit", f"memory limit full: {why}")

    async def _receive(self, req: PushRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        where = self._dir(req.node, req.rank)
        final = os.path.join(where, f"step-{req.step}")
        tmp = final + ".tmp"
        landed = False
        try:
            fd = files.open_new(self.root, req.node, str(req.rank), tmp)
            try:
                stream.widen(reader)          # the payload comes in chunks, not lines
                writer.write(wire.GO)
                got = await stream.receive(reader, fd, req.size, self.stall_s)
                sent = wire.parse_trailer(await stream.read_line(reader, self.stall_s))
            finally:
                os.close(fd)
            if not hmac.compare_digest(got, sent):
                raise Refusal("checksum", "checksum mismatch")
            files.write_sum(final + ".sha256", got, req.round)
            os.replace(tmp, final)
            landed = True
            files.note_verifier(os.path.join(self.root, req.node), copy_verifier(req.key))  # a later fetch or drop
        except StreamError as exc:      # the pusher broke off (a network fault): not corruption, its own kind, so it
            raise Refusal("lost", str(exc)) from None   # never mutes a checksum mismatch's line for a minute
        except WireError as exc:
            raise Refusal("checksum", str(exc)) from None
        except OSError as exc:
            raise stored_failed(exc) from None
        finally:
            if not landed:
                remove(tmp)
                remove(final + ".sha256")     # a newer step than any held: never a held copy's checksum
        self._supersede(req)
        files.settle(os.path.dirname(where), where)
        writer.write(wire.stored_line(req.step))

    def _supersede(self, req: PushRequest) -> None:
        """A newer round's copy is whole: the node's copies of older rounds at its step or later are gone (the job
        went back below them: the steps are abandoned, though a step number may come again)."""
        for c in self._copies():
            if c.node == req.node and c.round < req.round and c.step >= req.step:
                self._discard(c.node, c.rank, c.step)

    # --- fetch --------------------------------------------------------------------------------------------

    def _is_own(self, node: str) -> bool:
        return self._own is not None and node == self._own.node

    async def _fetch(self, req: FetchRequest, writer: asyncio.StreamWriter, peer: str, first_line: bytes) -> None:
        slot = (req.node, req.rank)
        if slot in self._ending:    # a review: a member's loop of fetches filled the cap and shut out others' pushes
            raise Refusal("busy", "busy: a fetch of this rank is still ending")
        mine = self._own if self._own is not None and req.node == self._own.node else None
        own = mine.open(req.rank, req.step) if mine is not None and not req.before else None   # (no spares there)
        opened = (*own[:2], "") if own is not None else None if mine is not None else \
            self._open_held(req.node, req.rank, req.step, req.before)
        if opened is None:
            writer.write(wire.NONE)
            return
        fd, step, stored = opened
        if (older := self._sending.get(slot)) is not None:
            older.transport.abort()       # the newest fetch of a rank is served: a slow one keeps no file alive
            self._ending.add(slot)
        self._sending[slot] = writer
        pinned = None
        try:
            at_open = os.fstat(fd)
            size = at_open.st_size
            if own is not None:          # a second name meanwhile: its rank writes its next snapshots elsewhere
                pinned = files.pin(own[2], at_open)
            writer.write(wire.copy_line(step, size))
            # The trailer is the checksum stored on receipt, the bytes what is held now: a copy corrupted at rest
            # fails the fetcher's check, and is removed here (one pass over the bytes, not two). Own snapshots:
            # the checksum of the bytes as sent.
            sent = await stream.send(writer, fd, size, self.stall_s)
            if own is not None and not files.names(own[2], fd, at_open.st_mtime_ns):   # a rank wrote over it
                writer.write(wire.refused_line("the snapshot changed while it was sent"))
                return
            writer.write(wire.trailer_line(stored or sent))
            if own is not None:
                self._say(f"sent local rank {req.rank}'s snapshot of step {step} ({size / 2**20:.1f} MiB) to {peer}, "
                          f"the node taking this node's place")
            if stored and not hmac.compare_digest(sent, stored):
                self._discard(req.node, req.rank, step)
                self._note("corrupt", peer, "sent a copy corrupted at rest (the fetcher refuses it); removed it",
                           first_line)
        finally:
            os.close(fd)
            if pinned is not None:
                remove(pinned)
            if self._sending.get(slot) is writer:
                del self._sending[slot]
            else:
                self._ending.discard(slot)

    def _open_held(self, node: str, rank: int, want: int | None, before: bool) -> tuple[int, int, str] | None:
        try:
            return files.open_held(self._dir(node, rank), want, before)
        except files.CorruptAtRest as exc:      # its checksum file is unreadable: gone
            self._discard(node, rank, exc.step)
            raise Refusal("corrupt", "copy corrupted at rest (its checksum file is unreadable)") from None

    def _discard(self, node: str, rank: int, step: int) -> None:
        final = os.path.join(self._dir(node, rank), f"step-{step}")
        remove(final)
        remove(final + ".sha256")


def _peer(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    return str(name[0]) if isinstance(name, tuple) and name else "an unknown peer"
