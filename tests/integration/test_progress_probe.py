"""The progress probe in real workers, cold and warm: it counts `torch.optim` steps and `beat()` with no change
to the script, leaves the worker's environment and path as the user set them, runs the user's own
sitecustomize, and answers for stacks on its signal while the main thread is busy elsewhere."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from node_agent.core.stalls import main_stack
from node_agent.core.steps import ProbeRecord
from node_agent.training import probe
from node_agent.workers.group import WorkerGroup
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.probes import ProbeFiles, RecordReader, take_stacks
from node_agent.workers.warm.client import WarmZygote
from node_agent.workers.warm.eligible import base_env
from tests.integration.worker_support import LIMIT, RecordingConsole

Started = tuple[WorkerGroup, ProbeFiles, RecordingConsole]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
ROOT = str(Path(__file__).resolve().parents[2])

HEAD = """import os, sys, time
print("env", os.environ.get("NODE_AGENT_PROGRESS"), "boot", any(p.endswith("boot") for p in sys.path),
      "pythonpath", os.environ.get("PYTHONPATH"), flush=True)
"""
TAIL = """
def waiting_for_the_test():
    with open("ready", "w"):     # inside: a stack taken once it exists shows this function
        pass
    time.sleep(600)
waiting_for_the_test()
"""
TORCH = "import torch\nopt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)\n" \
        "for _ in range(5):\n    opt.step()"
BEATS = "from node_agent.training.heartbeat import beat\nfor _ in range(3):\n    beat()"


def script(workdir: Path, steps: str) -> str:
    path = workdir / "train.py"
    path.write_text(HEAD + steps + TAIL)
    return str(path)


@pytest.fixture
async def run_group(tmp_path, monkeypatch) -> AsyncIterator[Callable[..., Awaitable[Started]]]:
    monkeypatch.chdir(tmp_path)
    groups: list[WorkerGroup] = []
    zygotes: list[WarmZygote] = []

    async def run(steps: str, *, warm: tuple[str, ...] | None = None, env: dict[str, str] | None = None) -> Started:
        files = ProbeFiles.in_dir(str(tmp_path), 0)
        files.create()
        worker_env = {**ENV, "PYTHONPATH": ROOT, **(env or {}), probe.ENV: files.env()}
        path = script(tmp_path, steps)
        zygote = None
        if warm is not None:
            zygote = WarmZygote(sys.executable, warm, str(tmp_path), base_env({k: v for k, v in worker_env.items()
                                                                              if k != probe.ENV}), print)
            zygotes.append(zygote)
            zygote.start()
            assert await zygote.wait_ready(LIMIT * 3), "the zygote never became ready"
        launch = WorkerLaunch(local_rank=0, rank=0, argv=[sys.executable, "-u", path], env=worker_env, log_dir=None,
                              prefix="[w] ", prefix_all=True, probe=files)
        console = RecordingConsole()
        group = WorkerGroup([launch], stop_timeout=5, console=console, warm=zygote)
        groups.append(group)
        await group.start()
        assert bool(group.warm_pids) == (warm is not None)
        await until(lambda: (tmp_path / "ready").exists(),
                    what=lambda: f"the worker's steps; its output: {console.lines('stdout')[-20:]} "
                                 f"{console.lines('stderr')[-20:]}")
        return group, files, console

    yield run
    for group in groups:
        await group.stop(signal.SIGKILL)
    for zygote in zygotes:
        await zygote.close()


async def until(check: Callable[[], bool], *, what: str | Callable[[], str]) -> None:
    """Wait for a condition a worker process makes true (its files), up to LIMIT * 3."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LIMIT * 3
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what if isinstance(what, str) else what()}"
        await asyncio.sleep(0.02)


def written(path: str) -> str:
    with open(path) as f:
        return f.read()


def record_of(files: ProbeFiles, pid: int) -> ProbeRecord:
    reader = RecordReader(files.record)
    try:
        record = reader.read(pid, 4e9)
    finally:
        reader.close()
    assert record is not None, "the probe never wrote its record"
    return record


@pytest.mark.parametrize("warm", [None, ("json",)], ids=["cold", "warm"])
async def test_beats_are_counted_and_the_probe_leaves_the_environment_as_it_was(run_group, warm) -> None:
    group, files, console = await run_group(BEATS, warm=warm, env={"PYTHONPATH": ROOT})
    pid = group.pids[0]
    record = record_of(files, pid)
    assert (record.steps, record.pid, record.flags & probe.BEATEN) == (3, pid, probe.BEATEN)
    assert record.first_at <= record.last_at
    assert f"[w] env None boot False pythonpath {ROOT}" in console.lines("stdout"), console.lines("stdout")


@pytest.mark.parametrize("warm", [None, ("json",)], ids=["cold", "warm"])
async def test_an_empty_entry_of_the_users_pythonpath_is_left_to_the_workers_children(run_group, warm) -> None:
    # `export PYTHONPATH=$PYTHONPATH:/lib` with none set gives ":/lib": its empty entry puts the current directory on
    # the path of every interpreter started so, the worker's own children too (a subprocess.run of python)
    path = f"{os.pathsep}{ROOT}"
    group, files, console = await run_group(BEATS, warm=warm, env={"PYTHONPATH": path})
    assert record_of(files, group.pids[0]).steps == 3
    assert f"[w] env None boot False pythonpath {path}" in console.lines("stdout"), console.lines("stdout")


