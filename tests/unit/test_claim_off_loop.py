"""Opening the node's memory directory waits out another agent's sweep (owners.claim, up to SWEEP_WAIT_S) in a
thread: the agent's loop (heartbeats, long-polls, the copy port) keeps running meanwhile."""
from __future__ import annotations

import asyncio
import fcntl
import os
import threading
from collections.abc import Awaitable, Callable

import pytest

from node_agent.copies.peers import PeerCopies
from node_agent.workers import memory, owners, succession
from node_agent.workers.memory import MemoryDirs


class _Writer:      # a peer's connection, of which serve reads the TLS state and writes a refusal or an answer
    def __init__(self) -> None:
        self.wrote = b""

    def get_extra_info(self, name: str) -> None:
        return None

    def write(self, data: bytes) -> None:
        self.wrote += data

    async def drain(self) -> None:
        return None


async def _a_peer_asks(dirs: MemoryDirs) -> None:
    """A peer's request on the copy port before this agent's first round: its holder store opens the memory."""
    reader = asyncio.StreamReader()
    reader.feed_eof()
    await PeerCopies(dirs, 1, "n1", lambda _: None, 0).serve(b"not a request\n", reader, _Writer())  # type: ignore


@pytest.mark.parametrize("opens", [succession.opened, _a_peer_asks], ids=["spawn", "copy-port"])
def test_the_loop_ticks_while_the_claim_waits_out_a_sweep(tmp_path, opens: Callable[[MemoryDirs], Awaitable[None]]
                                                          ) -> None:
    dirs = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path), node_id="n1")
    home = os.path.join(memory.parent_dir(str(tmp_path)), memory.dir_name("job", "n1"))
    os.makedirs(home, mode=0o700)
    owner = os.path.join(home, owners.OWNER)
    with open(owner, "w") as f:
        f.write("999999999 1\n")        # a gone agent's: a sweep (another agent's) holds its lock for a look
    swept = os.open(owner, os.O_RDONLY)
    fcntl.flock(swept, fcntl.LOCK_EX)
    ticked, done = threading.Event(), threading.Event()

    def sweep_ends() -> None:          # the sweep lets go once the loop ran (or after a bound short of the wait)
        ticked.wait(owners.SWEEP_WAIT_S / 2)
        os.close(swept)
        done.set()

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            if not done.is_set():
                ticked.set()
            loop.call_later(0.01, tick)
        loop.call_soon(tick)
        await opens(dirs)

    threading.Thread(target=sweep_ends, daemon=True).start()
    try:
        asyncio.run(main())
    finally:
        done.wait(owners.SWEEP_WAIT_S)
    assert ticked.is_set(), "the loop stalled while the claim waited"
    assert dirs.root == home, "the ended agent's directory is taken up, as a claim on the loop would"
    dirs.close()
