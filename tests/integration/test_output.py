"""Worker output with real processes: log files, the prefixed console, long lines, bad UTF-8, no interleaving."""
from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator, Callable

import pytest

from node_agent.settings import Std
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.output import Console, LinePump, Sink, open_sink
from node_agent.workers.process import Worker, WorkerExit
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
    # The file holds the bytes as written, as torchrun's (its worker writes the file): not valid UTF-8 too
    assert (tmp_path / "stdout.log").read_bytes() == \
        b"A" * 300000 + b"\n" + "\u00e9".encode() * 100000 + b"\xff\xfe end\n" + b"last"
    # Long lines reach the console in pieces, and still as one line each with one prefix.
    assert console.lines("stdout") == ["[h:rank 10] " + line for line in expected.split("\n")]


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
    echoed: list[tuple[str, bool]] = []
    pump = LinePump(Sink(_Broken(), lambda text, ends_line: echoed.append((text, ends_line))))
    pump.data_received(b"one\ntwo\n")
    pump.connection_lost(None)
    assert echoed[0][0].startswith("(log file ") and "No space left" in echoed[0][0]
    assert echoed[1:] == [("one", True), ("two", True)] and pump.done.done()


def test_a_broken_console_is_dropped_per_stream() -> None:
    out = io.StringIO()
    console = Console(out, _Broken())
    console.line("stderr", "lost")
    console.line("stdout", "kept")
    console.line("stderr", "not tried again")
    assert out.getvalue() == "kept\n" and console._broken == {"stderr"}


async def test_by_default_a_worker_writes_to_the_console_itself_and_tee_prefixes_like_torchrun(run, tmp_path) -> None:
    code = """
        import os, sys
        r = os.environ["LOCAL_RANK"]
        print(f"out {r} tty={os.isatty(1)}")
        print(f"err {r}", file=sys.stderr)
    """
    out_path, err_path = tmp_path / "console.out", tmp_path / "console.err"
    out, err = _real_files(out_path, err_path)     # real files: the workers get their fds
    with out, err:
        console = Console(out, err)
        plain = launch(0, code, log_dir=str(tmp_path / "0"), prefix="", prefix_all=False)
        teed = launch(1, code, log_dir=str(tmp_path / "1"), prefix="[default1]:", prefix_all=False, tee=Std.ERR)
        assert open_sink(plain, "stdout", Std.OUT, console).direct == out.fileno()
        assert [e.exitcode for e in await run([plain, teed], console)] == [0, 0]
    assert sorted(out_path.read_text().splitlines()) == ["out 0 tty=False", "out 1 tty=False"]
    assert sorted(err_path.read_text().splitlines()) == ["[default1]:err 1", "err 0"]
    assert (tmp_path / "1" / "stderr.log").read_text() == "err 1\n" and not (tmp_path / "0").exists()


def _real_files(*paths):
    return tuple(open(p, "w") for p in paths)   # noqa: SIM115 - closed by the caller's with


async def test_a_partial_line_shows_without_waiting_for_its_end(run, tmp_path) -> None:
    go = tmp_path / "go"
    code = f"""
        import os, sys, time
        sys.stdout.write("\\r 10%")
        while not os.path.exists({str(go)!r}):   # held until the test saw the partial line
            time.sleep(0.01)
        sys.stdout.write("\\r 20%\\n")
    """
    console = RecordingConsole()
    task = run([launch(0, code)], console)
    assert await console.seen(" 10%") == "[h:rank 10] \r 10%"      # shown while the worker waits
    assert not task.done()
    go.touch()
    assert [e.exitcode for e in await task] == [0]
    # Each redraw keeps the prefix: on a terminal the line reads "[h:rank 10]  20%".
    assert console.out.getvalue() == "[h:rank 10] \r[h:rank 10]  10%\r[h:rank 10]  20%\n"


def test_an_unfinished_line_is_ended_before_another_writers_line() -> None:
    out = io.StringIO()
    console = Console(out, io.StringIO())
    a, b = object(), object()
    console.write("stdout", a, "[a]", "abc", ends_line=False)
    console.write("stdout", b, "[b]", "xyz", ends_line=True)
    console.write("stdout", a, "[a]", "def", ends_line=True)
    console.write("stdout", a, "[a]", "ghi", ends_line=False)
    console.write("stdout", a, "[a]", "jkl", ends_line=True)
    assert out.getvalue() == "[a]abc\n[b]xyz\n[a]def\n[a]ghijkl\n"


async def test_duplicate_filters_copy_matching_teed_lines_of_every_rank(run, tmp_path) -> None:
    code = """
        import os
        r = os.environ["LOCAL_RANK"]
        print(f"apple {r}")
        print(f"pear {r}")
        print(f"orange, {r}")
    """
    common = dict(prefix_all=False, attempt_dir=str(tmp_path), dup_stdout=("apple", "orange,"))
    launches = [launch(r, code, log_dir=str(tmp_path / str(r)), prefix=f"[default{r}]:", tee=Std.OUT, **common)
                for r in (0, 1)]
    launches.append(launch(2, code, log_dir=str(tmp_path / "2"), prefix="[default2]:", redirect=Std.OUT, **common))
    await run(launches, RecordingConsole())
    assert sorted((tmp_path / "filtered_stdout.log").read_text().splitlines()) == [
        "[default0]:apple 0", "[default0]:orange, 0", "[default1]:apple 1", "[default1]:orange, 1"]
    assert not (tmp_path / "filtered_stderr.log").exists()


async def test_a_workers_last_partial_line_is_ended_when_its_stream_ends(run) -> None:
    # The agent's own lines go to stderr, often the same pipe or file as stdout (2>&1, a pod's log):
    # without the newline its next line ("job ... succeeded") ran on after "last" on the same line.
    console = RecordingConsole()
    assert [e.exitcode for e in await run([launch(0, 'import sys; sys.stdout.write("last")')], console)] == [0]
    assert console.out.getvalue() == "[h:rank 10] last\n"


def test_ending_a_stream_adds_no_empty_line_once_another_writer_ended_its_line() -> None:
    out = io.StringIO()
    console = Console(out, io.StringIO())
    a, b = object(), object()
    console.write("stdout", a, "[a]", "abc", ends_line=False)
    console.write("stdout", b, "[b]", "xyz", ends_line=False)   # ends a's line first
    console.end("stdout", a)      # a's stream ended: nothing of a's is open
    console.end("stdout", b)
    console.end("stdout", b)      # twice: one newline
    assert out.getvalue() == "[a]abc\n[b]xyz\n"
