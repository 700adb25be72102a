"""Worker output with real processes: log files, the prefixed console, long lines, bad UTF-8, no interleaving."""
from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator, Callable

import pytest

from node_agent.launch import WorkerLaunch
from node_agent.option_values import Std
from node_agent.output import Console, LinePump, Sink
from node_agent.worker import Worker, WorkerExit
from tests.integration.worker_support import LIMIT, RecordingConsole, launch



@pytest.fixture
async def run() -> AsyncIterator[Callable[[list[WorkerLaunch], Console], asyncio.Task[list[WorkerExit]]]]:
    """Runs workers to their end and until their output is written; returns their exits."""
    workers: list[Worker] = []

    async def run_all(launches: list[WorkerLaunch], console: Console) -> list[WorkerExit]:
        for launch_ in launches:
            worker = Worker(launch_, console=console)
            workers.append(worker)
            await worker.start()
        exits = [await w.reaper for w in workers if w.reaper is not None]
        pending = [f for w in workers for f in w.output_pending()]
        if pending:
            await asyncio.wait(pending)
        return exits

    def start(launches: list[WorkerLaunch], console: Console) -> asyncio.Task[list[WorkerExit]]:
        return asyncio.create_task(asyncio.wait_for(run_all(launches, console), LIMIT))

    yield start
    for worker in workers:
        worker.signal_group(9)


PRINTER = """
    import os, sys
    r = os.environ["LOCAL_RANK"]
    print(f"out {r} {os.environ['MARK']}")
    print(f"err {r}", file=sys.stderr)
    sys.stdout.write(f"tail {r}")   # a last line without newline
"""


async def test_output_goes_to_files_and_prefixed_console(run, tmp_path) -> None:
    env = {"MARK": "m"}
    console = RecordingConsole()
    exits = await run([
        launch(0, PRINTER, env=env, log_dir=str(tmp_path / "0"), redirect=Std.OUT, tee=Std.ERR),
        launch(1, PRINTER, env=env, log_dir=None, redirect=Std.ALL),          # no dir: console instead
        launch(2, PRINTER, env=env, log_dir=str(tmp_path / "2"), echo=False),  # filtered off the console
        launch(3, PRINTER, env=env, log_dir=str(tmp_path / "3"), tee=Std.ALL),
    ], console)
    assert sorted((e.local_rank, e.rank, e.exitcode) for e in exits) == [(i, 10 + i, 0) for i in range(4)]
    assert (tmp_path / "0" / "stdout.log").read_text() == "out 0 m\ntail 0"
    assert (tmp_path / "0" / "stderr.log").read_text() == "err 0\n"
    assert (tmp_path / "3" / "stdout.log").read_text() == "out 3 m\ntail 3"
    assert (tmp_path / "3" / "stderr.log").read_text() == "err 3\n"
    assert not (tmp_path / "1").exists() and not (tmp_path / "2").exists()
    assert sorted(console.lines("stdout")) == sorted([
        "[h:rank 11] out 1 m", "[h:rank 11] tail 1", "[h:rank 13] out 3 m", "[h:rank 13] tail 3"])
    assert sorted(console.lines("stderr")) == ["[h:rank 10] err 0", "[h:rank 11] err 1", "[h:rank 13] err 3"]


async def test_long_lines_and_bad_utf8_are_kept(run, tmp_path) -> None:
    code = """
        import sys
        w = sys.stdout.buffer.write
        w(b"A" * 300000 + b"\\n")
        w("\\u00e9".encode() * 100000 + b"\\xff\\xfe end\\n")   # 2-byte chars split across reads
        w(b"last")
    """
    console = RecordingConsole()
    assert [e.exitcode for e in await run([launch(0, code, log_dir=str(tmp_path), tee=Std.OUT)], console)] == [0]
    expected = "A" * 300000 + "\n" + "\u00e9" * 100000 + "\ufffd\ufffd end\n" + "last"
    assert (tmp_path / "stdout.log").read_text(encoding="utf-8") == expected
    lines = console.lines("stdout")
    assert len(lines) > 4 and all(line.startswith("[h:rank 10] ") for line in lines)   # long lines in pieces
    assert "".join(line[len("[h:rank 10] "):] for line in lines) == expected.replace("\n", "")


async def test_console_lines_never_interleave(run) -> None:
    code = """
        import os
        tag = "ab"[int(os.environ["LOCAL_RANK"])] * 500
        for i in range(2000):
            print(tag, i)
    """
    out = io.StringIO()
    await run([launch(0, code), launch(1, code)], Console(out, io.StringIO()))   # the real console
    seen: dict[str, list[int]] = {"10": [], "11": []}
    for line in out.getvalue().splitlines():
        m = re.fullmatch(r"\[h:rank (1[01])\] (a{500}|b{500}) (\d+)", line)
        assert m is not None, line[:80]
        seen[m.group(1)].append(int(m.group(3)))
    assert seen == {"10": list(range(2000)), "11": list(range(2000))}


class _Broken(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


async def test_a_failing_log_file_is_dropped_with_one_line_and_the_console_goes_on() -> None:
    echoed: list[str] = []
    pump = LinePump(Sink(_Broken(), echoed.append))
    pump.data_received(b"one\ntwo\n")
    pump.connection_lost(None)
    assert echoed[0].startswith("(log file ") and "No space left" in echoed[0]
    assert echoed[1:] == ["one", "two"] and pump.done.done()


def test_a_broken_console_is_dropped_per_stream() -> None:
    out = io.StringIO()
    console = Console(out, _Broken())
    console.line("stderr", "lost")
    console.line("stdout", "kept")
    console.line("stderr", "not tried again")
    assert out.getvalue() == "kept\n" and console._broken == {"stderr"}
