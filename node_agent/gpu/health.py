"""Is this node's GPU healthy: the verdict on a reader's facts, the site's `--health-check CMD`, and whether a
worker's failure message names a GPU fault. `judge` is pure; `check_gpus` blocks on NVML (run it in a thread).
Nothing here raises for what the GPUs, NVML or the command do: every outcome is a verdict with a one-line why.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from node_agent.gpu.nvml import RECOVERY_ACTIONS, THROTTLE_WARNINGS, GpuHealth, GpuReader, NvmlUnavailable
from protocol.quoting import one_line, quote

SCRIPT_TIMEOUT_S = 30.0
OUTPUT_LIMIT = 64 * 1024          # bytes of a command's output kept
REAP_TIMEOUT_S = 5.0              # after SIGKILL: a child in uninterruptible sleep is left behind
PIPE_GRACE_S = 1.0                # after the command exits: its children may hold the output open
MAX_CHECK_THREADS = 16            # GPUs asked at once


@dataclass(frozen=True)
class Healthy:
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0


@dataclass(frozen=True)
class Unhealthy:
    reason: str                       # one line
    warnings: tuple[str, ...] = ()
    output: str = ""                  # a command's output, bounded and escaped onto one line
    seconds: float = 0.0


@dataclass(frozen=True)
class Skipped:
    reason: str                       # one line: why nothing was checked
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0


Verdict = Healthy | Unhealthy | Skipped


def _name(h: GpuHealth) -> str:
    return f"GPU {h.index}" + (f" ({h.bus_id})" if h.bus_id else "")


def faults(h: GpuHealth) -> list[str]:
    """What makes this GPU unhealthy, one short phrase each; unknown facts count for nothing."""
    ecc = h.uncorrectable_ecc
    action = RECOVERY_ACTIONS.get(h.recovery_action or 0, f"action {h.recovery_action}")
    return [phrase for fault, phrase in (
        (h.lost is not None, f"NVML: {h.lost}"),
        (h.recovery_action not in (None, 0), f"the driver asks for recovery: {action}"),
        (h.reset_required, "a GPU reset is pending"),
        (h.drain_and_reset, "the driver recommends drain and reset"),
        (ecc, f"{ecc} volatile uncorrectable ECC error{'s' if ecc and ecc > 1 else ''}"),
        (h.remap_failed, "row remapping failed"),
        (h.remap_pending, "row remapping pending (needs a GPU reset)"),
        (h.retired_pages_pending, "retired pages pending (needs a GPU reset)"),
    ) if fault]


def warnings(h: GpuHealth) -> list[str]:
    """What is worth a log line but not an eviction: clock throttling, NVML errors on single queries."""
    slow = [text for bit, text in THROTTLE_WARNINGS.items() if (h.throttle_reasons or 0) & bit]
    out = [f"{_name(h)}: clocks throttled: {', '.join(slow)}"] if slow else []
    out.extend(f"{_name(h)}: NVML error: {e}" for e in h.errors)
    if h.unchecked is not None:
        out.append(f"{_name(h)} not checked: {h.unchecked}")
    return out


def judge(found: Sequence[GpuHealth]) -> Verdict:
    """Unhealthy when any GPU has a fault (all named, one line); Skipped when no GPU could be checked; else
    Healthy. Warnings either way (a GPU left unchecked while others were is one)."""
    notes = tuple(w for h in found for w in warnings(h))
    bad = [f"{_name(h)}: {'; '.join(fs)}" for h in found if (fs := faults(h))]
    if bad:
        return Unhealthy(reason=one_line(" | ".join(bad)), warnings=notes)
    if found and all(h.unchecked is not None for h in found):
        return Skipped(reason=one_line(" | ".join(f"{_name(h)} not checked: {h.unchecked}" for h in found)),
                       warnings=notes)
    return Healthy(warnings=notes)


def check_gpus(reader: GpuReader, indices: Sequence[int]) -> Verdict:
    """Ask the open `reader` about `indices`, a thread per GPU (NVML is thread-safe; one GPU after another
    would overrun the check's 0.1 s budget), and judge, timed. Skipped, never Healthy, when the reader fails."""
    start = time.monotonic()
    try:
        if not indices:
            verdict: Verdict = Skipped("no GPU to check")
        else:
            with ThreadPoolExecutor(max_workers=min(len(indices), MAX_CHECK_THREADS),
                                    thread_name_prefix="gpu-check") as pool:
                verdict = judge(list(pool.map(reader.health, indices)))
    except NvmlUnavailable as exc:
        verdict = Skipped(one_line(str(exc)))
    except Exception as exc:           # a bug in the bindings must not take the node out
        verdict = Skipped(one_line(f"GPU check failed: {type(exc).__name__}: {exc}"))
    return replace(verdict, seconds=time.monotonic() - start)


async def run_health_check(command: str | Sequence[str], *, timeout: float = SCRIPT_TIMEOUT_S,
                           output_limit: int = OUTPUT_LIMIT, env: dict[str, str] | None = None) -> Verdict:
    """Run the site's check (split like a shell would, not run by one): exit 0 is Healthy; anything else, or
    past `timeout`, Unhealthy quoting its output's first line. Output (stdout and stderr) is kept to
    `output_limit` bytes; the check's whole process group is killed at the deadline."""
    start = time.monotonic()
    try:
        argv = shlex.split(command) if isinstance(command, str) else list(command)
    except ValueError as exc:
        return Unhealthy(f"--health-check {quote(command)} cannot be parsed: {exc}")
    if not argv:
        return Unhealthy("--health-check is empty")
    shown = quote(argv[0])
    # A pipe of our own, not asyncio's: its Process.wait() also waits for the pipes, which a child may hold.
    rfd, wfd = os.pipe()
    try:
        proc = await _start_in_own_group(argv, env, rfd, wfd)
    except OSError as exc:
        return Unhealthy(_not_started(shown, exc))
    stream = asyncio.StreamReader()
    try:
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(rfd, "rb", buffering=0))
    except BaseException:
        _kill_group(proc.pid)
        raise
    kept = bytearray()
    total = 0

    async def drain() -> None:
        nonlocal total
        while chunk := await stream.read(65536):
            total += len(chunk)
            if len(kept) < output_limit:
                kept.extend(chunk[:output_limit - len(kept)])

    reader = asyncio.ensure_future(drain())
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout)
        timed_out = proc.returncode is None
        if not timed_out:       # exited: the rest of its output is in the pipe, or a child of its holds it
            left = timeout - (time.monotonic() - start)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), max(0.0, min(PIPE_GRACE_S, left)))
    finally:                    # also when the caller cancels us: nothing of the check outlives it
        if proc.returncode is None or not reader.done():
            _kill_group(proc.pid)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        transport.close()
    if proc.returncode is None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), REAP_TIMEOUT_S)
    elapsed = time.monotonic() - start
    text = bytes(kept).decode(errors="replace")
    output = one_line(text) + (f" ... (output cut at {len(kept)} of {total} bytes)" if total > len(kept) else "")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    said = f": {quote(first)}" if first else " (no output)"
    if timed_out:
        return Unhealthy(f"health check {shown} did not finish within {timeout:g} s{said}", output=output,
                         seconds=elapsed)
    code = proc.returncode
    if code == 0:
        return Healthy(seconds=elapsed)
    how = f"was killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exited with status {code}"
    return Unhealthy(f"health check {shown} {how}{said}", output=output, seconds=elapsed)


