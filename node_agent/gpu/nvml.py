"""The GPUs and their health facts behind one interface, `GpuReader`: `NvmlReader` (nvidia-ml-py's `pynvml`,
imported on `open()`, never at module load; tests use a fake). A reader is opened once and may stay open while
workers run, so NVML keeps its handles.
Nothing from NVML escapes as an exception: `open()` and `devices()` raise only `NvmlUnavailable` (the line a
"check skipped" verdict quotes), `health()` puts every error in a field. "Not supported" is unknown, never
unhealthy. No nvidia-smi fallback: it needs the same libnvidia-ml.so.1, and a process per check is too slow.
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from node_agent.gpu.topology import normalize_bus_id
from protocol.quoting import one_line

# NVML's numbers (nvml.h), so that the verdict needs no pynvml.
RECOVERY_ACTIONS = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset",
                    5: "recover IMEX domain", 6: "bus reset", 7: "system reboot"}
FI_RESET_STATUS, FI_DRAIN_AND_RESET_STATUS, FI_RECOVERY_ACTION = 226, 227, 230
ERR_NOT_SUPPORTED, ERR_NO_PERMISSION, ERR_NOT_FOUND, ERR_DRIVER_NOT_LOADED = 3, 4, 6, 9
ERR_LIBRARY_NOT_FOUND, ERR_FUNCTION_NOT_FOUND, ERR_GPU_IS_LOST, ERR_RESET_REQUIRED = 12, 13, 15, 16
ERR_NO_DATA = 21
UNKNOWN_ERRORS = {ERR_NOT_SUPPORTED, ERR_NO_PERMISSION, ERR_NOT_FOUND, ERR_FUNCTION_NOT_FOUND, ERR_NO_DATA}
LOST_ERRORS = {ERR_GPU_IS_LOST, ERR_RESET_REQUIRED}
START_FAILURES: dict[int | None, str] = {
    ERR_LIBRARY_NOT_FOUND: "the NVML library (libnvidia-ml.so.1) is not found: is the NVIDIA driver installed?",
    ERR_DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded"}
# Clock event reasons worth a warning; idle, application clocks, power cap and sync boost are normal under load.
THROTTLE_WARNINGS = {0x8: "hardware slowdown", 0x20: "software thermal slowdown",
                     0x40: "hardware thermal slowdown", 0x80: "hardware power brake"}
# nvmlFieldValue_t's value member for each nvmlValueType_t
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class NvmlUnavailable(Exception):
    """The GPUs cannot be looked at (no bindings, library or driver): the check is skipped, with this reason."""


@dataclass(frozen=True)
class GpuInfo:
    index: int                          # NVML's index
    uuid: str                           # "GPU-..."; "" when NVML could not say
    bus_id: str                         # sysfs form "0000:3b:00.0"; "" when NVML could not say
    name: str = ""
    mig_uuids: tuple[str, ...] = ()     # its MIG instances' UUIDs ("MIG-...") when MIG is on
    error: str | None = None            # why the facts above are missing (e.g. "GPU is lost")


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's health facts. None: unknown (not supported, or not asked)."""
    index: int
    bus_id: str = ""
    lost: str | None = None                   # NVML answered "GPU is lost" / "GPU requires reset"
    recovery_action: int | None = None        # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (r570+)
    reset_required: bool | None = None        # NVML_FI_DEV_RESET_STATUS (older drivers)
    drain_and_reset: bool | None = None       # NVML_FI_DEV_DRAIN_AND_RESET_STATUS
    uncorrectable_ecc: int | None = None      # volatile uncorrectable ECC errors since the driver loaded
    remap_pending: bool | None = None         # row remapping waits for a GPU reset
    remap_failed: bool | None = None          # a row could not be remapped
    retired_pages_pending: bool | None = None  # pages wait for retirement (before Ampere)
    throttle_reasons: int | None = None       # NVML clock event reasons, a bit mask
    errors: tuple[str, ...] = ()              # other NVML errors met, one line each
    unchecked: str | None = None              # why nothing could be asked about this GPU



class GpuReader(Protocol):
    def open(self) -> None:
        """Start (idempotent). Raises NvmlUnavailable."""

    def close(self) -> None:
        """Release what open() took; never raises."""

    def devices(self) -> list[GpuInfo]:
        """Every GPU this process can reach, in the reader's index order. Raises NvmlUnavailable."""

    def health(self, index: int) -> GpuHealth:
        """The health facts of GPU `index`. Raises NvmlUnavailable only when the reader is not open."""

    def utilization(self, index: int) -> int | None:
        """The share of the last sample period (1/6 to 1 s) during which a kernel ran on GPU `index`, in %
        (None: not known: not supported, an error, or the reader is not open). Never raises."""


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _text(exc: BaseException) -> str:
    try:
        text = str(exc) or type(exc).__name__
    except Exception:                       # pynvml's __str__ calls into the library
        text = type(exc).__name__
    return one_line(text)


