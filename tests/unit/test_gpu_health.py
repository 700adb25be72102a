"""GPU health (node_agent/gpu/health.py, nvml.py): every fault the reader can report and its verdict, the
NVML reader's handling of every NVML error (against a stand-in for pynvml), the --health-check runner's bad
inputs, and which worker failure messages name a GPU fault."""
from __future__ import annotations

import asyncio
import os
import stat
import sys
import time
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from node_agent.gpu.health import (
    OUTPUT_LIMIT,
    Healthy,
    Skipped,
    Unhealthy,
    check_gpus,
    classify_failure,
    judge,
    run_health_check,
)
from node_agent.gpu.nvml import GpuHealth, NvmlReader, NvmlUnavailable
from protocol.quoting import quote
from tests.gpu_fakes import FakeGpuReader, healthy

OK = healthy(3, "0000:3b:00.0")

FAULTS = [
    (replace(OK, lost="GPU is lost"), "NVML: GPU is lost"),
    (replace(OK, recovery_action=1), "the driver asks for recovery: GPU reset"),
    (replace(OK, recovery_action=2), "the driver asks for recovery: node reboot"),
    (replace(OK, recovery_action=4), "the driver asks for recovery: drain and reset"),
    (replace(OK, recovery_action=42), "the driver asks for recovery: action 42"),
    (replace(OK, reset_required=True), "a GPU reset is pending"),
    (replace(OK, drain_and_reset=True), "the driver recommends drain and reset"),
    (replace(OK, uncorrectable_ecc=2), "2 volatile uncorrectable ECC errors"),
    (replace(OK, remap_failed=True), "row remapping failed"),
    (replace(OK, remap_pending=True), "row remapping pending"),
    (replace(OK, retired_pages_pending=True), "retired pages pending"),
]


@pytest.mark.parametrize(("facts", "phrase"), FAULTS)
def test_each_fault_makes_the_node_unhealthy_naming_the_gpu(facts, phrase):
    verdict = judge([healthy(0, "0000:1b:00.0"), facts])
    assert isinstance(verdict, Unhealthy)
    assert verdict.reason == f"GPU 3 (0000:3b:00.0): {phrase}" or verdict.reason.startswith(
        f"GPU 3 (0000:3b:00.0): {phrase}")


def test_a_gpu_with_nothing_wrong_or_nothing_supported_is_healthy():
    assert judge([OK]) == Healthy()
    assert judge([GpuHealth(index=0)]) == Healthy()           # "not supported" everywhere: unknown, not bad


def test_several_faults_on_several_gpus_stay_on_one_line():
    verdict = judge([replace(OK, uncorrectable_ecc=1, remap_pending=True),
                     replace(healthy(5), lost="GPU is lost\nreally")])
    assert isinstance(verdict, Unhealthy) and "\n" not in verdict.reason
    assert verdict.reason == ("GPU 3 (0000:3b:00.0): 1 volatile uncorrectable ECC error; row remapping pending "
                              "(needs a GPU reset) | GPU 5: NVML: GPU is lost\\nreally")


def test_throttling_and_nvml_errors_are_warnings_only():
    verdict = judge([replace(OK, throttle_reasons=0x40 | 0x8 | 0x1, errors=("ecc: Unknown Error",))])
    assert verdict == Healthy(warnings=(
        "GPU 3 (0000:3b:00.0): clocks throttled: hardware slowdown, hardware thermal slowdown",
        "GPU 3 (0000:3b:00.0): NVML error: ecc: Unknown Error"))
    assert judge([replace(OK, throttle_reasons=0x1 | 0x4)]) == Healthy()    # idle, power cap: normal


def test_check_gpus_asks_only_the_gpus_the_workers_use():
    reader = FakeGpuReader.with_gpus(8)
    reader.faults[6] = replace(healthy(6, "0000:21:00.0"), uncorrectable_ecc=3)
    assert isinstance(check_gpus(reader, [0, 1, 2, 3]), Healthy)
    verdict = check_gpus(reader, range(8))
    assert isinstance(verdict, Unhealthy) and verdict.reason.startswith("GPU 6 (0000:21:00.0): 3 volatile")
    assert reader.asked == [0, 1, 2, 3, *range(8)] and verdict.seconds >= 0


