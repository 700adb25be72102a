"""Warm workers for real: a worker forked by the zygote sees and ends exactly as a cold one does.

Each case runs the same program cold (asyncio's subprocess) and warm (forked by a zygote that preloaded
`json`, or torch where torch is the point) and compares what the worker saw and how its end was reported.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gzip
import importlib
import json
import os
import shutil
import signal
import sys
import sysconfig
import zipfile
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import psutil
import pytest

from node_agent.settings import DEFAULT_PRELOAD, WorkerSettings
from node_agent.training import exit_marks
from node_agent.workers import local
from node_agent.workers.group import WorkerGroup
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.process import WorkerExit
from node_agent.workers.warm import zygote as zygote_module
from node_agent.workers.warm.client import WarmZygote
from node_agent.workers.warm.eligible import base_env, warm_launch
from protocol.messages import Assignment
from tests.e2e.harness import pid_gone
from tests.integration.warm_scripts import DESTROY, DUMP, FAILING, LAST_VALUE, LEFT_OPEN, OWNMOD, RECORD
from tests.integration.worker_support import LIMIT, RecordingConsole, kill_strays

# pytest changes PYTEST_CURRENT_TEST between phases: the workers' environment must not
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
MakeZygote = Callable[..., Awaitable[WarmZygote]]


@pytest.fixture
async def make_zygote(tmp_path) -> AsyncIterator[MakeZygote]:
    made: list[WarmZygote] = []

    async def make(preload: tuple[str, ...] = ("json",), warnings: list[str] | None = None,
                   env: dict[str, str] | None = None, fallback: tuple[str, ...] | None = None) -> WarmZygote:
        zygote = WarmZygote(sys.executable, preload, str(tmp_path), base_env({**ENV, **(env or {})}),
                            warnings.append if warnings is not None else print, fallback)
        made.append(zygote)
        zygote.start()
        assert await zygote.wait_ready(LIMIT * 2), "the zygote never became ready"
        return zygote

    yield make
    for zygote in made:
        await zygote.close()


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> str:
    (tmp_path / "dump.py").write_text(DUMP)
    (tmp_path / "dumpmod.py").write_text(DUMP)
    (tmp_path / "rec.py").write_text(RECORD)
    monkeypatch.chdir(tmp_path)
    return str(tmp_path)


class Run:
    def __init__(self, exit_: WorkerExit, console: RecordingConsole, warm: bool, error: dict | None) -> None:
        self.exit, self.console, self.warm, self.error = exit_, console, warm, error

    def key(self) -> tuple[int, str]:
        return self.exit.exitcode, self.exit.signal_name


async def run(argv: list[str], zygote: WarmZygote | None, tmp: str, *, extra_env: dict[str, str] | None = None) -> Run:
    error_file = os.path.join(tmp, "error.json")
    env = {**ENV, "RANK": "3", "LOCAL_RANK": "0", **(extra_env or {}), "TORCHELASTIC_ERROR_FILE": error_file}
    launch = WorkerLaunch(local_rank=0, rank=3, argv=[sys.executable, "-u", *argv], env=env, log_dir=None,
                          prefix="[w] ", prefix_all=True)
    console = RecordingConsole()
    group = WorkerGroup([launch], stop_timeout=5, console=console, warm=zygote)
    try:
        await group.start()
        warm = bool(group.warm_pids)
        (exit_,) = await asyncio.wait_for(group.wait(), LIMIT)
    finally:
        await group.stop(signal.SIGKILL)
    error = None
    if exit_.error_file:
        error = dumped(exit_.error_file)
        os.unlink(exit_.error_file)
    return Run(exit_, console, warm, error)


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def dumped(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("form", [["dump.py"], ["-m", "dumpmod"]], ids=["script", "module"])
async def test_a_warm_worker_sees_what_a_cold_one_sees(make_zygote, workdir, form) -> None:
    zygote = await make_zygote()
    out = os.path.join(workdir, "seen.json")
    cold = await run([*form, out, "0"], None, workdir)
    seen_cold = dumped(out)
    warm = await run([*form, out, "0"], zygote, workdir)
    seen_warm = dumped(out)
    assert (cold.warm, warm.warm) == (False, True)
    assert set(seen_cold["modules"]) <= set(seen_warm.pop("modules")) and seen_cold.pop("modules")   # + preloads
    assert seen_warm == seen_cold
    assert seen_warm["name"] == "__main__" and seen_warm["argv"][1:] == [out, "0"]
    assert seen_warm["file"] == os.path.join(workdir, "dump.py" if form == ["dump.py"] else "dumpmod.py")
    assert seen_warm["path"][0] == workdir and seen_warm["environ"]["RANK"] == "3"


@pytest.mark.parametrize("how", ["0", "3", "raise", "interrupt", "sigkill", "os_exit", "message"])
async def test_a_warm_worker_ends_as_a_cold_one(make_zygote, workdir, how) -> None:
    zygote = await make_zygote()
    out = os.path.join(workdir, "seen.json")
    cold = await run(["dump.py", out, how], None, workdir)
    warm = await run(["dump.py", out, how], zygote, workdir)
    assert warm.warm
    assert warm.key() == cold.key()
    assert warm.console.lines("stderr") == cold.console.lines("stderr")
    expected = {"0": (0, ""), "3": (3, ""), "raise": (1, ""), "interrupt": (-2, "SIGINT"),
                "sigkill": (-9, "SIGKILL"), "os_exit": (7, ""), "message": (1, "")}[how]
    assert warm.key() == expected
    if how == "raise":
        assert warm.console.lines("stderr")[0] == "[w] Traceback (most recent call last):"
        assert warm.console.lines("stderr")[-1] == "[w] ValueError: boom"


async def test_a_worker_killed_from_outside_is_reported_with_its_signal(make_zygote, workdir) -> None:
    zygote = await make_zygote()
    error_file = os.path.join(workdir, "error.json")
    launch = WorkerLaunch(local_rank=0, rank=0, argv=[sys.executable, "-u", "dump.py", "x.json", "child"],
                          env={**ENV, "TORCHELASTIC_ERROR_FILE": error_file}, log_dir=None, prefix="[w] ",
                          prefix_all=True)
    console = RecordingConsole()
    group = WorkerGroup([launch], stop_timeout=5, console=console, warm=zygote)
    try:
        await group.start()
        assert group.warm_pids == group.pids
        await console.seen("child")   # the worker has started; it exits 0 once its child is started
        (exit_,) = await asyncio.wait_for(group.wait(), LIMIT)
        assert exit_.exitcode == 0
    finally:
        await group.stop()
    child = int((await console.seen("child")).split()[-1])
    try:   # the worker's child was left in the worker's group: the stop swept it away (no orphan)
        assert await asyncio.to_thread(pid_gone, child, LIMIT), "the warm worker's child outlived the stop"
    finally:
        kill_strays([child])


async def test_sigkill_of_a_running_warm_worker_reads_as_sigkill(make_zygote, workdir) -> None:
    zygote = await make_zygote()
    (Path(workdir) / "sleep.py").write_text("import os, time; print('up', os.getpid(), flush=True); time.sleep(600)")
    launch = WorkerLaunch(local_rank=0, rank=0, argv=[sys.executable, "-u", "sleep.py"], env=dict(ENV),
                          log_dir=None, prefix="[w] ", prefix_all=True)
    console = RecordingConsole()
    group = WorkerGroup([launch], stop_timeout=5, console=console, warm=zygote)
    try:
        await group.start()
        pid = int((await console.seen("up")).split()[-1])
        assert group.warm_pids == [pid] and psutil.Process(pid).ppid() == zygote.pid
        os.kill(pid, signal.SIGKILL)
        (exit_,) = await asyncio.wait_for(group.wait(), LIMIT)
        assert (exit_.exitcode, exit_.signal_name) == (-9, "SIGKILL")
    finally:
        await group.stop(signal.SIGKILL)


async def test_a_preload_that_fails_is_one_warning_and_workers_still_start_warm(make_zygote, workdir) -> None:
    warnings: list[str] = []
    zygote = await make_zygote(("json", "no_such_module_xyz"), warnings)
    assert len(warnings) == 1 and "'no_such_module_xyz'" in warnings[0] and "\n" not in warnings[0]
    warm = await run(["dump.py", os.path.join(workdir, "seen.json"), "0"], zygote, workdir)
    assert warm.warm and warm.key() == (0, "")


LAZY = """import importlib
def __getattr__(name):
    if name == "Thing":
        return importlib.import_module(__name__ + ".heavy").Thing
    raise AttributeError(name)