class NvmlReader:
    """GpuReader on NVML. `load` imports the bindings (tests hand in a stand-in module)."""

    def __init__(self, load: Callable[[], Any] | None = None) -> None:
        self._load = load if load is not None else (lambda: importlib.import_module("pynvml"))
        self._nv: Any = None
        self._handles: dict[int, Any] = {}
        self._bus_ids: dict[int, str] = {}     # from devices(): a check need not ask again
        self._unsupported: set[tuple[int, str]] = set()

    def open(self) -> None:
        if self._nv is not None:
            return
        try:
            nv = self._load()
        except ImportError as exc:
            raise NvmlUnavailable("nvidia-ml-py is not installed (pip install 'elastic-launcher[gpu]')") from exc
        except Exception as exc:
            raise NvmlUnavailable(f"nvidia-ml-py failed to load: {_text(exc)}") from exc
        try:
            nv.nvmlInit()
        except Exception as exc:
            raise NvmlUnavailable(START_FAILURES.get(_code(exc)) or f"NVML failed to start: {_text(exc)}") from exc
        self._nv = nv

    def close(self) -> None:
        nv, self._nv = self._nv, None
        self._handles.clear()
        if nv is not None:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()

    def _api(self) -> Any:
        if self._nv is None:
            raise NvmlUnavailable("NVML is not open")
        return self._nv

    def devices(self) -> list[GpuInfo]:
        nv = self._api()
        try:
            count = int(nv.nvmlDeviceGetCount())
        except Exception as exc:
            raise NvmlUnavailable(f"NVML cannot count the GPUs: {_text(exc)}") from exc
        return [self._describe(nv, index) for index in range(count)]

    def _describe(self, nv: Any, index: int) -> GpuInfo:
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            self._handles[index] = handle
            uuid = _str(nv.nvmlDeviceGetUUID(handle))
            bus_id = normalize_bus_id(_str(nv.nvmlDeviceGetPciInfo(handle).busId))
            name = _str(nv.nvmlDeviceGetName(handle))
        except Exception as exc:
            return GpuInfo(index=index, uuid="", bus_id="", error=_text(exc))
        self._bus_ids[index] = bus_id
        return GpuInfo(index=index, uuid=uuid, bus_id=bus_id, name=name, mig_uuids=self._migs(nv, handle))

    def _migs(self, nv: Any, handle: Any) -> tuple[str, ...]:
        try:
            if nv.nvmlDeviceGetMigMode(handle)[0] != 1:
                return ()
            found = []
            for slot in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))):
                try:
                    found.append(_str(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))))
                except Exception:
                    continue                # an empty slot answers NOT_FOUND
            return tuple(found)
        except Exception:
            return ()                       # no MIG on this GPU or driver

    def health(self, index: int) -> GpuHealth:
        nv = self._api()
        try:
            handle = self._handles.get(index)
            if handle is None:
                handle = self._handles[index] = nv.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            if _code(exc) in LOST_ERRORS:
                return GpuHealth(index=index, lost=_text(exc))
            return GpuHealth(index=index, unchecked=f"NVML gives no handle: {_text(exc)}")
        facts = _Facts(self, index)
        bus_id = self._bus_ids.get(index) or facts.ask("pci", lambda: normalize_bus_id(
            _str(nv.nvmlDeviceGetPciInfo(handle).busId))) or ""
        action, reset, drain = facts.ask("fields", lambda: _fields(nv, handle, (
            FI_RECOVERY_ACTION, FI_RESET_STATUS, FI_DRAIN_AND_RESET_STATUS))) or (None, None, None)
        ecc = facts.ask("ecc", lambda: int(nv.nvmlDeviceGetTotalEccErrors(handle, 1, 0)))  # uncorrected, volatile
        rows = facts.ask("remap", lambda: tuple(int(v) for v in nv.nvmlDeviceGetRemappedRows(handle)))
        pages = None
        if rows is None:                    # row remapping (Ampere+) replaced page retirement
            pages = facts.ask("pages", lambda: int(nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)) != 0)
        throttle = facts.ask("throttle", lambda: int(_throttle(nv, handle)))
        return GpuHealth(index=index, bus_id=bus_id, lost=facts.lost, recovery_action=action,
                         reset_required=None if reset is None else reset != 0,
                         drain_and_reset=None if drain is None else drain != 0, uncorrectable_ecc=ecc,
                         remap_pending=None if rows is None else rows[2] != 0,
                         remap_failed=None if rows is None else rows[3] != 0,
                         retired_pages_pending=pages, throttle_reasons=throttle, errors=tuple(facts.errors))

    def utilization(self, index: int) -> int | None:
        if self._nv is None or (index, "utilization") in self._unsupported:
            return None
        nv = self._nv
        try:
            handle = self._handles.get(index)
            if handle is None:
                handle = self._handles[index] = nv.nvmlDeviceGetHandleByIndex(index)
            busy = int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception as exc:
            if _code(exc) in UNKNOWN_ERRORS or isinstance(exc, AttributeError):
                self._unsupported.add((index, "utilization"))
            return None
        return busy if 0 <= busy <= 100 else None


class _Facts:
    """Runs one NVML query at a time, sorting a failure: unknown (not asked again), lost, or an error to report."""

    def __init__(self, reader: NvmlReader, index: int) -> None:
        self.reader, self.index = reader, index
        self.lost: str | None = None
        self.errors: list[str] = []

    def ask(self, name: str, query: Callable[[], Any]) -> Any:
        key = (self.index, name)
        if key in self.reader._unsupported or self.lost is not None:
            return None
        try:
            return query()
        except Exception as exc:
            code = _code(exc)
            if code in LOST_ERRORS:
                self.lost = _text(exc)
            elif code in UNKNOWN_ERRORS or isinstance(exc, AttributeError):   # old bindings lack a call
                self.reader._unsupported.add(key)
            else:
                self.errors.append(f"{name}: {_text(exc)}")
            return None


def _str(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _fields(nv: Any, handle: Any, ids: Iterable[int]) -> tuple[int | None, ...] | None:
    """NVML field values as ints, None for a field this GPU or driver does not support."""
    out = tuple(None if v.nvmlReturn != 0 else int(getattr(v.value, _VALUE_MEMBERS.get(int(v.valueType), "uiVal")))
                for v in nv.nvmlDeviceGetFieldValues(handle, list(ids)))
    return out if any(x is not None for x in out) else None


def _throttle(nv: Any, handle: Any) -> Any:
    if hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons"):
        return nv.nvmlDeviceGetCurrentClocksEventReasons(handle)
    return nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
