"""The agent's side of the warm zygote: start it early, ask it for a worker, see the worker's exit.
Never waits long and never fails a launch: a zygote not ready, dead, refusing or slow means a cold start
(`spawn()` returns None); a dead or mismatched one is replaced in the background (MAX_STARTS in all). The
zygote reaps its workers and reports their exits; when it dies they die too, reported killed by SIGKILL.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import node_agent.training.probe as probe
from node_agent.workers.deathsig import prctl, preexec
from node_agent.workers.environment import booted
from node_agent.workers.warm.eligible import WarmLaunch

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
MAX_MESSAGE = 1 << 20       # the zygote's limit on one message (zygote.MAX_MESSAGE)
ANSWER_S = 5.0              # a zygote that takes longer to answer a fork is broken: cold start, and a new one
MAX_STARTS = 4              # zygotes started per agent (the first and three replacements)


class WarmProcess:
    """A worker forked by the zygote: what the agent's supervision needs of a process handle."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done = asyncio.get_running_loop().create_future()

    def exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._done.set_result(code)

    async def wait(self) -> int:
        return int(await asyncio.shield(self._done))


class WarmZygote:
    def __init__(self, python: str, preload: Sequence[str], path0: str, env: Mapping[str, str],
                 warn: Callable[[str], None], fallback: Sequence[str] | None = None) -> None:
        """`fallback`: what to preload instead when `preload` leaves the zygote unfit to fork (the script's own
        imports started a thread, or CUDA); tried first: `preload` without the names looked up in its modules (one
        name's thread would otherwise cost every module its preload: a review)."""
        self.python = python
        self.preload = tuple(preload)
        self.fallback = tuple(fallback) if fallback is not None else None
        self.path0 = path0
        self.env = dict(env)            # what the zygote was started with: a launch must match it
        self._warn = warn
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self.ready = False              # a zygote answers forks (it has done its preloads)
        self._starts = 0
        self._closing = False
        self._killed = False            # the zygote's end was our doing (said already, or closing)
        self._next_id = 0
        self._answers: dict[int, asyncio.Future[dict[str, Any]]] = {}   # spawn id (or -1: query) -> answer
        self._workers: dict[int, WarmProcess] = {}       # running: their exits still to come
        self._handover: dict[int, WarmProcess] = {}      # started, not yet returned by spawn()
        self._starting: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()   # set (and replaced) when it becomes ready, or dies, or cannot start

    @property
    def coming(self) -> bool:
        """Not ready, but a zygote is on its way (starting, or importing its preloads)."""
        if self.ready or self._closing:
            return False
        return self._sock is not None or (self._starting is not None and not self._starting.done())

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the zygote in the background (it imports the preload list; `ready` once done)."""
        if self._closing or self._starts >= MAX_STARTS or (self._starting and not self._starting.done()):
            return
        self._starts += 1
        self._starting = asyncio.create_task(self._start())

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                self.python, "-u", ZYGOTE, str(theirs.fileno()), self.path0, ",".join(self._marked()), probe.NAME,
                env=booted(self.env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=preexec(os.getpid(), prctl()))
        except OSError as exc:
            ours.close()
            self._warn(f"warm workers off: cannot start {self.python}: {exc.strerror}; workers start cold")
            self._notify()
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        asyncio.get_running_loop().add_reader(ours.fileno(), self._readable, ours)

    def _marked(self) -> list[str]:
        """The preloads as the zygote is told them: the script's own imports (not in `fallback`) marked "?", which
        it preloads only where they are installed, not the user's code (own_code.py)."""
        base = set(self.fallback) if self.fallback is not None else None
        return [name if base is None or name in base else f"?{name}" for name in self.preload]

    def _readable(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._gone(sock)
                return
            self._message(json.loads(data))

    def _message(self, m: dict[str, Any]) -> None:
        op = m.get("op")
        if op == "ready":
            for name, error in m.get("failed", []):
                self._warn(f"warm workers: preloading {name!r} failed ({error}); workers import it themselves")
            if m.get("unclean") and self.fallback is not None and self.preload != self.fallback:
                modules = tuple(name for name in self.preload if ":" not in name)
                after = modules if modules != self.preload else self.fallback
                extra = [name for name in self.preload if name not in after]
                self._warn(f"warm workers: {m['unclean']} after preloading the script's imports "
                           f"({', '.join(extra)[:200]}); the next zygote preloads "
                           f"{'their modules' if after is modules else ', '.join(after)} only")
                self.preload = after
                self._starts -= 1      # not a failure of the zygote's: it may still be replaced as often
                self._kill()
                return
            if m.get("unclean"):
                self._warn(f"warm workers off: {m['unclean']} after the preloads; workers start cold")
                self._off()
                return
            self.ready = True
            self._notify()
        elif op == "exited":
            worker = self._workers.pop(int(m["pid"]), None)
            if worker is not None:
                worker.exited(int(m["code"]))
        else:
            answer = self._answers.pop(int(m.get("id", -1)), None)
            if answer is not None and not answer.done():
                if op == "started":
                    # Known now: its "exited" may come next, before spawn() resumes, and an unknown pid's is dropped.
                    worker = self._handover[int(m["pid"])] = WarmProcess(int(m["pid"]))
                    self._workers[worker.pid] = worker
                answer.set_result(m)

    def _gone(self, sock: socket.socket) -> None:
        """The zygote is gone: its workers died with it (PDEATHSIG); a new one starts unless we are closing."""
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        if sock is self._sock:
            self._sock = None
        if not self._closing and not self._killed:   # when we killed it, the reason was said already
            what = "died" if self.ready else "ended before it was ready"
            then = "a new one is started" if self._starts < MAX_STARTS else "workers start cold from now on"
            self._warn(f"warm workers: the zygote ({self.python}) {what}; {then}")
        self._killed = False
        self.ready = False
        for worker in self._workers.values():
            worker.exited(-signal.SIGKILL)
        self._workers.clear()
        for answer in self._answers.values():
            if not answer.done():
                answer.set_result({"op": "refused", "why": "the zygote is gone"})
        self._answers.clear()
        if self._proc is not None:
            asyncio.get_running_loop().create_task(self._proc.wait())   # reap it
        self.start()      # its replacement (start() starts none once closing, nor past MAX_STARTS)
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _ask(self, message: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any] | None:
        sock = self._sock
        if sock is None:
            return None
        data = json.dumps(message).encode()
        if len(data) > MAX_MESSAGE:
            return None
        key = int(message.get("id", -1))
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[key] = answer
        try:
            socket.send_fds(sock, [data], list(fds))
        except OSError:   # buffer full or zygote gone: not worth waiting for
            self._answers.pop(key, None)
            return None
        try:
            return await asyncio.wait_for(answer, ANSWER_S)
        except asyncio.TimeoutError:
            self._warn(f"warm workers: the zygote did not answer in {ANSWER_S:g}s; starting a new one")
            self._kill()
            return None

    async def spawn(self, launch: WarmLaunch, fds: Sequence[int]) -> WarmProcess | None:
        """Fork one worker with these stdin/stdout/stderr fds; None: start it cold instead."""
        if not self.ready:
            return None
        if launch.base_env != self.env:
            changed = sorted(k for k in {*launch.base_env, *self.env} if launch.base_env.get(k) != self.env.get(k))
            self._warn(f"warm workers: the workers' environment differs from the zygote's "
                       f"({', '.join(changed)[:200]}); this round starts cold, a new zygote is started for the next")
            self.env = dict(launch.base_env)
            self._kill()
            return None
        self._next_id += 1
        answer = await self._ask({"op": "spawn", "id": self._next_id, **launch.message()}, fds)
        if answer is None or answer.get("op") != "started":
            if answer is not None and answer.get("why"):
                self._warn(f"warm workers: the zygote refused a fork ({answer['why']}); this worker starts cold")
            return None
        return self._handover.pop(int(answer["pid"]))     # registered when the answer was read

    async def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) while a zygote is on its way (one that cannot start ends it); whether one is ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.ready and self.coming and loop.time() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
        return self.ready

    def _off(self) -> None:
        """No warm workers for this agent: the zygote killed, none started again (the next would be the same)."""
        self._starts = MAX_STARTS
        self._kill()

    def _kill(self) -> None:
        self._killed = True
        self.ready = False
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)

    async def close(self) -> None:
        """Kill the zygote (its running workers too: call once they are stopped) and reap it."""
        self._closing = True
        if self._starting is not None:
            await self._starting
        self._kill()
        if self._sock is not None:
            self._gone(self._sock)
        if self._proc is not None:
            await self._proc.wait()