"""


async def test_a_name_a_script_imports_from_a_lazy_package_is_looked_up_in_the_zygote(make_zygote, workdir) -> None:
    """`from lazy import Thing` imports lazy.heavy only when Thing is looked up (as transformers does its Trainer):
    preloading `lazy:Thing` does that in the zygote; `lazy:sub`, a submodule the package does not import itself."""
    os.mkdir(os.path.join(workdir, "lazy"))
    write(os.path.join(workdir, "lazy", "__init__.py"), LAZY)
    write(os.path.join(workdir, "lazy", "heavy.py"), "class Thing:\n    pass\n")
    write(os.path.join(workdir, "lazy", "sub.py"), "")
    write(os.path.join(workdir, "seen.py"), "import sys\nopen(sys.argv[1], 'w').write(','.join(sorted(m for m in "
                                            "sys.modules if m.startswith('lazy'))))\n")
    out = os.path.join(workdir, "seen.txt")
    cold = await run(["seen.py", out], None, workdir)
    assert not cold.warm and read(out) == ""
    warnings: list[str] = []
    # a name not there (imported in a branch of another version's) is passed over unsaid: the script says so itself
    zygote = await make_zygote(("lazy", "lazy:Thing", "lazy:sub", "lazy:Nowhere"), warnings)
    warm = await run(["seen.py", out], zygote, workdir)
    assert warm.warm and read(out) == "lazy,lazy.heavy,lazy.sub" and warnings == []


@pytest.mark.parametrize(("package", "module", "rank"), [
    ("lightning", "lightning.fabric.utilities.rank_zero", "3"),   # Lightning reads RANK first
    ("torchmetrics", "torchmetrics.utilities.prints", "1"),       # torchmetrics its LOCAL_RANK, a function of its own
], ids=["lightning", "torchmetrics"])
async def test_a_frameworks_rank_is_the_workers_not_the_zygotes(make_zygote, workdir, package, module, rank) -> None:
    """Lightning and torchmetrics keep the rank the environment said at their import (rank_zero_only.rank): a
    worker forked from a zygote that imported them has its own, as a cold one does (RANK=3, LOCAL_RANK=1; the
    zygote's environment has neither)."""
    pytest.importorskip(package)
    write(os.path.join(workdir, "rank.py"), f"import sys\nfrom {module} import rank_zero_only\n"
                                            "open(sys.argv[1], 'w').write(str(rank_zero_only.rank))\n")
    zygote = await make_zygote((module,))
    out = os.path.join(workdir, "rank.txt")
    cold = await run(["rank.py", out], None, workdir, extra_env={"LOCAL_RANK": "1"})
    cold_rank = read(out)
    warm = await run(["rank.py", out], zygote, workdir, extra_env={"LOCAL_RANK": "1"})
    assert (cold.warm, warm.warm) == (False, True)
    assert cold_rank == read(out) == rank


def installed_site(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A directory packages are installed into (a user site: `pip install --user`'s), on the path: (it, the
    environment that makes it so). The zygote preloads the script's imports only from such a place."""
    base = os.path.join(tmp_path, "userbase")
    site = sysconfig.get_path("purelib", scheme="posix_user", vars={"userbase": base})
    os.makedirs(site)
    return site, {"PYTHONUSERBASE": base, "PYTHONPATH": site}


async def test_script_imports_that_leave_a_thread_fall_back_to_the_base_preloads(workdir, tmp_path) -> None:
    """A preloaded import that starts a thread makes a fork unsafe: the zygote is started again with the base
    list (said once), and workers start warm from it."""
    site, installed = installed_site(tmp_path)
    write(os.path.join(site, "threads_at_import.py"),
          "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    warnings: list[str] = []
    env = base_env({**ENV, **installed})
    zygote = WarmZygote(sys.executable, ("json", "threads_at_import"), str(tmp_path), env, warnings.append,
                        fallback=("json",))
    try:
        zygote.start()
        deadline = asyncio.get_running_loop().time() + LIMIT * 4
        while not (zygote.ready and zygote.preload == ("json",)):
            assert asyncio.get_running_loop().time() < deadline, warnings
            await zygote.wait_ready(LIMIT)
        assert len(warnings) == 1 and "after preloading the script's imports (threads_at_import)" in warnings[0]
        out = os.path.join(workdir, "seen.json")        # forked from a clean zygote: warm, without that import
        assert (await run(["dump.py", out, "0"], zygote, workdir, extra_env=installed)).warm
        assert "json" in dumped(out)["modules"] and "threads_at_import" not in dumped(out)["modules"]
    finally:
        await zygote.close()


async def test_a_name_whose_lookup_leaves_a_thread_costs_only_the_names_their_preload(workdir, tmp_path) -> None:
    """A name looked up (`module:name`) that starts a thread: the next zygote preloads the modules without the names
    (said once), not the base list only (a review: one name cost every module its preload)."""
    site, installed = installed_site(tmp_path)
    write(os.path.join(site, "lazyt.py"), "import threading, time\ndef __getattr__(name):\n"
                                          "    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
                                          "    return name\n")
    warnings: list[str] = []
    env = base_env({**ENV, **installed})
    zygote = WarmZygote(sys.executable, ("json", "lazyt", "lazyt:Threaded"), str(tmp_path), env, warnings.append,
                        fallback=("json",))
    try:
        zygote.start()
        deadline = asyncio.get_running_loop().time() + LIMIT * 4
        while not (zygote.ready and zygote.preload == ("json", "lazyt")):
            assert asyncio.get_running_loop().time() < deadline, warnings
            await zygote.wait_ready(LIMIT)
        assert len(warnings) == 1 and "(lazyt:Threaded); the next zygote preloads their modules only" in warnings[0]
    finally:
        await zygote.close()


async def test_a_launch_whose_environment_differs_from_the_zygotes_starts_cold(make_zygote, workdir) -> None:
    zygote = await make_zygote()
    out = os.path.join(workdir, "seen.json")
    changed = await run(["dump.py", out, "0"], zygote, workdir, extra_env={"WARM_TEST_CHANGED": "1"})
    assert not changed.warm and changed.key() == (0, "") and dumped(out)["environ"]["WARM_TEST_CHANGED"] == "1"
    # the zygote is started anew with the new environment: the next such launch is warm
    assert await zygote.wait_ready(LIMIT * 2)
    again = await run(["dump.py", out, "0"], zygote, workdir, extra_env={"WARM_TEST_CHANGED": "1"})
    assert again.warm and again.key() == (0, "")


async def test_torch_zygote_is_clean_and_record_reports_the_same(make_zygote, workdir) -> None:
    pytest.importorskip("torch")
    zygote = await make_zygote(DEFAULT_PRELOAD)        # torch._dynamo included: it must start nothing either
    # forked (the zygote had no Python thread but its own: it forks no other), with torch, CUDA untouched, and
    # no socket of the zygote's
    out = os.path.join(workdir, "seen.json")
    assert (await run(["dump.py", out, "0"], zygote, workdir)).warm
    seen = dumped(out)
    assert "torch" in seen["modules"] and not seen["cuda_initialized"] and seen["sockets"] == []
    cold = await run(["rec.py"], None, workdir)
    warm = await run(["rec.py"], zygote, workdir)
    assert warm.warm and warm.key() == cold.key() == (1, "")
    assert cold.error is not None and warm.error is not None
    assert warm.error["message"]["message"] == cold.error["message"]["message"] == "RuntimeError: recorded failure"
    assert warm.error["message"]["extraInfo"]["py_callstack"].splitlines()[-1] == \
        cold.error["message"]["extraInfo"]["py_callstack"].splitlines()[-1]


async def test_each_warm_worker_starts_from_the_clean_zygote_not_from_a_previous_worker(make_zygote, workdir) -> None:
    zygote = await make_zygote()
    (Path(workdir) / "dirty.py").write_text(
        "import json, sys\nprint('seen', getattr(json, 'MARK', None), flush=True)\njson.MARK = 'dirty'\nsys.exit(5)\n")
    first = await run(["dirty.py"], zygote, workdir)
    second = await run(["dirty.py"], zygote, workdir)
    assert first.warm and second.warm and first.key() == second.key() == (5, "")
    assert first.console.lines("stdout") == second.console.lines("stdout") == ["[w] seen None"]


async def test_a_zygote_that_dies_takes_its_workers_and_is_started_anew(make_zygote, workdir) -> None:
    warnings: list[str] = []
    zygote = await make_zygote(warnings=warnings)
    (Path(workdir) / "sleep.py").write_text("import os, time; print('up', os.getpid(), flush=True); time.sleep(600)")
    launch = WorkerLaunch(local_rank=0, rank=0, argv=[sys.executable, "-u", "sleep.py"], env=dict(ENV),
                          log_dir=None, prefix="[w] ", prefix_all=True)
    group = WorkerGroup([launch], stop_timeout=5, console=RecordingConsole(), warm=zygote)
    first = zygote.pid
    assert first is not None
    try:
        await group.start()
        assert group.warm_pids
        os.kill(first, signal.SIGKILL)
        (exit_,) = await asyncio.wait_for(group.wait(), LIMIT)
        assert (exit_.exitcode, exit_.signal_name) == (-9, "SIGKILL")   # PDEATHSIG: it died with the zygote
        assert await asyncio.to_thread(pid_gone, exit_.pid, LIMIT)
    finally:
        await group.stop(signal.SIGKILL)
    assert await zygote.wait_ready(LIMIT * 2) and zygote.pid not in (None, first)
    assert warnings == [f"warm workers: the zygote ({sys.executable}) died; a new one is started"]
    assert (await run(["dump.py", os.path.join(workdir, "seen.json"), "0"], zygote, workdir)).warm


async def test_the_per_worker_hook_sets_the_cpu_affinity_in_the_child(make_zygote, workdir) -> None:
    zygote = await make_zygote()
    (Path(workdir) / "cpus.py").write_text("import os\nprint(sorted(os.sched_getaffinity(0)))\n")
    cpu = min(os.sched_getaffinity(0))
    launch = WorkerLaunch(local_rank=0, rank=0, argv=[sys.executable, "-u", "cpus.py"], env=dict(ENV), log_dir=None)
    plan = warm_launch(launch, sys.executable)
    assert plan is not None
    r, w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        child = await zygote.spawn(dataclasses.replace(plan, cpus=(cpu,)), [null, w, w])
    finally:
        os.close(w)
        os.close(null)
    assert child is not None and await asyncio.wait_for(child.wait(), LIMIT) == 0
    with os.fdopen(r) as out:
        assert out.read() == f"[{cpu}]\n"


@pytest.mark.parametrize("case", ["plain", "thread", "full_exit", "ok"])
async def test_a_warm_worker_ends_at_once_keeping_what_the_user_relies_on(make_zygote, workdir, case) -> None:
    """Issue 27: a warm worker whose exception is printed (or whose script ended) exits without the
    interpreter's teardown, but with the same status, traceback, atexit handlers and flushed files as a
    cold one. A non-daemon thread still running, or NODE_AGENT_FULL_EXIT=1, keeps the full exit (its
    __del__ runs)."""
    env = {"NODE_AGENT_FULL_EXIT": "1"} if case == "full_exit" else {}
    zygote = await make_zygote(env=env)
    (Path(workdir) / "failing.py").write_text(FAILING)
    left: dict[str, set[str]] = {}
    runs = {}
    for how, z in (("cold", None), ("warm", zygote)):
        out = Path(workdir) / how
        out.mkdir()
        runs[how] = await run(["failing.py", str(out), case], z, workdir, extra_env=env)
        left[how] = {p.name for p in out.iterdir()}
        assert (out / "buffered").read_text() == "kept"
    status = (0, "") if case == "ok" else (1, "")
    assert runs["warm"].warm and runs["warm"].key() == runs["cold"].key() == status
    assert runs["warm"].console.lines("stderr") == runs["cold"].console.lines("stderr")
    if case != "ok":
        assert runs["warm"].console.lines("stderr")[-1] == "[w] RuntimeError: failed"
    full = {"atexit", "buffered", "finalized"} | ({"thread"} if case == "thread" else set())
    assert left["cold"] == full
    # a crash skips the teardown (the restart waits for it); a script that ended frees what it made
    assert left["warm"] == (full if case in ("thread", "full_exit", "ok") else {"atexit", "buffered"})


@pytest.mark.parametrize("how", ["end", "exit"])
async def test_a_warm_worker_that_ends_finishes_what_the_scripts_objects_would(make_zygote, workdir, how) -> None:
    """A review: files a script never closed (a zip file, gzip's, its own module's), a temporary file and a
    paused generator were left as they were at a warm worker's end: a zip file unreadable, the temporary file
    left, the `finally` never run. Python's teardown finishes them; a warm worker that ends does too."""
    write(os.path.join(workdir, "ownmod.py"), OWNMOD)
    write(os.path.join(workdir, "left.py"), LEFT_OPEN)
    zygote = await make_zygote()
    seen = {}
    for kind, z in (("cold", None), ("warm", zygote)):
        out = os.path.join(workdir, kind)
        os.mkdir(out)
        result = await run(["left.py", out, how], z, workdir)
        assert result.warm == (kind == "warm") and result.key() == (0, "")
        with zipfile.ZipFile(os.path.join(out, "run.zip")) as a, zipfile.ZipFile(os.path.join(out, "local.zip")) as b:
            names = (a.namelist(), b.namelist())
        with gzip.open(os.path.join(out, "log.gz"), "rt") as g, gzip.open(os.path.join(out, "own.gz"), "rt") as h:
            texts = (g.read(), h.read())
        seen[kind] = (names, texts, sorted(os.listdir(out)), result.console.lines("stdout"))
    assert seen["cold"] == ((["m.json"], ["a"]), ("line\n", "own\n"), ["local.zip", "log.gz", "own.gz", "run.zip"],
                            ["[w] generator finalized"])
    assert seen["warm"] == seen["cold"]


async def test_pythonsafepath_keeps_the_scripts_directory_off_a_warm_workers_path(make_zygote, workdir) -> None:
    """A review: with PYTHONSAFEPATH=1 a cold worker's sys.path has no script directory; a warm worker's had it
    in place of the path's first entry."""
    write(os.path.join(workdir, "path.py"), "import sys\nprint(sys.path[:2], flush=True)\n")
    env = {"PYTHONSAFEPATH": "1"}
    zygote = await make_zygote(env=env)
    cold = await run(["path.py"], None, workdir, extra_env=env)
    warm = await run(["path.py"], zygote, workdir, extra_env=env)
    assert warm.warm and warm.console.lines("stdout") == cold.console.lines("stdout")
    assert workdir not in cold.console.lines("stdout")[0]


async def test_ps_and_pgrep_see_a_warm_workers_command_as_a_cold_ones(make_zygote, workdir) -> None:
    """A review: every warm worker's /proc/PID/cmdline was the zygote's (`python -u .../zygote.py 8 ...`): `pgrep
    -f train.py` found none of them. It reads as the worker's own command line, as one line (setproctitle's)."""
    write(os.path.join(workdir, "cmd.py"), "import sys\nwith open('/proc/self/cmdline', 'rb') as f:\n"
          "    print(f.read().split(b'\\0')[0].decode() if sys.argv[-1] == 'warm' else "
          "f.read().rstrip(b'\\0').replace(b'\\0', b' ').decode(), flush=True)\n")
    zygote = await make_zygote()
    cold = await run(["cmd.py", "--lr", "0.1", "cold"], None, workdir)
    warm = await run(["cmd.py", "--lr", "0.1", "warm"], zygote, workdir)
    assert warm.warm and cold.console.lines("stdout") == [f"[w] {sys.executable} -u cmd.py --lr 0.1 cold"]
    assert warm.console.lines("stdout") == [f"[w] {sys.executable} -u cmd.py --lr 0.1 warm"]
    assert any(arg.endswith("zygote.py") for arg in psutil.Process(zygote.pid).cmdline())   # the zygote keeps its own


async def test_atexit_handlers_of_a_crashed_warm_worker_see_the_exception_as_a_cold_ones_do(make_zygote,
                                                                                          workdir) -> None:
    write(os.path.join(workdir, "last.py"), LAST_VALUE)
    zygote = await make_zygote()
    cold = await run(["last.py"], None, workdir)
    warm = await run(["last.py"], zygote, workdir)
    assert warm.warm and warm.key() == cold.key() == (1, "")
    assert warm.console.lines("stdout") == cold.console.lines("stdout") == ["[w] at exit: RuntimeError True"]


async def test_the_users_own_package_on_pythonpath_is_not_preloaded_and_reads_the_workers_rank(
        make_zygote, workdir, tmp_path) -> None:
    """A review: a package of the user's own on PYTHONPATH (not beside the script) that the script imports was
    taken for an installed one and imported in the zygote: it read the zygote's rank and command line, and a
    restart ran it unedited. Only the script's imports found in the interpreter's library are preloaded."""
    proj = tmp_path / "proj"
    (proj / "mylib").mkdir(parents=True)
    (proj / "mylib" / "__init__.py").write_text("import os, sys\nRANK = os.environ.get('RANK')\nARGV = sys.argv[1:]\n")
    write(os.path.join(workdir, "own.py"),
          "import sys\nprint(sorted(m for m in ('mylib', 'msgpack') if m in sys.modules), flush=True)\n"
          "import msgpack, mylib\nprint(mylib.RANK, mylib.ARGV, flush=True)\n")
    env = {"PYTHONPATH": str(proj)}
    said: list[str] = []
    zygote = await make_zygote(("json", "msgpack", "mylib"), warnings=said, env=env, fallback=("json",))
    cold = await run(["own.py", "--lr", "0.1"], None, workdir, extra_env=env)
    warm = await run(["own.py", "--lr", "0.1"], zygote, workdir, extra_env=env)
    assert warm.warm and cold.console.lines("stdout") == ["[w] []", "[w] 3 ['--lr', '0.1']"]
    assert warm.console.lines("stdout") == ["[w] ['msgpack']", "[w] 3 ['--lr', '0.1']"] and not said


@pytest.mark.parametrize("exit_env", [{}, {"NODE_AGENT_FULL_EXIT": "1"}], ids=["at_once", "full_exit"])
async def test_a_file_a_preload_opened_keeps_every_workers_writes_once(make_zygote, workdir, exit_env) -> None:
    """A package that opens a log file at import (in the zygote, for warm workers): each worker's writes reach
    it, at the early exit too, and what the import itself wrote reaches it once, not once per worker."""
    log = os.path.join(workdir, "log.txt")
    write(os.path.join(workdir, "logmod.py"), f"LOG = open({log!r}, 'a')\nLOG.write('import\\n')\n")
    write(os.path.join(workdir, "logs.py"), "import sys, logmod\nlogmod.LOG.write(f'worker {sys.argv[1]}\\n')\n")
    cold = await run(["logs.py", "cold"], None, workdir, extra_env=exit_env)
    zygote = await make_zygote(("json", "logmod"), env=exit_env)
    warm = [await run(["logs.py", f"warm{i}"], zygote, workdir, extra_env=exit_env) for i in (1, 2)]
    assert not cold.warm and all(r.warm and r.key() == (0, "") for r in warm)
    assert read(log).splitlines() == ["import", "worker cold", "import", "worker warm1", "worker warm2"]


PRINTS = """\
import ctypes, os, sys, warnings
print("printed at import")
print("to stderr at import", file=sys.stderr)
os.write(1, b"written to fd 1 at import\\n")
ctypes.CDLL(None).printf(b"from C at import\\n")
warnings.warn("a warning at import")
"""


async def test_what_a_preloads_import_prints_each_warm_worker_shows_as_a_cold_one(make_zygote, workdir,
                                                                                 capfd) -> None:
    """A module the zygote preloads prints at import (Python, the fd itself, C's stdio, a warning): each warm worker
    shows it on its own stdout and stderr, as each cold worker does, and the agent's own stderr gets none of it."""
    write(os.path.join(workdir, "printsmod.py"), PRINTS)
    write(os.path.join(workdir, "prints.py"), "import printsmod\nprint('the script')\n")
    cold = await run(["prints.py"], None, workdir)
    said: list[str] = []
    zygote = await make_zygote(("json", "printsmod"), warnings=said)
    warm = [await run(["prints.py"], zygote, workdir) for _ in range(2)]
    assert not cold.warm and all(r.warm and r.key() == (0, "") for r in warm)
    out, err = cold.console.lines("stdout"), cold.console.lines("stderr")
    assert {"[w] printed at import", "[w] written to fd 1 at import", "[w] from C at import"} <= set(out)
    assert "[w] to stderr at import" in err and any("UserWarning: a warning at import" in line for line in err)
    for r in warm:   # C's stdio reaches a cold worker's pipe only at its exit: the same lines, maybe in another order
        assert sorted(r.console.lines("stdout")) == sorted(out) and r.console.lines("stderr") == err
        assert r.console.lines("stdout").index("[w] printed at import") < r.console.lines("stdout").index(
            "[w] the script")
    agent = capfd.readouterr()      # the zygote's own streams are the test process's (the agent's)
    assert not said and "at import" not in agent.out + agent.err


TROUBLE = """\
import io

BUILT = []


class Lazy:                        # as Django's settings and accelerate's proxies: __class__ builds, or raises
    @property
    def __class__(self):
        BUILT.append("built")
        raise RuntimeError("settings are not configured")


class Failing(io.RawIOBase):
    def writable(self):
        return True

    def write(self, b):
        raise RuntimeError("this file cannot be written")


settings = Lazy()
broken = io.BufferedWriter(Failing())
broken.write(b"never")
"""


async def test_a_preloads_odd_objects_neither_stop_the_zygote_nor_the_workers_flushes(make_zygote, workdir) -> None:
    """The file objects are found by their type alone, and a file that fails to flush is passed over, as
    finalization passes it: a lazy proxy among a preload's objects is not built (nor its error raised) in the
    zygote, a file whose flush raises costs no other file its flush, and a file object of the worker's own that
    is not one of io's concrete types (gzip's) is flushed too."""
    write(os.path.join(workdir, "trouble.py"), TROUBLE)
    log = os.path.join(workdir, "log.txt")
    write(os.path.join(workdir, "logmod.py"), f"LOG = open({log!r}, 'a')\n")
    write(os.path.join(workdir, "odd.py"), "import gzip, sys, logmod, trouble\n"
                                           "mine = trouble.Lazy()\nbad = trouble.io.BufferedWriter(trouble.Failing())\n"
                                           "bad.write(b'x')\nlogmod.LOG.write(f'{sys.argv[1]} {trouble.BUILT}\\n')\n"
                                           "gz = gzip.open(sys.argv[1] + '.gz', 'wb')\ngz.write(b'kept')\n")
    warnings: list[str] = []
    zygote = await make_zygote(("json", "trouble", "logmod"), warnings)
    runs = [await run(["odd.py", os.path.join(workdir, f"w{i}")], zygote, workdir) for i in (1, 2)]
    assert all(r.warm and r.key() == (0, "") for r in runs) and warnings == []
    assert read(log).splitlines() == [f"{os.path.join(workdir, f'w{i}')} []" for i in (1, 2)]
    for i in (1, 2):     # no gzip trailer at the fast exit (no __del__ closes it), but every byte written
        assert zlib.decompressobj(31).decompress(read_bytes(os.path.join(workdir, f"w{i}.gz"))) == b"kept"


OURS = """\
import atexit, os, sys, threading, time
from node_agent.training import exit_marks
out = sys.argv[1]
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write("ran"))


class Finalized:
    def __del__(self, _open=open, _path=os.path.join(out, "finalized")):
        with _open(_path, "w") as f:
            f.write("ran")


marker = Finalized()


def write():                        # as a snapshot's write: ends by itself, and is wanted
    time.sleep(0.3)
    open(os.path.join(out, "written"), "w").write("ran")


blocked, _ = os.pipe()              # as pinned buffers allocated ahead: worth nothing now (never ends here)
exit_marks.mark(threading.Thread(target=write), exit_marks.JOIN).start()
exit_marks.mark(threading.Thread(target=os.read, args=(blocked, 1)), exit_marks.DROP).start()
raise RuntimeError("failed")
"""


async def test_a_warm_worker_waits_for_its_snapshots_write_and_not_for_buffers_ahead(make_zygote, workdir) -> None:
    """A crash right after a snapshot (its write still running in a thread of ours) took the full exit, the
    interpreter's teardown (~0.3 s here, ~1.7 s with CUDA) before the restart: the fast exit now waits for the
    write alone (it is wanted) and leaves a thread allocating buffers ahead (worth nothing now)."""
    zygote = await make_zygote()
    (Path(workdir) / "ours.py").write_text(OURS)
    out = Path(workdir) / "out"
    out.mkdir()
    warm = await run(["ours.py", str(out)], zygote, workdir)
    assert warm.warm and warm.key() == (1, "")
    assert warm.console.lines("stderr")[-1] == "[w] RuntimeError: failed"
    assert {p.name for p in out.iterdir()} == {"atexit", "written"}     # no teardown ("finalized")
    assert (exit_marks.ATTRIBUTE, exit_marks.JOIN, exit_marks.DROP) == (zygote_module.AT_EXIT, "join", "drop")


INTERRUPTED = """\
import os, signal, sys, threading, time
from node_agent.training import exit_marks
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))      # a user's handler: "stop means done"
main = threading.main_thread().ident
blocked, _ = os.pipe()


def waiting(frame):
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return "exit_at_once" in names and "join" in names


def write():                        # a write that never ends: the signal comes while the exit waits for it
    while not waiting(sys._current_frames().get(main)):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    os.read(blocked, 1)


exit_marks.mark(threading.Thread(target=write), exit_marks.JOIN).start()
raise RuntimeError("failed")
"""


async def test_a_signal_handlers_exit_during_the_wait_for_a_write_keeps_the_crashs_status(make_zygote, workdir) -> None:
    """A user's SIGTERM handler that calls sys.exit(0) while the fast exit waits for a snapshot's write ends the
    wait, as in Python's own shutdown, and the worker still ends as the crash it was (exit 1, not 0: a job
    reported done whose training had failed)."""
    zygote = await make_zygote()
    (Path(workdir) / "interrupted.py").write_text(INTERRUPTED)
    warm = await run(["interrupted.py"], zygote, workdir)
    assert warm.warm and warm.key() == (1, "")
    assert warm.console.lines("stderr")[-1] == "[w] RuntimeError: failed"


@pytest.fixture
def gated_preload(workdir) -> Callable[[], Awaitable[None]]:
    """A preload module whose import blocks on a FIFO: the zygote stays 'importing' until the test opens
    the gate. The returned coroutine opens it (and first waits for the zygote to be blocked on it)."""
    gate = os.path.join(workdir, "gate")
    os.mkfifo(gate)
    (Path(workdir) / "gated.py").write_text(f"with open({gate!r}) as f:\n    f.read()\n")

    async def open_gate() -> None:
        def write() -> None:
            with open(gate, "w") as f:   # blocks until the zygote opens the FIFO to read it
                f.write("go")
        await asyncio.wait_for(asyncio.to_thread(write), LIMIT * 2)
    return open_gate


def importing_zygote(workdir: str, warnings: list[str]) -> WarmZygote:
    zygote = WarmZygote(sys.executable, ("json", "gated"), workdir, base_env(ENV), warnings.append)
    zygote.start()
    return zygote


async def test_a_round_waits_for_a_zygote_still_importing_and_starts_warm(workdir, gated_preload) -> None:
    """The first round no longer starts cold because the zygote was not ready yet (issue 22)."""
    zygote = importing_zygote(workdir, [])
    launches = [WorkerLaunch(local_rank=i, rank=i, argv=[sys.executable, "-u", "dump.py",
                                                         os.path.join(workdir, f"seen{i}.json"), "0"],
                             env=dict(ENV), log_dir=None) for i in range(2)]
    group = WorkerGroup(launches, stop_timeout=5, console=RecordingConsole(), warm=zygote, warm_wait_s=LIMIT * 4)
    try:
        assert zygote.coming and not zygote.ready
        starting = asyncio.create_task(group.start())
        await gated_preload()
        await asyncio.wait_for(starting, LIMIT * 2)
        assert len(group.warm_pids) == 2, "the round did not wait for the zygote"
        exits = await asyncio.wait_for(group.wait(), LIMIT)
        assert [e.exitcode for e in exits] == [0, 0]
    finally:
        await group.stop(signal.SIGKILL)
        await zygote.close()


async def test_a_stop_ends_the_wait_for_the_zygote_and_nothing_starts(workdir, gated_preload) -> None:
    zygote = importing_zygote(workdir, [])
    launch = WorkerLaunch(local_rank=0, rank=0, argv=[sys.executable, "-u", "dump.py",
                                                      os.path.join(workdir, "seen.json"), "0"], env=dict(ENV),
                          log_dir=None)
    group = WorkerGroup([launch], stop_timeout=5, console=RecordingConsole(), warm=zygote, warm_wait_s=LIMIT * 100)
    try:
        starting = asyncio.create_task(group.start())
        await asyncio.wait_for(group.stop(), LIMIT)        # while the zygote is still importing
        await asyncio.wait_for(starting, LIMIT)
        assert group.pids == [] and not await asyncio.to_thread(os.path.exists, os.path.join(workdir, "seen.json"))
    finally:
        await gated_preload()                              # let the zygote finish, then close it
        await zygote.close()


async def test_once_the_wait_for_a_zygote_still_importing_gave_up_the_round_starts_cold_at_once(
        workdir, gated_preload, monkeypatch) -> None:
    """A review: a preload importing past WARM_WAIT_S (60 s) made the node say ready and the first round start,
    but its workers then waited for the zygote up to WARM_WAIT_S more (docs: "after 60 s the round starts
    cold"), while the other nodes' workers were running. The round now starts cold at once."""
    monkeypatch.setattr(local, "WARM_WAIT_S", 0.05)       # the gate stays shut: this wait always gives up
    write(os.path.join(workdir, "train.py"), "import json\n")
    facts: asyncio.Queue[object] = asyncio.Queue()
    opts = WorkerSettings(script=os.path.join(workdir, "train.py"), node_id="n1", log_dir=workdir,
                          memory_dir_limit=0, warm_preload=("json", "gated"))
    workers = local.LocalWorkers(opts, facts.put_nowait, hostname="h")
    try:
        workers.warm_up()
        await asyncio.wait_for(workers.until_ready(), LIMIT)
        assert workers.ready and workers.warm is not None and workers.warm.coming
        await asyncio.wait_for(workers.spawn(Assignment(
            round_id=1, group_rank=0, group_world_size=1, rank_offset=0, world_size=1, local_world_size=1,
            master_addr="127.0.0.1", master_port=1, restart_count=0, max_restarts=0)), LIMIT)
        group = workers.group
        assert isinstance(group, WorkerGroup) and group.pids and not group.warm_pids, "the round waited again"
    finally:
        await gated_preload()                              # let the zygote finish, then close it
        await workers.close()


async def test_a_zygote_that_cannot_start_ends_the_wait_at_once(workdir) -> None:
    warnings: list[str] = []
    zygote = WarmZygote(os.path.join(workdir, "no-such-python"), ("json",), workdir, base_env(ENV), warnings.append)
    zygote.start()
    out = os.path.join(workdir, "seen.json")
    launch = WorkerLaunch(local_rank=0, rank=0, argv=[sys.executable, "-u", "dump.py", out, "0"], env=dict(ENV),
                          log_dir=None)
    group = WorkerGroup([launch], stop_timeout=5, console=RecordingConsole(), warm=zygote, warm_wait_s=LIMIT * 100)
    try:
        await asyncio.wait_for(group.start(), LIMIT)       # not the hundredfold wait: the zygote never comes
        assert group.pids and not group.warm_pids
        (exit_,) = await asyncio.wait_for(group.wait(), LIMIT)
        assert exit_.exitcode == 0 and await asyncio.to_thread(os.path.exists, out)
        assert len(warnings) == 1 and "cannot start" in warnings[0]
    finally:
        await group.stop(signal.SIGKILL)
        await zygote.close()


async def test_destroy_process_group_in_a_warm_worker_does_what_torchs_does_then_lets_gloo_finish(
        make_zygote, workdir) -> None:
    """The zygote's pause against torch's gloo teardown deadlock (zygote._let_gloo_threads_finish_at_destroy):
    the script sees torch's function, which still destroys the group; only warm workers get the pause."""
    pytest.importorskip("torch")
    zygote = await make_zygote(("torch", "torch.distributed"))
    (Path(workdir) / "destroy.py").write_text(DESTROY)
    cold = await run(["destroy.py"], None, workdir)
    warm = await run(["destroy.py"], zygote, workdir)
    assert warm.warm and warm.key() == cold.key() == (0, "")
    said = ["[w] before True", "[w] after False destroy_process_group"]
    assert cold.console.lines("stdout") == [*said, "[w] paused False"]
    assert warm.console.lines("stdout") == [*said, "[w] paused True"]


async def test_a_preload_that_computes_on_cpu_threads_as_it_loads_leaves_workers_that_compute(
        make_zygote, workdir, tmp_path) -> None:
    """A review: an installed package running a matmul as it is imported started OpenMP's pool in the zygote, whose
    threads a fork does not copy: the warm worker's first parallel matmul waited on them forever. The zygote holds
    torch to one CPU thread while it preloads; each worker gets the environment's number back, as a cold one has."""
    site, installed = installed_site(tmp_path)
    write(os.path.join(site, "ompinit.py"), "import torch\n(torch.randn(600, 600) @ torch.randn(600, 600)).sum()\n")
    write(os.path.join(workdir, "omp.py"), "import torch, ompinit\na = torch.randn(800, 800)\n(a @ a).sum()\n"
                                           "print(torch.get_num_threads(), flush=True)\n")
    env = {**installed, "OMP_NUM_THREADS": "2"}
    said: list[str] = []
    zygote = await make_zygote(("torch", "ompinit"), warnings=said, env=env)
    cold = await run(["omp.py"], None, workdir, extra_env=env)
    warm = await run(["omp.py"], zygote, workdir, extra_env=env)
    assert warm.warm and not said, said
    assert cold.key() == warm.key() == (0, "") and cold.console.lines("stdout") == warm.console.lines("stdout") \
        == ["[w] 2"], (cold.console.lines("stdout"), warm.console.lines("stdout"))


async def test_a_seed_a_preload_sets_as_it_loads_is_each_warm_workers_as_a_cold_ones(
        make_zygote, workdir, tmp_path) -> None:
    """A review: an installed package's `random.seed(1234)` at import was lost in warm workers (a fork reseeds
    `random`), so ranks that draw alike cold drew apart warm. Kept; an unseeded `random` still differs per worker."""
    site, installed = installed_site(tmp_path)
    write(os.path.join(site, "seedpkg.py"), "import random\nrandom.seed(1234)\n")
    write(os.path.join(workdir, "draw.py"), "import sys, random\nif sys.argv[1] == 'seeded':\n    import seedpkg\n"
                                            "print(random.random(), flush=True)\n")
    zygote = await make_zygote(("json", "seedpkg"), env=installed)
    cold = await run(["draw.py", "seeded"], None, workdir, extra_env=installed)
    warm = [await run(["draw.py", "seeded"], zygote, workdir, extra_env=installed) for _ in range(2)]
    assert all(w.warm for w in warm)
    assert [w.console.lines("stdout") for w in warm] == [cold.console.lines("stdout")] * 2, \
        (cold.console.lines("stdout"), [w.console.lines("stdout") for w in warm])
    plain = await make_zygote(("json",), env=installed)
    unseeded = [(await run(["draw.py", "unseeded"], plain, workdir, extra_env=installed)).console.lines("stdout")
                for _ in range(2)]
    assert unseeded[0] != unseeded[1], unseeded


async def test_a_file_beside_the_script_named_as_a_module_a_preload_imports_runs_only_in_the_worker(
        make_zygote, workdir) -> None:
    """A review: statistics.py beside the script (torch._dynamo imports `statistics`, a cold `import torch` does
    not) ran in the zygote, with no RANK, and the worker's `import statistics` got that copy; profile.py broke the
    dynamo preload. Preloads now resolve past the script's directory; the worker imports the user's file."""
    write(os.path.join(workdir, "statistics.py"), "import os\nRANK = os.environ.get('RANK')\n"
                                                  "print('own statistics', RANK, flush=True)\n")
    write(os.path.join(workdir, "stats.py"), "import torch, statistics\n"
                                             "print(statistics.RANK, hasattr(statistics, 'mean'), flush=True)\n")
    said: list[str] = []
    zygote = await make_zygote(DEFAULT_PRELOAD, warnings=said)
    cold = await run(["stats.py"], None, workdir)
    warm = await run(["stats.py"], zygote, workdir)
    assert warm.warm and not said, said
    assert cold.console.lines("stdout") == warm.console.lines("stdout") == ["[w] own statistics 3", "[w] 3 False"], \
        (cold.console.lines("stdout"), warm.console.lines("stdout"))


@pytest.mark.parametrize("sibling", ["code", "secrets"])
async def test_the_users_preloaded_module_gets_its_own_sibling_named_as_a_library_module(
        make_zygote, workdir, sibling) -> None:
    """A review: with the script's directory last while preloading, `--warm-preload torch,mymod` bound mymod's
    `import code` to the library's module (then forgotten, but mymod kept it), where torchrun gives the user's
    code.py. The user's own modules are forgotten with it, and the worker imports both from there."""
    write(os.path.join(workdir, f"{sibling}.py"), "WHICH = 'own'\n")
    write(os.path.join(workdir, "mymod.py"), f"import {sibling}\nWHICH = getattr({sibling}, 'WHICH', 'library')\n")
    write(os.path.join(workdir, "use.py"), "import torch, mymod\nprint(mymod.WHICH, flush=True)\n")
    said: list[str] = []
    zygote = await make_zygote((*DEFAULT_PRELOAD, "mymod"), warnings=said)
    cold = await run(["use.py"], None, workdir)
    warm = await run(["use.py"], zygote, workdir)
    assert warm.warm and not said, said
    assert cold.console.lines("stdout") == warm.console.lines("stdout") == ["[w] own"], \
        (cold.console.lines("stdout"), warm.console.lines("stdout"))


@pytest.mark.parametrize("name", ["sysconfig", "ctypes"])
async def test_a_file_beside_the_script_named_as_a_module_the_zygote_itself_imports_is_the_workers(
        make_zygote, workdir, name) -> None:
    """A review: sysconfig.py (or ctypes.py) beside the script, which `python script.py` imports, gave a warm
    worker the library's module: the zygote imports it for itself before the preloads, where only modules new
    to the preloads were forgotten. Every module past the interpreter's own start-up now is."""
    write(os.path.join(workdir, f"{name}.py"), "WHICH = 'own'\n")
    write(os.path.join(workdir, "use.py"), f"import json, {name}\nprint(getattr({name}, 'WHICH', 'library'))\n")
    said: list[str] = []
    zygote = await make_zygote(warnings=said)
    cold = await run(["use.py"], None, workdir)
    warm = await run(["use.py"], zygote, workdir)
    assert warm.warm and not said, said
    assert cold.console.lines("stdout") == warm.console.lines("stdout") == ["[w] own"], \
        (cold.console.lines("stdout"), warm.console.lines("stdout"))


async def test_a_signal_handler_a_preload_installs_as_it_loads_is_the_warm_workers_as_a_cold_ones(
        make_zygote, workdir) -> None:
    """A review: a package that installs a signal handler as it is imported (SIGUSR1, SIGTERM) had it in a cold
    worker, whose import runs it, but a warm worker's handlers were put back as Python's start-up left them: the
    import ran in the zygote only, and the worker lost the handler unsaid. The worker keeps what its preloads did."""
    write(os.path.join(workdir, "sigmod.py"), "import signal\ndef on_usr1(s, f):\n    pass\n"
                                              "signal.signal(signal.SIGUSR1, on_usr1)\n")
    write(os.path.join(workdir, "use.py"), "import json, signal, sigmod\n"
                                           "print(getattr(signal.getsignal(signal.SIGUSR1), '__name__', None))\n")
    said: list[str] = []
    zygote = await make_zygote(("json", "sigmod"), warnings=said)
    cold = await run(["use.py"], None, workdir)
    warm = await run(["use.py"], zygote, workdir)
    assert warm.warm and not said, said
    assert cold.console.lines("stdout") == warm.console.lines("stdout") == ["[w] on_usr1"], \
        (cold.console.lines("stdout"), warm.console.lines("stdout"))


async def test_a_script_path_with_dot_dot_through_a_link_runs_the_file_a_cold_worker_runs(make_zygote, workdir) -> None:
    """A review: a warm worker normalised the script's path (os.path.abspath) where `python` only joins it to the
    working directory: `__file__` differed (sub/../use.py), and where `sub` is a link to another directory the
    warm worker ran another file than the kernel resolves, the one a cold worker runs."""
    os.makedirs(os.path.join(workdir, "other", "inner"))
    os.symlink(os.path.join(workdir, "other", "inner"), os.path.join(workdir, "sub"))
    for where, which in ((workdir, "top"), (os.path.join(workdir, "other"), "other")):
        write(os.path.join(where, "use.py"), f"import json\nprint({which!r})\nprint(__file__)\n")
    zygote = await make_zygote()
    cold = await run([os.path.join("sub", "..", "use.py")], None, workdir)
    warm = await run([os.path.join("sub", "..", "use.py")], zygote, workdir)
    assert warm.warm
    expected = ["[w] other", f"[w] {os.path.join(workdir, 'sub', '..', 'use.py')}"]
    assert cold.console.lines("stdout") == warm.console.lines("stdout") == expected, \
        (cold.console.lines("stdout"), warm.console.lines("stdout"))


async def test_a_variable_a_preload_sets_as_it_loads_is_in_the_warm_workers_environment_as_a_cold_ones(
        make_zygote, workdir) -> None:
    """A review: lightning.fabric sets PYTORCH_NVML_BASED_CUDA_CHECK=1 as it is imported; a cold worker's import
    leaves it in the worker's environment, but a warm worker's environment was replaced by the launch's, and the
    variables its preloads set were gone. They are kept now, the worker's own (its rank) still the worker's."""
    write(os.path.join(workdir, "envmod.py"), "import os\nos.environ['SET_AT_IMPORT'] = '1'\n"
                                              "os.environ.setdefault('RANK', '0')\nos.environ.pop('GONE', None)\n")
    write(os.path.join(workdir, "use.py"), "import json, os, envmod\n"
                                           "print(os.getenv('SET_AT_IMPORT'), os.getenv('RANK'), os.getenv('GONE'))\n")
    zygote = await make_zygote(("json", "envmod"), env={"GONE": "x"})
    cold = await run(["use.py"], None, workdir, extra_env={"GONE": "x"})
    warm = await run(["use.py"], zygote, workdir, extra_env={"GONE": "x"})
    assert warm.warm
    assert cold.console.lines("stdout") == warm.console.lines("stdout") == ["[w] 1 3 None"], \
        (cold.console.lines("stdout"), warm.console.lines("stdout"))


def installed_copy(package: str, site: str) -> str:
    """A copy of an installed package (and its bundled libraries) in `site`."""
    installed = os.path.dirname(os.path.dirname(importlib.import_module(package).__file__ or ""))
    for name in (package, f"{package}.libs"):
        if os.path.isdir(os.path.join(installed, name)):
            shutil.copytree(os.path.join(installed, name), os.path.join(site, name))
    return site


async def test_a_library_in_a_venv_inside_the_scripts_directory_is_not_taken_for_the_users_own(
        make_zygote, workdir) -> None:
    """A review: with the user's own modules forgotten beside a shadowed one, everything under the script's
    directory counted as the user's: numpy from a project's .venv was forgotten too, and the warm worker's import
    of it failed ("cannot load module more than once per process")."""
    site = installed_copy("numpy", os.path.join(workdir, ".venv", "site"))
    write(os.path.join(workdir, "code.py"), "WHICH = 'own'\n")
    write(os.path.join(workdir, "use.py"), f"import numpy, code\nprint(numpy.__file__.startswith({site!r}), "
                                           f"code.WHICH, flush=True)\n")
    env = {"PYTHONPATH": site}
    said: list[str] = []
    zygote = await make_zygote(("numpy", "code"), warnings=said, env=env)
    cold = await run(["use.py"], None, workdir, extra_env=env)
    warm = await run(["use.py"], zygote, workdir, extra_env=env)
    assert warm.warm and not said, said
    assert cold.console.lines("stdout") == warm.console.lines("stdout") == ["[w] True own"], \
        (cold.console.lines("stdout"), warm.console.lines("stderr")[-5:])
