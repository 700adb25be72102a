"""What a rank that stopped stepping is doing, from what the agent can see of it: its process state and its main
thread's CPU time and I/O (/proc), its main thread's Python stack at several looks (the probe's faulthandler
dump) and its GPU's utilization. Pure: the agent's shell reads, this decides. The server weighs every node's
answer (core/hangs.py).

The rule, in order: gone -> EXITED; stopped, and not run since the last look -> STOPPED; busy in its own code
with the same stack at every look and no I/O -> SPINNING; idle in a CUDA wait while its GPU is busy -> WORKING (it
computes on the GPU); idle in torch's collectives, its backward or a CUDA wait -> WAITING; idle anywhere else ->
QUIET, unless it is in uninterruptible sleep, moving data or waiting for its DataLoader (WORKING); no stack to tell
-> UNKNOWN.
Anything busy otherwise is WORKING: an eval loop, a checkpoint write, data loading. A waiting rank's `call`
names the torch call it waits in, so the server can tell which rank of a deadlock called something else.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from protocol.stalls import GPU_BUSY, RankState

IDLE_CPU = 0.1          # a main thread below this share of one CPU is blocked, not computing
BUSY_CPU = 0.5          # at or above it, a main thread is running code
MOVING_BYTES = 1 << 20  # read or written while watched: the rank is moving data (a checkpoint, a download)
# Where a blocked main thread waits on the other ranks (paths as faulthandler prints them).
WAIT_PATHS = ("/torch/distributed/", "/torch/nn/parallel/distributed.py", "/torch/autograd/", "/torch/_tensor.py",
              "/torch/cuda/")
COLLECTIVE_PATHS = ("/torch/distributed/",)   # a wait on the other ranks for certain (not on this rank's GPU)
LOADING_PATHS = ("/torch/utils/data/",)      # a main thread waiting for its DataLoader's workers
# torch's decorators around its collectives: the call is the function they wrap, one frame in
WRAPPERS = frozenset({"wrapper", "inner", "_fn", "decorate_context", "_wrapped", "wrapped"})
LIBRARY_PATHS = ("/torch/", "/site-packages/", "/dist-packages/")   # code that is not the script's own
STDLIB_PATHS = ("/lib/python3", "<frozen ")     # nor is Python's (a wait of torch's in threading, say)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class ProcSample:
    """One look at a worker in /proc (its main thread; `io_bytes` and `process_cpu_s`: the whole process)."""
    state: str            # R, S, D, T, t, Z, X ... ("" once it is gone)
    cpu_s: float          # main thread's user + system time
    run_delay_s: float    # main thread's time runnable but waiting for a CPU
    io_bytes: int         # read + written, files and sockets
    process_cpu_s: float = 0.0   # every thread's user + system time (a collective's copies run in torch's threads)


_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def parse_dump(text: str) -> dict[int, list[Frame]]:
    """faulthandler's dump of every thread: thread id -> its frames, innermost first. Lines of other forms
    (a truncated dump, "<no Python frame>") are skipped: the text is the worker's, not ours."""
    threads: dict[int, list[Frame]] = {}
    frames: list[Frame] | None = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            frames = threads.setdefault(int(head.group(1), 16), [])
            continue
        frame = _FRAME.match(line)
        if frame and frames is not None:
            frames.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    return threads


def main_stack(text: str, main_thread: int) -> list[Frame] | None:
    """The main thread's frames in a dump (the first thread's where the main one is missing); None: no dump."""
    threads = parse_dump(text)
    if not threads:
        return None
    return threads.get(main_thread) or next(iter(threads.values()))


def _in(frames: list[Frame], paths: tuple[str, ...]) -> bool:
    return any(p in f.file for f in frames for p in paths)


def _waits(frames: list[Frame]) -> bool:
    """Whether a blocked main thread waits in torch (WAIT_PATHS) rather than in the script's own code: the frames
    inside the innermost of its own. Those around it are its callers: Lightning runs a step inside DDP's forward,
    and a rank idle in its own step (a sleep, a call to a service) waits on nothing of the others'."""
    inner = itertools.takewhile(lambda f: _in([f], LIBRARY_PATHS + STDLIB_PATHS), frames)
    return _in(list(inner), WAIT_PATHS)


