"""The agent's side of the warm zygote (node_agent/workers/warm/client.py) against a fake zygote on a
socket pair: what the agent does with the zygote's messages, whatever order they are read in."""
from __future__ import annotations

import asyncio
import json
import socket

from node_agent.workers.warm.client import WarmZygote
from node_agent.workers.warm.eligible import WarmLaunch

LIMIT = 10.0   # only against a hang


def connected_zygote() -> tuple[WarmZygote, socket.socket]:
    """A WarmZygote that takes the far end of a socket pair for its ready zygote."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    zygote = WarmZygote("python3", (), "/", {"A": "1"}, lambda _: None)
    zygote._sock, zygote.ready = ours, True                 # as _start leaves it once "ready" came
    asyncio.get_running_loop().add_reader(ours.fileno(), zygote._readable, ours)
    return zygote, theirs


LAUNCH = WarmLaunch(argv=["w.py"], orig_argv=["python3", "w.py"], script="w.py", module="", path0="/", cwd="/",
                    env={"A": "1", "RANK": "0"}, base_env={"A": "1"})


async def test_a_worker_whose_exit_is_read_with_its_start_is_seen_to_exit():
    # A script that ends at once: the zygote's "started" and "exited" are read in one go, before
    # spawn() resumes. The exit must not be dropped as one of an unknown pid (the round would hang).
    zygote, far = connected_zygote()
    try:
        spawning = asyncio.ensure_future(zygote.spawn(LAUNCH, []))
        asked = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(far, 1 << 16), LIMIT)
        request = json.loads(asked)
        assert request["op"] == "spawn"
        far.send(json.dumps({"op": "started", "id": request["id"], "pid": 4242}).encode())
        far.send(json.dumps({"op": "exited", "pid": 4242, "code": 0}).encode())
        worker = await asyncio.wait_for(spawning, LIMIT)
        assert worker is not None and worker.pid == 4242
        assert await asyncio.wait_for(worker.wait(), LIMIT) == 0
    finally:
        if zygote._sock is not None:
            asyncio.get_running_loop().remove_reader(zygote._sock.fileno())
            zygote._sock.close()
        far.close()


async def test_a_worker_running_when_the_zygote_dies_is_reported_killed():
    zygote, far = connected_zygote()
    zygote._closing = True                                  # no new zygote: this test has none to start
    try:
        spawning = asyncio.ensure_future(zygote.spawn(LAUNCH, []))
        request = json.loads(await asyncio.wait_for(asyncio.get_running_loop().sock_recv(far, 1 << 16), LIMIT))
        far.send(json.dumps({"op": "started", "id": request["id"], "pid": 4243}).encode())
        worker = await asyncio.wait_for(spawning, LIMIT)
        assert worker is not None
        far.close()                                         # the zygote is gone
        assert await asyncio.wait_for(worker.wait(), LIMIT) == -9
    finally:
        far.close()
