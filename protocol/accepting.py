"""Accepting connections from strangers, for the agent's listeners and the server's TLS port alike: each connection
is bounded before it costs more than a descriptor.
- `Caps`: connections in progress, in total and by source address (an IPv6 one's /64). At the per-source cap the
  one of that source waiting longest (that sent nothing, else any) makes room, and where all of the source's are at
  work the newcomer is closed at once (before any TLS handshake: the accept loop is ours for that reason): a review
  saw a process on a peer's host (its address) hold the cap with idle connections, reopened as they were closed,
  and the peer's pushes refused for the whole attack. At the total cap
  the one waiting longest (for its handshake, or its first line) is closed to make room: a peer sends its first
  line at once, so idle connections cannot shut out a newcomer, from one source or from many (a review: with one
  idle connection from each of 768 addresses, "the source with the most waiting" was a peer pushing two ranks at
  once, and the node taking a lost one's place found no copy: step 0); one at work is never closed, and only
  when none waits is the newcomer closed. Either is said, once a minute.
- Out of descriptors while accepting (EMFILE): said, once a minute, and accepting goes on after a pause. Where the
  caps `shrink` (an agent's: its own work needs descriptors more than strangers do), the total cap comes down for
  good to three quarters of the connections open then, waiting ones closed to fit: the limit was lowered, or the
  rest of the process needs more than the cap left it. A server's stays: a moment short of descriptors must not
  cap how many agents it serves from then on."""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from itertools import islice

ACCEPT_PAUSE_S = 0.5      # out of descriptors: accepting waits this long before it tries again
ACCEPT_BATCH = 64         # accepted in a row before the loop runs its other tasks (asyncio's own loop accepts a
                          # whole backlog at once: a flood would freeze it)
SAY_EVERY_S = 60.0
LOOK_AHEAD = 64           # waiting connections looked at for one that sent nothing, longest waiting first
MIN_TOTAL = 16            # a total cap never comes below this (a node's peers ask and copy with a few each)
TAKEN, EVICTED, REFUSED = "taken", "evicted", "refused"     # Caps.take


def source_of(peer: object) -> str:
    """The source a connection is counted under: its address, an IPv6 one's /64 (a host holds a whole /64)."""
    if not isinstance(peer, tuple) or not peer:
        return "?"
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%")[0])
    except ValueError:
        return str(peer[0])
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Caps:
    """Connections open now, in total and by source address, and those of them still waiting (closed to make room
    at the total cap)."""

    def __init__(self, total: int, per_source: int, shrinks: bool = False) -> None:
        self.total, self.per_source, self.shrinks = total, per_source, shrinks
        self.open: dict[str, int] = {}      # source address -> its connections open now
        self.count = 0                      # all of them (every accept in a flood asks: kept, not summed)
        # longest waiting first: what closes each, whether it has sent anything yet, its source
        self.waiting: OrderedDict[object, tuple[Callable[[], None], Callable[[], bool], str]] = OrderedDict()
        # Closed to make room but not closed yet: a task that started closes its socket once it runs again, so its
        # descriptor outlives its count (the accept loop waits for these: `accept`).
        self.ending: set[asyncio.Task[None]] = set()

    def take(self, source: str) -> str:
        """TAKEN: `source` may open one more; EVICTED: so, once a waiting connection was closed to make room, the
        one of `source` waiting longest at the per-source cap, else the one waiting longest (`close()` gives its count
        back at once); REFUSED: at the per-source cap with every one of the source's at work, or at the total cap
        with every connection at work."""
        taken = TAKEN
        if self.open.get(source, 0) >= self.per_source:
            if not self._close_one_waiting_of(source):
                return REFUSED
            taken = EVICTED
        if self.count >= self.total:
            if not self.close_one_waiting():
                return REFUSED
            taken = EVICTED
        self.open[source] = self.open.get(source, 0) + 1
        self.count += 1
        return taken

    def shrink(self, total: int) -> int:
        """The total cap down to `total` (MIN_TOTAL at least), waiting connections closed until it holds (those at
        work stay). How many were closed."""
        self.total = max(MIN_TOTAL, min(self.total, total))
        closed = 0
        while self.count > self.total and self.waiting:
            self._close_one_waiting()
            closed += 1
        return closed

    def close_one_waiting(self, sparing: object = None) -> bool:
        """Close a waiting connection (`_close_one_waiting`) to make room elsewhere, never `sparing` (the one the room
        is for); False where none other waits."""
        if not self.waiting or list(self.waiting) == [sparing]:
            return False
        self._close_one_waiting(sparing)
        return True

    def _close_one_waiting_of(self, source: str) -> bool:
        """Close the connection of `source` waiting longest that has sent nothing yet, else its one waiting longest;
        False where none of its connections waits (all at work)."""
        ahead = list(islice(((key, sent) for key, (_, sent, of) in self.waiting.items() if of == source), LOOK_AHEAD))
        if not ahead:
            return False
        victim = next((key for key, sent in ahead if not sent()), ahead[0][0])
        close, _, _ = self.waiting.pop(victim)
        close()
        return True

    def _close_one_waiting(self, sparing: object = None) -> None:
        """The connection waiting longest that has sent nothing yet (a peer's sends at once: its line may wait for a
        loop busy accepting a flood), else the one waiting longest; never `sparing`. `close()` gives its count back."""
        others = ((key, sent) for key, (_, sent, _) in self.waiting.items() if key is not sparing)
        ahead = list(islice(others, LOOK_AHEAD))
        victim = next((key for key, sent in ahead if not sent()), ahead[0][0])
        close, _, _ = self.waiting.pop(victim)
        close()

    def wait(self, source: str, key: object, close: Callable[[], None],
             sent: Callable[[], bool] = lambda: False) -> None:
        """A connection of `source` waits: `close()` ends it to make room; `sent()`: bytes of it are in."""
        self.waiting[key] = (close, sent, source)

    def at_work(self, source: str, key: object) -> None:
        """The connection waits no more (it is at work, or it ended): it is no longer closed to make room."""
        self.waiting.pop(key, None)

    def give(self, source: str) -> None:
        self.count -= 1
        left = self.open.get(source, 0) - 1
        if left > 0:
            self.open[source] = left
        else:
            self.open.pop(source, None)