def test_gpus_that_could_not_be_asked_are_skipped_or_warned_never_healthy_in_silence():
    unasked = GpuHealth(index=2, unchecked="NVML gives no handle: Insufficient Permissions")
    assert judge([unasked]) == Skipped("GPU 2 not checked: NVML gives no handle: Insufficient Permissions",
                                       warnings=("GPU 2 not checked: NVML gives no handle: Insufficient Permissions",))
    partly = judge([OK, unasked])
    assert isinstance(partly, Healthy) and partly.warnings == (
        "GPU 2 not checked: NVML gives no handle: Insufficient Permissions",)
    assert isinstance(judge([replace(OK, uncorrectable_ecc=1), unasked]), Unhealthy)


def test_a_probe_that_is_unavailable_or_breaks_skips_the_check_never_healthy():
    reader = FakeGpuReader.with_gpus(2)
    reader.unavailable = "the NVIDIA driver is not loaded"
    with pytest.raises(NvmlUnavailable):
        reader.open()
    verdict = check_gpus(reader, [0, 1])
    assert isinstance(verdict, Skipped) and verdict.reason == "the NVIDIA driver is not loaded"
    buggy = types.SimpleNamespace(health=lambda i: 1 / 0)
    verdict = check_gpus(buggy, [0])
    assert isinstance(verdict, Skipped) and verdict.reason.startswith("GPU check failed: ZeroDivisionError")
    assert isinstance(check_gpus(reader, []), Skipped)


# A stand-in for pynvml: the names NvmlReader uses, each answer set by the test (a value, or an error code).
class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 9: "Driver Not Loaded", 12: "NVML Shared Library Not Found",
                15: "GPU is lost", 999: "Unknown Error"}.get(self.value, f"code {self.value}")


