"""The process layer with real processes: output routing, exits, stopping, process groups, PDEATHSIG."""
from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator

import psutil
import pytest

from node_agent.options import Std
from node_agent.workers import (
    Console, WorkerGroup, WorkerLaunch, WorkerSpawnError, _child_setup, _prctl, read_error_file,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 30.0   # upper bound for anything awaited here; a hang fails the test instead of stalling CI


class RecordingConsole(Console):
    """A console writing to memory, which a test can await a line from."""

    def __init__(self) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()
        super().__init__(self.out, self.err)
        self._watch: list[tuple[str, asyncio.Future[str]]] = []

    def line(self, stream: str, text: str) -> None:
        super().line(stream, text)
        for needle, fut in self._watch:
            if needle in text and not fut.done():
                fut.set_result(text)

    def lines(self, stream: str) -> list[str]:
        return (self.out if stream == "stdout" else self.err).getvalue().splitlines()

    async def seen(self, needle: str) -> str:
        for line in self.lines("stdout") + self.lines("stderr"):
            if needle in line:
                return line
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._watch.append((needle, fut))
        return await asyncio.wait_for(fut, LIMIT)


def launch(local_rank: int, code: str, *, env: dict[str, str] | None = None, log_dir: str | None = None,
           **kw: object) -> WorkerLaunch:
    rank = 10 + local_rank
    return WorkerLaunch(local_rank=local_rank, rank=rank, argv=[sys.executable, "-c", textwrap.dedent(code)],
                        env={**os.environ, "LOCAL_RANK": str(local_rank), **(env or {})},
                        log_dir=log_dir, prefix=f"[h:rank {rank}]", **kw)  # type: ignore[arg-type]


@pytest.fixture
def strays() -> Iterator[list[int]]:
    """Pids a test learned of that are not our children: killed at teardown if still there."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
async def make_group() -> AsyncIterator[Callable[..., WorkerGroup]]:
    made: list[WorkerGroup] = []

    def make(launches: list[WorkerLaunch], *, stop_timeout: float = 5.0) -> WorkerGroup:
        group = WorkerGroup(launches, stop_timeout=stop_timeout, console=RecordingConsole())
        made.append(group)
        return group

    yield make
    for group in made:   # whatever the test did, no worker outlives it
        await asyncio.wait_for(group.stop(signal.SIGKILL), LIMIT)


def console_of(group: WorkerGroup) -> RecordingConsole:
    c = group._console
    assert isinstance(c, RecordingConsole)
    return c


PRINTER = """
    import os, sys
    r = os.environ["LOCAL_RANK"]
    print(f"out {r} {os.environ['MARK']}")
    print(f"err {r}", file=sys.stderr)
    sys.stdout.write(f"tail {r}")   # a last line without newline
"""


async def test_output_goes_to_files_and_prefixed_console(make_group, tmp_path) -> None:
    env = {"MARK": "m"}
    group = make_group([
        launch(0, PRINTER, env=env, log_dir=str(tmp_path / "0"), redirect=Std.OUT, tee=Std.ERR),
        launch(1, PRINTER, env=env, log_dir=None, redirect=Std.ALL),          # no dir: console instead
        launch(2, PRINTER, env=env, log_dir=str(tmp_path / "2"), echo=False),  # filtered off the console
        launch(3, PRINTER, env=env, log_dir=str(tmp_path / "3"), tee=Std.ALL),
    ])
    await group.start()
    exits = await asyncio.wait_for(group.wait(), LIMIT)
    assert sorted((e.local_rank, e.rank, e.exitcode) for e in exits) == [(i, 10 + i, 0) for i in range(4)]
    await group.stop()   # also waits for the output to be pumped out
    console = console_of(group)

    assert (tmp_path / "0" / "stdout.log").read_text() == "out 0 m\ntail 0"
    assert (tmp_path / "0" / "stderr.log").read_text() == "err 0\n"
    assert (tmp_path / "3" / "stdout.log").read_text() == "out 3 m\ntail 3"
    assert (tmp_path / "3" / "stderr.log").read_text() == "err 3\n"
    assert not (tmp_path / "1").exists() and not (tmp_path / "2").exists()
    assert sorted(console.lines("stdout")) == sorted([
        "[h:rank 11] out 1 m", "[h:rank 11] tail 1", "[h:rank 13] out 3 m", "[h:rank 13] tail 3"])
    assert sorted(console.lines("stderr")) == ["[h:rank 10] err 0", "[h:rank 11] err 1", "[h:rank 13] err 3"]


async def test_long_lines_and_bad_utf8_are_kept(make_group, tmp_path) -> None:
    code = """
        import sys
        w = sys.stdout.buffer.write
        w(b"A" * 300000 + b"\\n")
        w("\\u00e9".encode() * 100000 + b"\\xff\\xfe end\\n")   # 2-byte chars split across reads
        w(b"last")
    """
    group = make_group([launch(0, code, log_dir=str(tmp_path), tee=Std.OUT)])
    await group.start()
    assert [e.exitcode for e in await asyncio.wait_for(group.wait(), LIMIT)] == [0]
    await group.stop()
    expected = "A" * 300000 + "\n" + "\u00e9" * 100000 + "\ufffd\ufffd end\n" + "last"
    assert (tmp_path / "stdout.log").read_text(encoding="utf-8") == expected
    lines = console_of(group).lines("stdout")
    assert len(lines) > 4 and all(line.startswith("[h:rank 10] ") for line in lines)   # long lines in pieces
    assert "".join(line[len("[h:rank 10] "):] for line in lines) == expected.replace("\n", "")


async def test_console_lines_never_interleave(make_group) -> None:
    code = """
        import os
        tag = "ab"[int(os.environ["LOCAL_RANK"])] * 500
        for i in range(2000):
            print(tag, i)
    """
    group = make_group([launch(0, code), launch(1, code)])
    group._console = Console(io.StringIO(), io.StringIO())   # the real console, writing to memory
    await group.start()
    await asyncio.wait_for(group.wait(), LIMIT)
    await group.stop()
    text = group._console._out.getvalue()  # type: ignore[union-attr]
    seen: dict[str, list[int]] = {"10": [], "11": []}
    for line in text.splitlines():
        m = re.fullmatch(r"\[h:rank (1[01])\] (a{500}|b{500}) (\d+)", line)
        assert m is not None, line[:80]
        seen[m.group(1)].append(int(m.group(3)))
    assert seen == {"10": list(range(2000)), "11": list(range(2000))}


async def test_failure_is_reported_while_others_still_run(make_group, strays) -> None:
    failing = """
        import subprocess, sys
        # A child that keeps our stdout open must not delay the report of our exit.
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("grandchild", p.pid, flush=True)
        sys.exit(3)
    """
    sleeper = """
        import time
        print("sleeper up", flush=True)
        time.sleep(600)
    """
    group = make_group([launch(0, sleeper), launch(1, failing)], stop_timeout=30)
    started = time.monotonic()
    await group.start()
    for pid in group.pids:
        assert os.getpgid(pid) == pid != os.getpgid(0)   # each worker leads its own process group
    failures = await asyncio.wait_for(group.wait(), LIMIT)
    assert time.monotonic() - started < 10
    assert [(f.local_rank, f.rank, f.exitcode, f.signal_name) for f in failures] == [(1, 11, 3, "")]
    sleeper_proc = psutil.Process(group.pids[0])
    assert sleeper_proc.status() != psutil.STATUS_ZOMBIE and len(group.exits()) == 1

    grandchild = int((await console_of(group).seen("grandchild")).split()[-1])
    strays.append(grandchild)
    assert os.getpgid(grandchild) == group.pids[1]
    grandchild_proc = psutil.Process(grandchild)

    stop_began = time.monotonic()
    await asyncio.wait_for(group.stop(), LIMIT)
    assert time.monotonic() - stop_began < 10   # SIGTERM sufficed: no wait for the 30 s escalation
    by_rank = {e.local_rank: e for e in group.exits()}
    assert (by_rank[0].exitcode, by_rank[0].signal_name) == (-signal.SIGTERM, "SIGTERM")
    assert not sleeper_proc.is_running()
    # The failed worker's child, left in its process group, is swept away by the stop.
    await asyncio.to_thread(grandchild_proc.wait, 10)


async def test_stop_escalates_to_sigkill(make_group) -> None:
    stubborn = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(600)
    """
    group = make_group([launch(0, stubborn)], stop_timeout=0.5)
    await group.start()
    await console_of(group).seen("ignoring SIGTERM")
    began = time.monotonic()
    # Stops may overlap each other and a wait(): all end together, with one result.
    _, _, exits = await asyncio.wait_for(asyncio.gather(group.stop(), group.stop(), group.wait()), LIMIT)
    took = time.monotonic() - began
    assert 0.5 <= took < 5
    assert [(e.exitcode, e.signal_name) for e in exits] == [(-signal.SIGKILL, "SIGKILL")]
    assert group.exits() == exits
    await asyncio.wait_for(group.stop(), 1)   # again: returns at once


async def test_stop_during_start_spawns_no_more(make_group) -> None:
    group = make_group([launch(i, "import time; time.sleep(600)") for i in range(4)])
    starting = asyncio.create_task(group.start())
    await asyncio.wait_for(group.stop(), LIMIT)   # arrives while the first worker is being spawned
    await asyncio.wait_for(starting, LIMIT)
    assert 1 <= len(group.pids) < 4
    assert sorted(e.pid for e in group.exits()) == sorted(group.pids)
    assert all(e.signal_name == "SIGTERM" for e in group.exits())
    with pytest.raises(RuntimeError):
        await group.start()


async def test_send_signal_reaches_workers(make_group) -> None:
    code = """
        import signal, sys, time
        def on_usr1(*_):
            print("got usr1", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGUSR1, on_usr1)
        print("ready", flush=True)
        time.sleep(600)
    """
    group = make_group([launch(0, code)])
    await group.start()
    await console_of(group).seen("ready")
    group.send_signal(signal.SIGUSR1)
    exits = await asyncio.wait_for(group.wait(), LIMIT)
    assert [e.exitcode for e in exits] == [0]
    await console_of(group).seen("got usr1")


async def test_spawn_error_stops_the_started_workers(make_group, tmp_path) -> None:
    sleeper = "import time; time.sleep(600)"
    missing = WorkerLaunch(local_rank=1, rank=11, argv=[str(tmp_path / "no-such-program")],
                           env=dict(os.environ), log_dir=None)
    group = make_group([launch(0, sleeper), missing])
    with pytest.raises(WorkerSpawnError) as info:
        await group.start()
    assert isinstance(info.value, OSError) and info.value.launch is missing
    assert "local rank 1" in str(info.value) and "no-such-program" in str(info.value)
    assert [(e.local_rank, e.signal_name) for e in group.exits()] == [(0, "SIGKILL")]


async def test_worker_dies_with_a_sigkilled_agent(strays) -> None:
    parent_code = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {ROOT!r})
        from node_agent.workers import WorkerGroup, WorkerLaunch

        async def main():
            argv = [sys.executable, "-c", "import time; time.sleep(600)"]
            group = WorkerGroup([WorkerLaunch(local_rank=0, rank=0, argv=argv, env=dict(os.environ),
                                              log_dir=None)], stop_timeout=1)
            await group.start()
            print(group.pids[0], flush=True)
            await asyncio.Event().wait()   # until killed

        asyncio.run(main())
    """)
    parent = await asyncio.create_subprocess_exec(sys.executable, "-c", parent_code, stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(parent.stdout.readline(), LIMIT)  # type: ignore[union-attr]
        worker_pid = int(line)
        strays.append(worker_pid)
        worker = psutil.Process(worker_pid)
        assert worker.ppid() == parent.pid
        parent.kill()
        await parent.wait()
        await asyncio.to_thread(worker.wait, 5)   # raises TimeoutExpired if it outlived its agent
        assert not worker.is_running()
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()


def test_child_exits_when_its_parent_is_already_gone(tmp_path) -> None:
    # The child setup compares getppid() with the pid the agent had at fork time; a mismatch means
    # the agent died before PDEATHSIG was armed, and the child must not go on to run the worker.
    marker = tmp_path / "ran"
    proc = subprocess.Popen([sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                            preexec_fn=_child_setup(os.getpid() + 1_000_000, _prctl()))
    assert proc.wait(timeout=LIMIT) == 1
    assert not marker.exists()


TORCH_ERROR = {"message": {"message": "ValueError: boom", "extraInfo": {
    "py_callstack": "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom\n",
    "timestamp": "1700000000"}}}


async def test_error_file_is_reported_and_stale_ones_removed(make_group, tmp_path) -> None:
    writer = f"""
        import json, os, sys
        path = os.environ["TORCHELASTIC_ERROR_FILE"]
        if os.path.exists(path):
            sys.exit(7)   # a stale file from an earlier run must be gone before we start
        with open(path, "w") as f:
            json.dump({TORCH_ERROR!r}, f)
        sys.exit(1)
    """
    paths = [tmp_path / str(i) / "error.json" for i in range(2)]
    for path in paths:
        path.parent.mkdir()
        path.write_text("stale")
    group = make_group([launch(0, writer, env={"TORCHELASTIC_ERROR_FILE": str(paths[0])}),
                        launch(1, "pass", env={"TORCHELASTIC_ERROR_FILE": str(paths[1])})])
    await group.start()
    failures = await asyncio.wait_for(group.wait(), LIMIT)
    await group.stop()
    assert [(f.local_rank, f.exitcode, f.error_file) for f in failures] == [(0, 1, str(paths[0]))]
    message, traceback, timestamp = read_error_file(str(paths[0])) or ("", "", 0.0)
    assert (message, timestamp) == ("ValueError: boom", 1700000000.0)
    assert traceback.startswith("Traceback") and traceback.endswith("ValueError: boom\n")
    other = [e for e in group.exits() if e.local_rank == 1][0]
    assert other.error_file is None and not paths[1].exists()


def test_read_error_file_variants(tmp_path) -> None:
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"message": "RuntimeError: plain"}))
    message, traceback, timestamp = read_error_file(str(plain)) or ("", "", 0.0)
    assert (message, traceback) == ("RuntimeError: plain", "") and timestamp == os.path.getmtime(plain)

    no_time = tmp_path / "no_time.json"
    no_time.write_text(json.dumps({"message": {"message": "E: x", "extraInfo": {"py_callstack": "tb"}}}))
    assert read_error_file(str(no_time)) == ("E: x", "tb", os.path.getmtime(no_time))

    for name, content in (("bad.json", "{not json"), ("empty.json", ""), ("other.json", '{"x": 1}'),
                          ("list.json", "[1, 2]"), ("num.json", '{"message": 5}')):
        (tmp_path / name).write_text(content)
        assert read_error_file(str(tmp_path / name)) is None, name
    assert read_error_file(str(tmp_path / "missing.json")) is None