def _not_started(shown: str, exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"health check {shown} not found"
    if isinstance(exc, PermissionError):
        return f"health check {shown} is not executable (permission denied)"
    return f"health check {shown} cannot be started: {one_line(exc.strerror or str(exc))}"


async def _start_in_own_group(argv: list[str], env: dict[str, str] | None, rfd: int,
                              wfd: int) -> asyncio.subprocess.Process:
    """Start the check in a session of its own writing to `wfd` (closed here, as is `rfd` on failure)."""
    spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=wfd, stderr=wfd, start_new_session=True, env=env))
    try:
        # Shielded: a start cancelled midway kills the check but not its children; let it end, then kill the group.
        proc = await asyncio.shield(spawn)
    except asyncio.CancelledError:
        os.close(rfd)
        with contextlib.suppress(BaseException):    # starting takes a moment: end it before we return
            await asyncio.shield(spawn)
        if spawn.done():
            _end_cancelled_start(spawn, wfd)
        else:                                       # cancelled once more while it started
            spawn.add_done_callback(lambda started: _end_cancelled_start(started, wfd))
        raise
    except OSError:
        os.close(rfd)
        os.close(wfd)
        raise
    os.close(wfd)
    return proc


def _end_cancelled_start(spawn: asyncio.Future[asyncio.subprocess.Process], wfd: int) -> None:
    os.close(wfd)
    if not spawn.cancelled() and spawn.exception() is None:
        _kill_group(spawn.result().pid)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# Worker failure messages that name a broken GPU. NVIDIA's Xids: 48 double-bit ECC, 63/64 row remapping or page
# retirement, 74 NVLink, 79 off the bus, 92/94/95 ECC rate, contained, uncontained, 119/120 GSP, 140 unrecovered ECC.
_HARDWARE_XIDS = {48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140}
_FAULTS = (
    (re.compile(r"uncorrectable\s+ECC\s+error", re.I), "uncorrectable ECC error"),
    (re.compile(r"uncorrectable\s+NVLink\s+error", re.I), "uncorrectable NVLink error"),
    (re.compile(r"fallen\s+off\s+the\s+bus", re.I), "GPU has fallen off the bus"),
    (re.compile(r"GPU\s+is\s+lost", re.I), "GPU is lost"),
    (re.compile(r"GPU\s+requires\s+(?:a\s+)?reset", re.I), "GPU requires reset"),
)
# "NVRM: Xid (PCI:0000:3b:00): 79, pid=...", "Xid 79", "XID: 79"
_XID = re.compile(r"\bXid\b\s*(?:\(PCI:[0-9a-f:.]+\))?\s*:?\s*(\d{1,3})\b", re.I)
SCAN_LIMIT = 1 << 20


def classify_failure(message: str) -> str | None:
    """The GPU fault a worker's failure message names, as a short phrase, or None when it names none.
    A device-side assert or an illegal memory access is the program's bug, not the GPU's: None."""
    text = message if len(message) <= SCAN_LIMIT else message[:SCAN_LIMIT // 2] + message[-SCAN_LIMIT // 2:]
    for pattern, phrase in _FAULTS:
        if pattern.search(text):
            return phrase
    for m in _XID.finditer(text):
        if int(m.group(1)) in _HARDWARE_XIDS:
            return f"Xid {int(m.group(1))}"
    return None