def field(value: int | None, ret: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(nvmlReturn=ret, valueType=1, value=types.SimpleNamespace(uiVal=value or 0))


class FakeNvml:
    def __init__(self, **answers: Any) -> None:
        self.calls: list[str] = []
        self.answers: dict[str, Any] = {
            "nvmlInit": None, "nvmlShutdown": None, "nvmlDeviceGetCount": 2,
            "nvmlDeviceGetHandleByIndex": lambda i: f"h{i}", "nvmlDeviceGetUUID": lambda h: f"GPU-{h}",
            "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(busId=f"00000000:{0x1b + int(h[-1]):02X}:00.0"),
            "nvmlDeviceGetName": b"NVIDIA H100", "nvmlDeviceGetMigMode": NVMLError(3),
            "nvmlDeviceGetFieldValues": [field(0), field(0), field(0)],
            "nvmlDeviceGetTotalEccErrors": 0, "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
            "nvmlDeviceGetRetiredPagesPendingStatus": 0, "nvmlDeviceGetCurrentClocksEventReasons": 0, **answers}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in self.answers:
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            self.calls.append(name)
            answer = self.answers[name]
            if isinstance(answer, BaseException):
                raise answer
            return answer(*args) if callable(answer) else answer
        return call


def reader_on(nv: FakeNvml) -> NvmlReader:
    reader = NvmlReader(load=lambda: nv)
    reader.open()
    return reader


def test_nvml_probe_lists_devices_and_reads_a_healthy_gpu():
    nv = FakeNvml()
    reader = reader_on(nv)
    reader.open()                                        # idempotent: NVML started once
    assert [(g.index, g.uuid, g.bus_id, g.name) for g in reader.devices()] == [
        (0, "GPU-h0", "0000:1b:00.0", "NVIDIA H100"), (1, "GPU-h1", "0000:1c:00.0", "NVIDIA H100")]
    assert reader.health(1) == replace(healthy(1, "0000:1c:00.0"), retired_pages_pending=None)
    assert isinstance(check_gpus(reader, [0, 1]), Healthy)
    reader.close()
    reader.close()
    assert nv.calls.count("nvmlInit") == 1 and nv.calls.count("nvmlShutdown") == 1


@pytest.mark.parametrize(("load", "reason"), [
    (ImportError("No module named 'pynvml'"), "nvidia-ml-py is not installed"),
    (FakeNvml(nvmlInit=NVMLError(12)), "the NVML library (libnvidia-ml.so.1) is not found"),
    (FakeNvml(nvmlInit=NVMLError(9)), "the NVIDIA driver is not loaded"),
    (FakeNvml(nvmlInit=NVMLError(999)), "NVML failed to start: Unknown Error"),
])
def test_nvml_missing_or_the_driver_not_loaded_is_a_skipped_check_with_its_reason(load, reason):
    def loader() -> Any:
        if isinstance(load, Exception):
            raise load
        return load

    reader = NvmlReader(load=loader)
    with pytest.raises(NvmlUnavailable) as caught:
        reader.open()
    assert str(caught.value).startswith(reason)
    assert isinstance(check_gpus(reader, [0]), Skipped)          # never opened: skipped, not healthy
    with pytest.raises(NvmlUnavailable):
        reader.devices()


def test_nvml_faults_reach_the_verdict():
    nv = FakeNvml(nvmlDeviceGetFieldValues=[field(1), field(1), field(None, ret=3)],
                  nvmlDeviceGetTotalEccErrors=4, nvmlDeviceGetRemappedRows=(0, 2, 1, 1),
                  nvmlDeviceGetCurrentClocksEventReasons=0x20)
    found = reader_on(nv).health(0)
    assert (found.recovery_action, found.reset_required, found.drain_and_reset) == (1, True, None)
    assert (found.uncorrectable_ecc, found.remap_pending, found.remap_failed) == (4, True, True)
    verdict = judge([found])
    assert isinstance(verdict, Unhealthy) and "GPU reset" in verdict.reason and "row remapping failed" in verdict.reason
    assert verdict.warnings == ("GPU 0 (0000:1b:00.0): clocks throttled: software thermal slowdown",)


def test_retired_pages_are_asked_only_where_row_remapping_is_not_supported():
    nv = FakeNvml(nvmlDeviceGetRemappedRows=NVMLError(3), nvmlDeviceGetRetiredPagesPendingStatus=1)
    found = reader_on(nv).health(0)
    assert found.retired_pages_pending is True and found.remap_pending is None
    assert "retired pages pending" in judge([found]).reason  # type: ignore[union-attr]


def test_not_supported_is_unknown_and_not_asked_again():
    nv = FakeNvml(nvmlDeviceGetFieldValues=NVMLError(3), nvmlDeviceGetTotalEccErrors=NVMLError(3))
    reader = reader_on(nv)
    first, second = reader.health(0), reader.health(0)
    assert first.recovery_action is None and first.uncorrectable_ecc is None and first.errors == ()
    assert first == second and isinstance(judge([first]), Healthy)
    assert nv.calls.count("nvmlDeviceGetTotalEccErrors") == 1 and nv.calls.count("nvmlDeviceGetFieldValues") == 1


def test_a_lost_gpu_is_unhealthy_whichever_call_finds_it():
    lost_handle = FakeNvml(nvmlDeviceGetHandleByIndex=NVMLError(15))
    reader = reader_on(lost_handle)
    assert reader.devices()[1].error == "GPU is lost"
    assert judge([reader.health(1)]) == Unhealthy("GPU 1: NVML: GPU is lost")
    lost_later = reader_on(FakeNvml(nvmlDeviceGetTotalEccErrors=NVMLError(15)))
    found = lost_later.health(0)
    assert found.lost == "GPU is lost" and found.remap_pending is None     # nothing asked after the loss
    reset = reader_on(FakeNvml(nvmlDeviceGetRemappedRows=NVMLError(16))).health(0)
    assert isinstance(judge([reset]), Unhealthy)


def test_a_gpu_without_a_handle_is_not_checked():
    nv = FakeNvml(nvmlDeviceGetHandleByIndex=NVMLError(4))
    found = reader_on(nv).health(0)
    assert found.unchecked == "NVML gives no handle: code 4" and isinstance(judge([found]), Skipped)


def test_an_unexpected_nvml_error_is_a_warning_not_a_crash():
    found = reader_on(FakeNvml(nvmlDeviceGetTotalEccErrors=NVMLError(999))).health(0)
    assert found.errors == ("ecc: Unknown Error",) and isinstance(judge([found]), Healthy)
    gone = reader_on(FakeNvml(nvmlDeviceGetCount=NVMLError(999)))
    with pytest.raises(NvmlUnavailable, match="NVML cannot count the GPUs: Unknown Error"):
        gone.devices()


def test_old_bindings_without_clock_event_reasons_fall_back_to_throttle_reasons():
    nv = FakeNvml(nvmlDeviceGetCurrentClocksThrottleReasons=0x8)
    del nv.answers["nvmlDeviceGetCurrentClocksEventReasons"]
    assert reader_on(nv).health(0).throttle_reasons == 0x8


def test_mig_instances_are_listed_with_their_gpu():
    def slot_handle(handle: str, slot: int) -> str:
        if slot == 1:
            raise NVMLError(6)                         # an empty slot
        return f"m{slot}"

    nv = FakeNvml(nvmlDeviceGetMigMode=[1, 1], nvmlDeviceGetMaxMigDeviceCount=3,
                  nvmlDeviceGetMigDeviceHandleByIndex=slot_handle,
                  nvmlDeviceGetUUID=lambda h: f"MIG-{h}" if h.startswith("m") else f"GPU-{h}")
    assert reader_on(nv).devices()[0].mig_uuids == ("MIG-m0", "MIG-m2")


# --health-check CMD
def script(tmp_path: Path, body: str, mode: int = 0o755) -> str:
    path = tmp_path / "check.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return str(path)


async def test_exit_0_is_healthy(tmp_path):
    assert isinstance(await run_health_check(script(tmp_path, "echo all good"), timeout=10), Healthy)


async def test_a_failing_check_quotes_its_first_line_of_output(tmp_path):
    verdict = await run_health_check([script(tmp_path, "echo; echo 'GPU 2: dcgm diag failed' >&2; echo more; exit 3")],
                                     timeout=10)
    assert isinstance(verdict, Unhealthy)
    assert verdict.reason.endswith("exited with status 3: 'GPU 2: dcgm diag failed'")
    assert verdict.output == "\\nGPU 2: dcgm diag failed\\nmore\\n"


async def test_a_check_killed_by_a_signal_says_which(tmp_path):
    verdict = await run_health_check(script(tmp_path, "kill -SEGV $$"), timeout=10)
    assert isinstance(verdict, Unhealthy) and verdict.reason.endswith("was killed by SIGSEGV (no output)")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    """SIGKILL is delivered asynchronously: wait for the condition, bounded."""
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        os.sched_yield()
    return True


async def test_a_check_that_hangs_is_cut_at_its_deadline_with_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    # Bounded far below the child's 600 s; the verdict says the deadline cut it (not how long it took).
    check = script(tmp_path, f"echo probing; sleep 600 & echo $! > {pidfile}; wait")
    verdict = await asyncio.wait_for(run_health_check(check, timeout=3), 60)   # 3 s: for a loaded machine's shell
    assert isinstance(verdict, Unhealthy)
    assert verdict.reason.endswith("did not finish within 3 s: 'probing'") and verdict.output == "probing\\n"
    assert gone_within(int(pidfile.read_text()), 5)


async def test_a_check_that_exits_but_leaves_a_child_holding_its_output_is_judged_by_its_exit(tmp_path):
    pidfile = tmp_path / "child.pid"
    # Waiting on the child's output would end in the 20 s deadline's Unhealthy, or in the 60 s bound.
    verdict = await asyncio.wait_for(run_health_check(script(tmp_path, f"sleep 600 & echo $! > {pidfile}; exit 0"),
                                                      timeout=20), 60)
    assert isinstance(verdict, Healthy), verdict
    assert gone_within(int(pidfile.read_text()), 5)


async def test_a_check_cancelled_by_the_agent_takes_its_processes_with_it(tmp_path):
    pidfile = tmp_path / "child.pid"
    started = tmp_path / "started"
    check = script(tmp_path, f"sleep 600 & echo $! > {pidfile}; touch {started}; wait")
    task = asyncio.ensure_future(run_health_check(check, timeout=60))
    while not started.exists():                 # the check's own signal that its child is running
        await asyncio.sleep(0)
        if task.done():
            pytest.fail(f"the check ended early: {task.result()}")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone_within(int(pidfile.read_text()), 5)


async def test_megabytes_of_output_are_kept_bounded_and_quoted():
    code = "import sys; sys.stdout.write('\\x1b[31m' + 'y' * (5 << 20)); sys.exit(1)"
    verdict = await run_health_check([sys.executable, "-c", code], timeout=30)
    assert isinstance(verdict, Unhealthy) and len(verdict.reason) < 300
    assert "exited with status 1: '\\x1b[31myyyy" in verdict.reason and verdict.reason.endswith(" characters)")
    assert verdict.output.endswith(f" ... (output cut at {OUTPUT_LIMIT} of {(5 << 20) + 5} bytes)")
    assert len(verdict.output) < OUTPUT_LIMIT + 100 and verdict.output.isprintable()


async def test_endless_output_that_never_exits_is_bounded_by_time_and_size():
    verdict = await run_health_check(["yes", "GPU ok"], timeout=2, output_limit=1000)
    assert isinstance(verdict, Unhealthy) and "did not finish within 2 s: 'GPU ok'" in verdict.reason
    assert verdict.output.startswith("GPU ok\\nGPU ok") and "output cut at 1000 of" in verdict.output


@pytest.mark.parametrize(("command", "reason"), [
    ("/nonexistent/check-gpus --all", "health check '/nonexistent/check-gpus' not found"),
    ("check 'unclosed", "cannot be parsed: No closing quotation"),
    ("", "--health-check is empty"),
])
async def test_a_check_that_cannot_run_is_unhealthy_with_the_reason(command, reason):
    verdict = await run_health_check(command, timeout=10)
    assert isinstance(verdict, Unhealthy) and reason in verdict.reason


async def test_a_check_that_is_not_executable_is_unhealthy(tmp_path):
    path = script(tmp_path, "exit 0", mode=stat.S_IRUSR | stat.S_IWUSR)
    if os.geteuid() == 0 and os.access(path, os.X_OK):
        pytest.skip("root may execute anything here")
    verdict = await run_health_check(path, timeout=10)
    assert verdict == Unhealthy(f"health check {quote(path)} is not executable (permission denied)")


# A worker's failure message: a GPU fault or the program's own bug.
@pytest.mark.parametrize(("message", "fault"), [
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be ...",
     "uncorrectable ECC error"),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
     "GPU has fallen off the bus"),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234", "Xid 79"),
    ("kernel: NVRM: Xid (PCI:0000:b3:00): 48, pid=9, An uncorrectable double bit error", "Xid 48"),
    ("XID 95 seen on this node", "Xid 95"),
    ("NCCL WARN Cuda failure 'uncorrectable NVLink error detected during the execution'", "uncorrectable NVLink error"),
    ("pynvml.NVMLError_GpuIsLost: GPU is lost", "GPU is lost"),
    ("RuntimeError: CUDA error: device-side assert triggered", None),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", None),
    ("NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception", None),
    ("NVRM: Xid (PCI:0000:3b:00): 31, pid=7, MMU Fault", None),
    ("ValueError: loss is nan at step 79", None),
])
def test_failure_messages_that_name_a_gpu_fault(message, fault):
    assert classify_failure(message) == fault