class Accepted:
    """A connection accepted, served by `task`: `evict()` ends it to make room (Caps.take), its count given back at
    once; a task that has not started yet never will, so its socket is closed here. Its server marks it `started`,
    calls `caps.at_work` once it waits no more and, unless `evicted`, `caps.give` when it ends."""

    def __init__(self, conn: socket.socket, source: str, caps: Caps) -> None:
        self.conn, self.source, self.caps = conn, source, caps
        self.task: asyncio.Task[None] | None = None
        self.started = self.evicted = self.heard = False

    def sent(self) -> bool:
        """The peer has sent something: bytes wait to be read (a first line, a TLS hello; looked at, not taken), or
        its server read some already (`heard`)."""
        if self.heard:
            return True
        try:
            return bool(self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:          # nothing yet (EAGAIN), or closed
            return False

    def evict(self) -> None:
        if self.evicted:        # once: a Caps eviction and the listener's handshake share may both pick it
            return
        self.evicted = True
        self.caps.give(self.source)
        if self.task is not None:
            self.task.cancel()
            if self.started and not self.task.done():
                self.caps.ending.add(self.task)
                self.task.add_done_callback(self.caps.ending.discard)
        if not self.started:
            self.conn.close()


class SayOnce:
    """A line of each kind said at most once per SAY_EVERY_S (a flood is told once a minute, not once a connection).
    Kinds apart: a review saw a cap lowered for want of descriptors never said (a line on the cap said just before)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._said_at: dict[str, float] = {}

    def __call__(self, line: str, kind: str = "") -> None:
        now = time.monotonic()
        if now - self._said_at.get(kind, -SAY_EVERY_S) >= SAY_EVERY_S:
            self._said_at[kind] = now
            self._say(line)


Serve = Callable[[Accepted], Coroutine[object, object, None]]


async def accept(sock: socket.socket, caps: Caps, name: str, say: SayOnce, serve: Serve,
                 serving: set[asyncio.Task[None]]) -> None:
    """Accept on `sock` until it is closed or the task cancelled: each connection within `caps`, served by a task of
    its own (kept in `serving` while it runs), waiting until its server says it is at work. Connections closed to
    make room hold their descriptors until their tasks run: at the cap, the next accept waits for them (at most
    ACCEPT_PAUSE_S), so the descriptors held stay within the cap. A review: 64 accepted in a row, each closing one
    for the next, held 320 sockets at a cap of 64, and an agent limited to 256 descriptors failed its own work."""
    loop = asyncio.get_running_loop()
    accepted_in_a_row = 0
    while True:
        if caps.ending and caps.count + len(caps.ending) >= caps.total:
            await asyncio.wait(set(caps.ending), timeout=ACCEPT_PAUSE_S)
        accepted_in_a_row += 1
        if accepted_in_a_row >= ACCEPT_BATCH:
            accepted_in_a_row = 0
            await asyncio.sleep(0)
        try:
            conn, peer = await loop.sock_accept(sock)
        except OSError as exc:
            if sock.fileno() < 0:
                return                              # closed
            if exc.errno in (errno.EMFILE, errno.ENFILE) and caps.shrinks:
                closed = caps.shrink(caps.count * 3 // 4)
                say(f"{name}: out of descriptors accepting a connection ({exc.strerror}): at most {caps.total} "
                    f"connections from now on ({closed} waiting closed); others wait in the backlog; accepting "
                    f"again in {ACCEPT_PAUSE_S:g}s", "descriptors")
            elif exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                say(f"{name}: out of descriptors or memory accepting a connection ({exc.strerror}): connections "
                    f"wait in the backlog; accepting again in {ACCEPT_PAUSE_S:g}s", "descriptors")
            await asyncio.sleep(ACCEPT_PAUSE_S if exc.errno != errno.ECONNABORTED else 0)   # a pause, not a wait
            continue
        source = source_of(peer)
        taken = caps.take(source)
        if taken != TAKEN:
            done = "closed the one idle longest for" if taken == EVICTED else "refused"
            say(f"{name}: at its cap of {caps.total} connections ({caps.per_source} from one address): {done} a "
                f"connection from {source!r} (said once a minute)", "cap")
        if taken == REFUSED:
            conn.close()                             # at once: no handshake, no buffer, no task
            continue
        accepted = Accepted(conn, source, caps)
        accepted.task = asyncio.create_task(serve(accepted))
        caps.wait(source, accepted, accepted.evict, accepted.sent)    # from now: a burst finds it waiting, too
        serving.add(accepted.task)
        accepted.task.add_done_callback(serving.discard)