@pytest.mark.parametrize("warm", [None, ("torch",)], ids=["cold", "warm-torch"])
async def test_optimizer_steps_are_counted_with_no_change_to_the_script(run_group, warm) -> None:
    group, files, _ = await run_group(TORCH, warm=warm)
    record = record_of(files, group.pids[0])
    assert (record.steps, record.flags & probe.HOOKED) == (5, probe.HOOKED)


# A one-rank gloo group and a protect() restore from a memory directory the test made: the worker notes when each
# began and ended (the restart's anatomy, node_agent/core/anatomy.py).
MILESTONES = """import torch, torch.distributed as dist, tempfile, os
from node_agent.training import protect
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)
os.environ["NODE_AGENT_MEMORY_DIR"] = tempfile.mkdtemp()
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
from node_agent.training.capture import Capture
from node_agent.training.protection import training_state
capture = Capture(os.environ["NODE_AGENT_MEMORY_DIR"])
capture.take(3, {"state": training_state(model, opt, {}), "rng": {}})    # a predecessor's snapshot
capture.wait()
ddp = torch.nn.parallel.DistributedDataParallel(model)
assert protect(ddp, opt, every=1) == 3
ddp(torch.ones(1, 2)).sum().backward()
opt.step()
ddp(torch.ones(1, 2))                   # the snapshot of step 4 is taken as the next step begins
import threading
for t in threading.enumerate():
    if t.name.startswith("node-agent snapshot"):
        t.join()
from node_agent.training import layout
sums = [layout.digest(p.detach()) for p in model.parameters()]
open("digest", "w").write(str(layout.digest_of(sums)))
"""


@pytest.mark.parametrize("warm", [None, ("torch",)], ids=["cold", "warm-torch"])
async def test_the_worker_notes_when_its_process_group_and_restore_began_and_ended(run_group, warm) -> None:
    group, files, _ = await run_group(MILESTONES, warm=warm)
    record = record_of(files, group.pids[0])
    m = record.milestones
    assert set(m) == {"started", "group_begun", "group_done", "restore_begun", "restore_done"}, m
    assert m["started"] <= m["group_begun"] <= m["group_done"] <= m["restore_begun"] <= m["restore_done"]
    assert m["restore_done"] <= record.first_at and record.steps == 1
    assert not record.on_device                                 # gloo: the collectives run on the host
    assert record.digests == ((4, int(written("digest"))),)     # DDP's parameters' digest, with its step


# A one-rank group whose backend is named as a GPU job's default group is ("cpu:gloo,cuda:nccl": this CPU build of
# torch has no NCCL, so the name is all that differs): the probe flags that its collectives run on the GPU.
NAMED_NCCL = """import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
real = c10d.get_backend
c10d.get_backend = lambda group=None: "cpu:gloo,cuda:nccl" if group is None else real(group)
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)
from node_agent.training.heartbeat import beat
beat()
"""


@pytest.mark.parametrize("warm", [None, ("torch",)], ids=["cold", "warm-torch"])
async def test_a_process_group_on_nccl_flags_the_collectives_as_on_the_gpu(run_group, warm) -> None:
    group, files, _ = await run_group(NAMED_NCCL, warm=warm)
    record = record_of(files, group.pids[0])
    assert record.steps == 1 and record.on_device and record.flags & probe.ON_DEVICE


# Steps of ~50 ms: 30 of them blocked inside backward (a wait on the others, as DDP's all-reduce is), 20 outside
# (the rank's own work: a sleep, as slow storage would be), then one step of 2 s (solo work: no pace).
PACED = """import torch
class Waits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x
    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.03)
        return grad
param = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([param], lr=0.1)
for step in range(10):
    time.sleep(2.0 if step == 8 else 0.02)
    Waits.apply(param).sum().backward()
    opt.step()
"""


@pytest.mark.parametrize("warm", [None, ("torch",)], ids=["cold", "warm-torch"])
async def test_the_time_blocked_in_backward_is_the_steps_wait_and_a_long_step_is_left_out(run_group, warm) -> None:
    group, files, _ = await run_group(PACED, warm=warm)
    record = record_of(files, group.pids[0])
    counted, took, waited = record.pace
    assert record.waits_measured and record.steps == 10
    assert 1 <= counted <= 8 and took < 2.0, record.pace  # 9 intervals, the one holding the 2 s sleep left out
    # The sleep in backward (30 ms a step) is waited, the one outside (20 ms) is not: bounds each sleep's minimum
    # gives, whatever else a loaded host adds to a step (a ratio of the two moved with the load)
    assert waited >= 0.025 * counted, record.pace
    assert took - waited >= 0.015 * counted, record.pace


async def test_stacks_come_on_the_signal_while_the_main_thread_sleeps(run_group) -> None:
    group, files, _ = await run_group(BEATS)
    pid = group.pids[0]
    record = record_of(files, pid)
    assert record.flags & probe.STACKS
    dumps = await take_stacks({0: (pid, files.stacks)})
    frames = main_stack(dumps[0], record.main_thread)
    assert frames is not None and [f.function for f in frames[:2]] == ["waiting_for_the_test", "<module>"], dumps
    assert frames[0].file.endswith("train.py")
    assert group.exits() == []          # the signal only asked: the worker runs on


async def test_the_users_own_sitecustomize_still_runs(run_group, tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    code = "print('user site', os.environ.get('USER_SITE_RAN'), flush=True)\n" + BEATS
    group, files, console = await run_group(code, env={"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    assert "[w] user site yes" in console.lines("stdout"), console.lines("stdout")
    assert record_of(files, group.pids[0]).steps == 3