def test_a_huge_failure_message_is_scanned_at_both_ends():
    assert classify_failure("x" * (8 << 20) + "\nuncorrectable ECC error encountered") == "uncorrectable ECC error"
    assert classify_failure("Xid 79\n" + "x" * (8 << 20)) == "Xid 79"


def test_a_check_after_listing_the_devices_asks_four_queries_per_gpu_and_not_the_pci_address_again():
    nv = FakeNvml()
    reader = reader_on(nv)
    reader.devices()
    nv.calls.clear()
    assert check_gpus(reader, [0, 1]).__class__.__name__ == "Healthy"
    assert nv.calls == ["nvmlDeviceGetFieldValues", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                        "nvmlDeviceGetCurrentClocksEventReasons"] * 2


def test_the_gpus_are_asked_at_once_and_judged_in_order():
    # NVML's calls take 1-4 ms each: 8 GPUs asked one after another passed the check's 0.1 s budget.
    # Each stand-in GPU answers only once all 8 are being asked (a barrier), so a check asking them
    # one by one would break the barrier and come back Skipped.
    import threading

    barrier = threading.Barrier(8, timeout=30)

    class AllAtOnce(FakeGpuReader):
        def health(self, index: int) -> GpuHealth:
            barrier.wait()
            return super().health(index)

    reader = AllAtOnce.with_gpus(8)
    reader.faults[5] = replace(healthy(5), uncorrectable_ecc=3)
    reader.open()
    verdict = check_gpus(reader, list(range(8)))
    assert isinstance(verdict, Unhealthy), verdict
    assert "GPU 5" in verdict.reason and not barrier.broken


def test_a_gpus_utilization_is_read_and_a_query_it_does_not_support_is_not_asked_again():
    nv = FakeNvml(nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87 if h == "h0" else 250))
    reader = reader_on(nv)
    assert reader.utilization(0) == 87
    assert reader.utilization(1) is None                     # out of range: not a reading
    unsupported = reader_on(FakeNvml(nvmlDeviceGetUtilizationRates=NVMLError(3)))
    assert unsupported.utilization(0) is None and unsupported.utilization(0) is None
    assert unsupported._nv.calls.count("nvmlDeviceGetUtilizationRates") == 1
    lost = reader_on(FakeNvml(nvmlDeviceGetUtilizationRates=NVMLError(15)))
    assert lost.utilization(0) is None                      # never raises
    reader.close()
    assert reader.utilization(0) is None                     # closed: nothing to read
