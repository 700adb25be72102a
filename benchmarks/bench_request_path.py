"""The path one failure report takes through the server, as it runs: from its route to every woken agent's reply.

Two nodes form a round in an in-process server (the real app on 127.0.0.1, memory store); node b holds a poll;
node a reports a worker failure. Between the report's send and the arrival of both replies (a's answer, b's
wake with the new round) every Python call is profiled, and the calls into the server's own files (rdzv_server/,
protocol/) are counted: which files are entered, how often each (a call from another file, or from the event loop,
into it; a coroutine resumed is no new call), and how many calls in all. `--roots A,B,...` runs the same in each
checkout, alternated (`--rounds`).

    .venv/bin/python benchmarks/bench_request_path.py --roots .,/tmp/old --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


async def _walk() -> dict[str, Any]:
    import aiohttp
    import msgspec
    from aiohttp import web

    import protocol
    import rdzv_server
    from protocol.messages import FailureReport, JobConfig, JoinRequest, PollRequest, WorkerFailure
    from rdzv_server.coordinator import Coordinator
    from rdzv_server.web.app import create_app

    ours = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (rdzv_server, protocol))
    coordinator = Coordinator()
    runner = web.AppRunner(create_app(coordinator), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    config = JobConfig(min_nodes=2, max_nodes=2, last_call_s=0.0, max_restarts=3)
    async with aiohttp.ClientSession() as http:
        async def send(action: str, req: Any) -> dict[str, Any]:
            async with http.post(f"http://127.0.0.1:{port}/v1/jobs/walk/{action}", data=msgspec.msgpack.encode(req),
                                 headers={"Content-Type": "application/msgpack"}) as resp:
                body: dict[str, Any] = msgspec.msgpack.decode(await resp.read())
                assert resp.status == 200, body
                return body

        creds = {}
        for i, node in enumerate("ab"):
            reply = await send("join", JoinRequest(v=1, node_id=node, addr="127.0.0.1", local_world_size=1,
                                                   master_port=29500 + i, config=config, instance=node))
            creds[node] = reply["credential"]
        views = await asyncio.gather(*(send("poll", PollRequest(v=1, node_id=n, credential=creds[n], wait_s=5.0))
                                       for n in "ab"))
        round_id = views[0]["round_id"]
        assert round_id >= 0 and all(v["round_id"] == round_id for v in views), views
        held = asyncio.ensure_future(send("poll", PollRequest(v=1, node_id="b", credential=creds["b"],
                                                              known_round=round_id, wait_s=30.0)))
        attached = asyncio.Event()                  # b's poll is held by the hub
        attach = coordinator.hub.attach

        def attach_and_tell(*args: Any) -> Any:
            status = attach(*args)
            attached.set()
            return status

        coordinator.hub.attach = attach_and_tell    # type: ignore[method-assign]
        await attached.wait()
        report = FailureReport(v=1, node_id="a", credential=creds["a"], round_id=round_id,
                               failures=[WorkerFailure(local_rank=0, rank=0, exitcode=1)])

        entries: collections.Counter[str] = collections.Counter()
        frames: dict[int, Any] = {}      # every call's frame, kept: a coroutine resumed is no new call

        def profile(frame: Any, event: str, arg: Any) -> None:
            path = frame.f_code.co_filename
            if event != "call" or not path.startswith(ours) or id(frame) in frames:
                return
            frames[id(frame)] = frame
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            if caller != path:
                entries[os.path.relpath(path, os.path.dirname(ours[0].rstrip(os.sep)))] += 1

        sys.setprofile(profile)
        try:
            answer, woken = await asyncio.gather(send("failure", report), held)
        finally:
            sys.setprofile(None)
        calls = len(frames)
        frames.clear()
        assert answer["accepted"] and woken["restart_count"] == 1, (answer, woken)   # b woken by the restart
    await runner.cleanup()
    return {"files": len(entries), "entries": sum(entries.values()),
            "coordinator.py": entries.get(os.path.join("rdzv_server", "coordinator.py"), 0),
            "calls": calls, "by_file": dict(entries.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--roots", default=".", help="checkouts to run in, comma-separated (alternated)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--files", action="store_true", help="print each file's entries too")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_walk())))
        return
    for n in range(args.rounds):
        for root in [os.path.abspath(r) for r in args.roots.split(",")]:
            env = dict(os.environ, PYTHONPATH=root)
            done = subprocess.run([sys.executable, HERE, "--child"], env=env, cwd=root, capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                sys.exit(f"{root}: {done.stderr.strip()[-2000:]}")
            out = json.loads(done.stdout)
            print(f"round {n + 1} {root}: {out['files']} files entered {out['entries']} times "
                  f"(rdzv_server/coordinator.py {out['coordinator.py']}), {out['calls']} calls")
            if args.files:
                for path, count in out["by_file"].items():
                    print(f"    {count:4d}  {path}")


if __name__ == "__main__":
    main()