def classify(before: ProcSample | None, after: ProcSample | None, watched_s: float,
             stacks: list[list[Frame]], gpu_busy: int | None = None) -> tuple[RankState, float]:
    """The rank's state and its main thread's CPU share over the `watched_s` between two looks, given the main
    thread's stacks taken meanwhile (none where the probe did not answer) and its GPU's utilization meanwhile
    (None: no GPU, or not read). `after` None: the process is gone."""
    if after is None or after.state in ("", "Z", "X"):
        return RankState.EXITED, 0.0
    cpu = busy = 0.0     # the share it ran; and ran or waited for a CPU (a busy thread on a crowded node)
    if before is not None and watched_s > 0:
        ran = after.cpu_s - before.cpu_s
        cpu = min(1.0, max(0.0, ran / watched_s))
        busy = min(1.0, max(0.0, (ran + after.run_delay_s - before.run_delay_s) / watched_s))
    if after.state in ("T", "t") and (before is None or after.cpu_s <= before.cpu_s):
        return RankState.STOPPED, cpu
    # Stopped now but it ran meanwhile: stopped and continued in turn (cpulimit's throttling, a debugger's
    # steps), slow rather than stopped for good: never a certain culprit, at most a rank apart.
    moved = before is not None and after.io_bytes - before.io_bytes >= MOVING_BYTES
    if not stacks:
        return (RankState.UNKNOWN if busy < IDLE_CPU and after.state != "D" and not moved else RankState.WORKING), cpu
    # A culprit stays in one place over every dump; a rank between phases (a checkpoint ending, a collective
    # entered) is working, not a culprit, and not yet waiting.
    same = len(stacks) > 1 and all(s == stacks[0] for s in stacks[1:])
    if busy >= BUSY_CPU:
        own = not _in(stacks[-1][:1], LIBRARY_PATHS)
        return (RankState.SPINNING if _one_loop(stacks) and own and not moved else RankState.WORKING), cpu
    if busy < IDLE_CPU and all(_waits(s) for s in stacks):
        computing = gpu_busy is not None and gpu_busy >= GPU_BUSY and not _in(stacks[-1], COLLECTIVE_PATHS)
        return (RankState.WORKING if computing else RankState.WAITING), cpu
    if busy < IDLE_CPU and same and not moved and after.state != "D" and not _in(stacks[-1], LOADING_PATHS):
        return RankState.QUIET, cpu
    return RankState.WORKING, cpu


def call_of(frames: list[Frame]) -> str:
    """The torch call a waiting main thread waits in: the innermost torch.distributed function that is not one of
    torch's wrappers ("barrier", "recv", "all_reduce"), else "backward" (DDP's reducer), else a CUDA wait, else
    the innermost torch function; "" outside torch."""
    collective = [f for f in frames if _in([f], COLLECTIVE_PATHS) and f.function not in WRAPPERS
                  and not f.function.startswith("<")]
    if collective:
        return collective[0].function
    if _in(frames, ("/torch/autograd/", "/torch/_tensor.py")):
        return "backward"
    cuda = [f for f in frames if _in([f], ("/torch/cuda/",))]
    if cuda:
        return f"cuda {cuda[0].function}"
    in_torch = [f for f in frames if _in([f], ("/torch/",)) and f.function not in WRAPPERS]
    return in_torch[0].function if in_torch else ""


def _one_loop(stacks: list[list[Frame]]) -> bool:
    """The same frames in every dump, but for the innermost one's line: a loop moves between its lines."""
    first = stacks[0]
    return len(stacks) > 1 and bool(first) and all(
        len(s) == len(first) and s[1:] == first[1:] and (s[0].file, s[0].function) == (first[0].file, first[0].function)
        for s in stacks[1:])


def stack_text(frames: list[Frame], limit: int) -> str:
    """The frames innermost first, one per line, cut to `limit` characters."""
    return "\n".join(map(str, frames))[:limit]
