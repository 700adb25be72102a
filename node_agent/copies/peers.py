"""Peer copies of the workers' in-memory snapshots, the agent's side (the wire and the holder's store: the
rest of this package). A lost node takes its snapshots with it; with a copy of each of its ranks' newest on
another node, the node that takes its place resumes from that step instead of every rank going back to disk.
- Each member pushes the newest `step-N` all its local ranks hold to the members its assignment names
  (`Assignment.replicas`: in another failure domain), from the agent, never the worker: a scan of the memory
  directories every PUSH_SCAN_S, the local ranks' pushes together, sharing --replica-bandwidth, each with this
  round's id (the node's incarnation: a newer round's copy supersedes an older round's, so a job that went back,
  or an agent restarted, copies again). A push is copied only when the holder stored it: a refusal is counted
  and shown (CopiesNote), said once per kind, tried again RETRY_S later.
- A node that takes a gone node's place (`Assignment.copies_of`/`copies_at`) fetches that node's copies
  into its own ranks' memory directories while its workers start (FETCH_LIMIT_S at most; agreed_step waits for
  it); the holder drops them once the server heard this node's own copies landed. None there: every rank falls
  back to disk (agreed_step), said in one line. A node back at its place as a new incarnation (its agent restarted)
  is told of its own copies: fetched where its memory did not outlive its predecessor, else where cut short
  (own_check.py). A suspect swapped out is the source of its own snapshots for its taker (copies/own.py).
- Copies held for others live under the node's memory directory: removed with it when the job ends or the node
  leaves, taken up by its next agent, or swept (workers/memory.py); a node whose job is over asks its holders to
  drop its copies at once. A job whose copies go nowhere is said once."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import time
from collections.abc import Callable, Iterable

from node_agent.client.listener import Listener, agent_caps
from node_agent.copies.client import FetchResult, drop, drop_all, fetch_ranks, push
from node_agent.copies.last_copies import FLUSH_LIMIT_S, due_bytes, last_copies
from node_agent.copies.local_steps import common_step, lag_line, mark_fetching, while_marked, written_since
from node_agent.copies.own import OwnSnapshots, keep_token, left_dirs, left_key
from node_agent.copies.own_check import check_own, no_room_line
from node_agent.copies.store import CopyStore
from node_agent.copies.tls import CopyTls
from node_agent.copies.wire import is_copy_request
from node_agent.training import snapshot
from node_agent.workers.memory import COPIES, MemoryDirs
from protocol.accepting import Caps
from protocol.messages import Assignment, CopySource, Witness
from protocol.notes import CopiesNote, SourceStep

PUSH_SCAN_S = 0.1       # how often the memory directories are looked at for a newer snapshot (a dir listing)
FETCH_LIMIT_S = 60.0    # a node taking a place waits this long for its copies, then starts without them
DROP_LIMIT_S = 1.0      # a leaving node's goodbye to each holder of its copies
RETRY_S = 1.0           # a peer a push could not reach or that refused is tried again this much later (cheap)
MAX_KINDS = 16          # kinds of refusal said, once each (a hostile holder words each anew); past it, one kind


class PeerCopies:
    def __init__(self, memory: MemoryDirs, nproc: int, node_id: str, say: Callable[[str], None],
                 bandwidth: int, tls: CopyTls | None = None, server_tls: bool = False,
                 caps: Caps | None = None, stepping: Callable[[int, int], bool] | None = None,
                 static: bool = False) -> None:
        """`tls`: copies go over TLS (copies/tls.py); `server_tls`: the server uses TLS, so copies without it
        would cross the network in the clear: this node then makes and takes none. `caps`: the connections the
        agent's listeners may hold together (client/listener.py). `stepping(round, ranks)`: whether that many
        local ranks of the round have each done a step (LocalWorkers.all_stepping). `static`: a static launch
        (--node-rank), where no server pairs the nodes, so no copies whatever the failure domains."""
        self.static, self.memory, self.nproc, self.node_id = static, memory, nproc, node_id
        self._stepping, self._say, self.bandwidth = stepping, say, bandwidth
        self._past_start = self._alike = False     # this round's ranks all stepped / are replicas that resume alike
        self._at_most: int | None = None           # no push past this step (a leaver's last copies: `close`)
        self.tls, self.server_tls, self._connect = tls, server_tls, tls.connect if tls is not None else None
        self._listener: Listener | None = None
        self._caps = caps if caps is not None else agent_caps()
        self.key, self.round, self.noted = "", -1, -1    # Assignment's copy_token, round (incarnation), noted_step
        self.heard_step = -1                       # the newest snapshot step a note the server answered told
        self.left_noted: dict[str, int] = {}       # a source gone while the job waits -> its step (`told`)
        self._round_began = 0.0                    # when this round's workers were started (time.time())
        self.sources: dict[str, CopySource] = {}   # nodes whose copies it holds, with their tokens (copy_sources)
        self.moving: tuple[str, ...] = ()          # members whose copies go elsewhere now (copies_moving: room.py)
        self.landed: tuple[str, ...] = ()          # of them, those whose copy landed there (NodeStatus.moved_landed)
        self.targets: tuple[Witness, ...] = ()     # where this node's copies go now
        self.store: CopyStore | None = None     # the copies this node holds for others
        self.pushed: dict[tuple[str, int, int], int] = {}    # (addr, port, local rank) -> the step it holds
        self.copied: dict[int, tuple[int, str]] = {}         # local rank -> (its newest copied step, where)
        self.sent_bytes, self.refused, self.last_refusal = 0, 0, ""
        self._said: set[str] = set()
        self._retry_at: dict[tuple[str, int, int], float] = {}
        self._dirs: dict[int, str] = {}            # this round's local rank -> memory directory
        self._pusher: asyncio.Task[None] | None = None
        self._to_holder: dict[tuple[str, int], asyncio.Task[None]] = {}    # (addr, port) -> its pushes under way
        self._in_flight: dict[tuple[str, int], int] = {}                   # (addr, port) -> how many
        self.on_copied: Callable[[], None] = lambda: None    # a push succeeded (the agent may tell the server)
        self._fetching: asyncio.Task[None] | None = None
        self.let_go: tuple[str, str, list[tuple[str, int]], int] | None = None  # a fetched node's copies, to drop
        self._dropping: asyncio.Future[None] | None = None      # their drop (`heard`), under way
        self._last_note: CopiesNote | None = None   # what note() said last (shown again where it cannot read)

    def _holder_store(self) -> CopyStore | None:
        """The store of copies held for others, under this run's memory directory (made on first need)."""
        if self.store is None:
            dirs = self.memory.dirs(self.nproc)
            if not dirs or self.memory.root is None or self.memory.rank_limit is None:
                return None
            limit = self.memory.rank_limit * max(1, self.nproc)
            # Before this agent's first round: the memory its previous agent left, with that agent's key (own.py)
            root = self.memory.root
            own = OwnSnapshots(self.node_id, key=lambda: left_key(root) if self.round < 0 else self.key,
                               dirs=lambda: left_dirs(root) if self.round < 0 else self._dirs)
            self.store = CopyStore(os.path.join(self.memory.root, COPIES), limit, self.sources, self._say,
                                   round_now=lambda: self.round, reach=self._reach, own=own, noted=self.left_noted,
                                   moving=lambda: [m for m in self.moving if m in self.landed])
        return self.store

    def _reach(self) -> int:
        """The newest step its own ranks hold, or the server noted (a newcomer never stepped): how far the job came."""
        return max([self.noted, *(s for s in map(snapshot.newest, self._dirs.values()) if s is not None)])

    async def listen(self, addr: str, plain_port: int) -> int:
        """Where this node takes copies (JoinRequest.copy_port): a TLS listener of its own, the witnesses' plain
        one (`plain_port`), or 0 where the server uses TLS and this node has no certificate, or it keeps no
        in-memory snapshots (--no-memory-dir: it has no room for others' either)."""
        if not self.memory.enabled:
            return 0
        if self.tls is not None:
            self._listener = Listener(self._serve_tls, self._caps, self._say, tls=self.tls.listen,
                                      name="peer-copy TLS port")
            port = await self._listener.start(addr)
            if not port:
                self._say("peer copies off: no port for their TLS listener")
            return port
        if self.server_tls:
            self._say("peer copies off: the server uses TLS, and copies would cross the network in the clear "
                      "(give this node --tls-cert and --tls-key, signed by --tls-ca's CA)")
            return 0
        return plain_port

    async def _serve_tls(self, line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if is_copy_request(line):
            await self.serve(line, reader, writer)

    async def serve(self, first_line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A peer's push, fetch or drop, its first line read by a listener (client/witness.py's, or ours)."""
        if self.store is None and self.memory.root is None and self.memory.enabled:
            await asyncio.to_thread(self.memory.dirs, 0)     # off the loop: its first open may wait (owners.claim)
        store = self._holder_store()
        clear = writer.get_extra_info("ssl_object") is None
        refusal = (b"this node keeps no in-memory snapshots (--no-memory-dir)" if store is None else
                   b"this node takes copies over TLS only" if self.tls is not None and clear else
                   b"the server uses TLS: this node takes no copies in the clear" if self.server_tls and clear
                   else b"")
        if store is None or refusal:
            writer.write(b"rdzv-agent refused " + refusal + b"\n")
            with contextlib.suppress(OSError):
                await writer.drain()
            return
        await store.serve(first_line, reader, writer)

    async def before_spawn(self, a: Assignment, dirs: dict[int, str]) -> None:
        """Take the round's copy settings; fetch a gone node's copies where this node takes its place."""
        if a.round_id != self.round:
            self._round_began, self._past_start = time.time(), False
        self.key, self.targets, self._dirs, self.round, self.noted = a.copy_token, a.replicas, dirs, a.round_id, \
            a.noted_step
        self._alike, self.moving, self.landed = a.ranks_alike and a.resume_at_most < 0, a.copies_moving, ()
        keep_token(self.memory.root if self.memory.root == self.memory.home else None, self.key)
        self.sources.clear()
        self.sources.update((s.node_id, s) for s in a.copy_sources)
        if self.server_tls and self.tls is None:        # no copies in the clear (said once at listen)
            self.targets = ()
            return
        if not self.targets and self.memory.enabled and a.group_world_size > 1:    # alone: nobody to hold them
            self._say_once("none", "peer copies: none in a static launch (--node-rank: no rendezvous server pairs "
                           "the nodes), so a lost node's ranks resume from disk" if self.static else
                           "peer copies off for this job (--replicas 0): a lost node's ranks resume from disk"
                           if not a.copy_token else
                           "peer copies: no member takes this node's copies: none is in another failure domain "
                           "(--failure-domain; by default each host is one), so a lost node's ranks resume from disk "
                           "(the job's page says why)")
        if a.copies_of == self.node_id and a.copies_at is not None and not self.memory.enabled and \
                (line := no_room_line(self.node_id, a.copies_at.addr, a.copies_at.port, a.noted_step)):
            self._say_once("no room", line)
        if a.copies_of and a.copies_at is not None and dirs:
            # This node back at its place as a new incarnation (its agent restarted) fetches its own copies where its
            # memory did not outlive its previous agent; where it did, those of its files cut short (own_check.py).
            kept = common_step(dirs) if a.copies_of == self.node_id else {}
            mark_fetching(dirs, True)     # the workers start meanwhile: agreed_step waits while marked
            # After replicas diverged, the step every rank resumes from: no newer copy is taken.
            want = a.resume_at_most if a.resume_at_most >= 0 else None
            if kept:
                holder = (a.copies_at.addr, a.copies_at.port, a.copies_token, self.node_id)
                self._fetching = asyncio.create_task(while_marked(dirs, check_own(
                    dirs, next(iter(kept.values()))[0], holder, self.memory.rank_limit, self._connect, self._say,
                    want)))
            else:
                # Spares (copies before the newest) only where another gone node is fetched this round: copies_fetched
                sources = [a.copies_at, *([a.copies_also] if a.copies_also is not None else [])]
                fetched = a.copies_wanted if a.copies_fetched is None else a.copies_fetched     # (None: older server)
                spares = bool(set(fetched or ()) - set(a.copies_moving) - {a.copies_of})
                self._fetching = asyncio.create_task(while_marked(dirs, self._fetch(a.copies_of, a.copies_token,
                                                                                  sources, dirs, want, spares)))
        if self.targets and self.key and (self._pusher is None or self._pusher.done()):
            self._pusher = asyncio.create_task(self._push_loop())

    async def fetched(self) -> None:    # until the fetch under way, if any, is over (it never raises)
        if self._fetching is not None:
            await asyncio.gather(self._fetching, return_exceptions=True)

    async def _fetch(self, gone: str, token: str, sources: list[Witness], dirs: dict[int, str],
                     want: int | None, spares: bool) -> None:
        """From the first source that has a step for every rank (a gone node itself, then its peer copies' holder)."""
        began = time.monotonic()
        for at in sources:
            try:
                got = await asyncio.wait_for(fetch_ranks(at.addr, at.port, token, gone, dirs, self.memory.rank_limit,
                                                         FETCH_LIMIT_S, self._connect, want, spares), FETCH_LIMIT_S)
            except asyncio.TimeoutError:      # a cancelled fetch removes its partial file
                got = [FetchResult(None, f"not all there within {FETCH_LIMIT_S:g}s", 0)]
            if all(r.step is not None for r in got) and len({r.step for r in got}) == 1:
                break
            why = next((r.reason for r in got if r.step is None), "no step held for every rank")
            self._say(f"no copy of node {gone}'s snapshots for every rank at {at.addr}:{at.port} ({why})" +
                      ("" if at is not sources[-1] else ": ranks whose copy is missing resume from disk, and "
                                                        "agreed_step sends every rank there"))
        else:
            return
        size = sum(r.received for r in got)
        # Its copies are this node's now: let go once the server heard this node's own copies landed (`heard`)
        self.let_go = (gone, token, [(s.addr, s.port) for s in sources], got[0].step or 0) \
            if gone != self.node_id else None
        self._say(f"fetched node {gone}'s snapshots of step {got[0].step} from {at.addr}:{at.port} ({len(got)} "
                  f"ranks, {size / 2**20:.1f} MiB in {time.monotonic() - began:.2f}s): this node's ranks resume "
                  f"where {gone}'s left off, if it fits this round (each worker checks)")

    async def _push_loop(self) -> None:
        while True:
            await asyncio.sleep(PUSH_SCAN_S)     # a look at the directories on a schedule, not a wait for anything
            try:
                self._start_pushes()             # each holder's pushes go on their own (not awaited here)
            except OSError as exc:               # a directory gone under us (the job ending): said, then again
                self._say_once("scan", f"peer copies: cannot read the memory directories ({exc}); trying again")

    async def _scan(self) -> None:      # start the pushes due, and wait for them
        await asyncio.gather(*self._start_pushes())

    def _start_pushes(self) -> list[asyncio.Task[None]]:
        """The pushes due, started: one task per holder not busy with an earlier one, so a slow holder (a member
        reading at a trickle, inside every stall bound) holds back its own copies only, not those to the others (a
        review: with --replicas 2 every push waited for the slow one, and a lost node resumed a snapshot back)."""
        # A snapshot of an earlier round, or a copy fetched, may be of steps the job abandons (the workers' agreed_step
        # removes it as they start), and a copy of it tagged with this round makes the holder refuse the steps the job
        # resumed from (reviews: a later loss sent every rank to step 0; a third: another node had lost its copies).
        # So until every local rank has stepped (past its agreement), only what this round's workers wrote goes; then
        # its newest too, whatever wrote it (the step it resumed from, for a holder new in this round: a second review).
        newest = common_step(self._dirs, self._at_most)
        if newest and not self._past_start:
            if self._stepping is not None and self._stepping(self.round, len(self._dirs)):
                self._past_start = True
            elif not all(written_since(path, self._round_began) and not snapshot.is_copy(self._dirs[rank], step)
                         for rank, (step, path) in newest.items()):
                newest = {}
        # A copy newer than the newest step here is of steps the job abandoned (it went back): no copy of this run.
        for rank, where in self._dirs.items():
            here = snapshot.newest(where)
            if rank in self.copied and (here is None or self.copied[rank][0] > here):
                del self.copied[rank]
        # The local ranks' copies go together, so a holder has one step for all of them (agreed_step needs one),
        # sharing --replica-bandwidth.
        self._to_holder = {at: task for at, task in self._to_holder.items() if not task.done()}
        due = [(t, rank, step, path) for t in self.targets if (t.addr, t.port) not in self._to_holder
               for rank, (step, path) in newest.items() if self._due(t, rank, step)]
        pushes = len(due) + sum(self._in_flight.values())
        rate = float(self.bandwidth) / pushes if self.bandwidth and pushes else None
        started = []
        for at, target in {(t.addr, t.port): t for t, *_ in due}.items():
            mine = [(rank, step, path) for t, rank, step, path in due if (t.addr, t.port) == at]
            task = asyncio.create_task(self._push_to(target, mine, rate))
            self._to_holder[at] = task
            started.append(task)
        return started

    async def _push_to(self, target: Witness, pushes: list[tuple[int, int, str]], rate: float | None) -> None:
        """`pushes` (local rank, step, file) to one holder, together (a holder has one step for all of them)."""
        at = (target.addr, target.port)
        self._in_flight[at] = len(pushes)
        try:
            await asyncio.gather(*(self._push(target, rank, step, path, rate) for rank, step, path in pushes))
        finally:
            self._in_flight.pop(at, None)

    async def _flush(self, at_most: int | None = None) -> None:    # the pushes under way, then those due, to their end
        self._at_most = at_most                                 # (the newest step, none past `at_most`)
        await asyncio.gather(*self._to_holder.values(), return_exceptions=True)
        await self._scan()

    def _due(self, target: Witness, rank: int, step: int) -> bool:
        """Not the step the target holds of this node (lower too: the job went back), and not refused lately."""
        held = (target.addr, target.port, rank)
        return self.pushed.get(held, -1) != step and time.monotonic() >= self._retry_at.get(held, 0.0)

    async def _push(self, target: Witness, rank: int, step: int, path: str, rate: float | None) -> None:
        held = (target.addr, target.port, rank)
        result = await push(target.addr, target.port, key=self.key, node_id=self.node_id, local_rank=rank, step=step,
                            path=path, round_id=max(0, self.round), bandwidth_bytes_s=rate, tls=self._connect)
        self.sent_bytes += result.sent
        if result.ok:
            self.pushed[held] = step
            self.copied[rank] = (step, f"{target.addr}:{target.port}")
            self.on_copied()
            self._lagging(rank, step)
            return
        if (go := self.let_go) is not None and "limit full" in result.reason:   # no room for both: theirs go now
            self.let_go = None
            await drop_all(go[2], go[1], go[0], DROP_LIMIT_S, self._connect)
        self._retry_at[held] = time.monotonic() + RETRY_S
        self.refused += 1
        self.last_refusal = "".join(c if c.isprintable() else "?" for c in f"{target.addr}:{target.port}: "
                                    f"{result.reason}")[:256]
        kind = re.sub(r"[0-9]+", "#", ":".join(result.reason.split(":")[:2]))[:60]     # numbers: one kind
        more = kind not in self._said and len(self._said) >= MAX_KINDS
        self._say_once("more kinds" if more else kind, f"copy of local rank {rank}'s step {step} to {target.addr}:"
                       f"{target.port} not made: {result.reason} (training goes on; tried again on the next snapshot)"
                       + ("; further kinds of refusal are not said (the server's view counts them)" if more else ""))

    def _lagging(self, rank: int, step: int) -> None:     # said once (local_steps.lag_line)
        with contextlib.suppress(OSError, KeyError):
            if line := lag_line(rank, step, snapshot.steps(self._dirs[rank]), self.bandwidth):
                self._say_once("lag", line)

    def _say_once(self, kind: str, line: str) -> None:
        """Once per kind of trouble (a full peer, one away): news once; training goes on meanwhile."""
        if kind not in self._said:
            self._said.add(kind)
            self._say(line)

    def note(self) -> CopiesNote | None:
        """What the server shows of this node's copies and newest snapshot (None: no memory dirs yet). With copies off
        for its round the snapshot alone is said (`copying`): a node whose agent restarts is waited for where it
        holds state of its own (rdzv_server/core/awaiting.py). With --no-memory-dir, -1 for both: unsaid, the floors
        waited for its copy, and every other rank kept every snapshot until its memory limit (a review)."""
        if not self.memory.enabled:
            return CopiesNote(local_step=-1, copied_step=-1, copying=False)
        if not self.targets and self.store is None and not self._dirs:
            return None
        try:
            local = next(iter(common_step(self._dirs).values()), (-1, ""))[0]
            held = self.store.held_bytes() if self.store is not None else 0
        except OSError as exc:      # out of descriptors (a flood at the copy port): the last note stands
            self._say_once("note", f"peer copies: cannot read the memory directories for the server's view "
                                   f"({exc.strerror or exc}): it shows the last figures until they can be read")
            return self._last_note
        copied = [self.copied.get(rank, (-1, ""))[0] for rank in self._dirs]
        holder = next((where for _, where in self.copied.values()), "")
        self._last_note = CopiesNote(local_step=local, copied_step=min(copied, default=-1), holder=holder[:256],
                                     sent_bytes=self.sent_bytes, refused=self.refused,
                                     last_refusal=self.last_refusal, held_bytes=held, copying=bool(self.targets))
        return self._last_note

    def told(self, noted: Iterable[SourceStep]) -> None:
        """The server's word on sources gone while the job waits (NodeStatus.sources_noted): each one's last push is
        taken up to the step its own last note told, though this node's ranks never got there (store.py)."""
        self.left_noted.clear()
        self.left_noted.update((s.node_id, s.step) for s in noted)

    def heard(self, note: CopiesNote | None) -> None:
        """The server heard `note` (its poll answered): a fetched node's copies go once it heard this node's own landed,
        not at the landing (a loss before the next poll hands their fetch on, awaiting.py: a review's found none)."""
        self.heard_step = note.local_step if note is not None else self.heard_step
        if note is not None and (go := self.let_go) is not None and note.copied_step >= go[3]:
            self.let_go = None
            self._dropping = asyncio.ensure_future(drop_all(go[2], go[1], go[0], DROP_LIMIT_S, self._connect))

    async def close(self, finished: bool = False, flush_s: float | None = None) -> None:
        """Stop fetching and pushing. Once the job is over for this node (`finished`) its holders drop its copies
        at once; a node leaving a job that goes on keeps them there: a spare may take its place and fetch them
        (holders let copies nobody renews make room after a while: copies/store.py). Such a node first sends its
        holders the newest step they lack (`flush_s` at most: copies/last_copies.py): its workers' last write ended
        as they stopped, and without it the node taking its place resumes a snapshot back (a review)."""
        if self._fetching is not None:
            self._fetching.cancel()
            await self.fetched()
        if self._pusher is not None:
            self._pusher.cancel()
        if not finished and self.key and self.targets:
            # Leaving before its ranks stepped, a node of replicas (not diverged) sends its newest anyway: it is what
            # the job resumes from, and its last chance (a third review: a lone node stopped as a replica joined
            # sent nothing, and the job went back to step 0). Its holders, never stepped, park a step past the round's
            # noted one as "ahead" of the job past the flush's end (a fourth review: step 0), so that goes first;
            # then up to what the server heard of this node, which it tells them as the job waits (`told`: a fifth
            # review's noted step lagged by more than the ranks keep, nothing went, and the job went to step 0 again).
            caps: list[int | None] = [self._at_most]
            if self._alike and not self._past_start:
                self._past_start = True
                caps = [step for step in sorted({self.noted, self.heard_step}) if step >= 0] or [None]
            await last_copies([(functools.partial(self._flush, cap), due_bytes(self.targets, self._dirs, self.pushed,
                                                                                cap)) for cap in caps],
                              self.bandwidth, self._say, FLUSH_LIMIT_S if flush_s is None else flush_s)
        tasks = [t for t in (self._pusher, *self._to_holder.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if finished and self.key:
            await asyncio.gather(*(drop(t.addr, t.port, key=self.key, node_id=self.node_id, timeout_s=DROP_LIMIT_S,
                                        tls=self._connect) for t in self.targets))
        if self._listener is not None:
            await self._listener.close()
