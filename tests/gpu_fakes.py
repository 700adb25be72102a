"""A GpuReader for tests (node_agent/gpu/nvml.py's interface): GPUs and faults as given, no NVML."""
from __future__ import annotations

from dataclasses import dataclass, field

from node_agent.gpu.nvml import GpuHealth, GpuInfo, NvmlUnavailable


def healthy(index: int, bus_id: str = "") -> GpuHealth:
    """The facts of a GPU with nothing wrong and every query supported."""
    return GpuHealth(index=index, bus_id=bus_id, recovery_action=0, reset_required=False, drain_and_reset=False,
                     uncorrectable_ecc=0, remap_pending=False, remap_failed=False, retired_pages_pending=False,
                     throttle_reasons=0)


@dataclass
class FakeGpuReader:
    """A GpuReader reporting what it is given: `unavailable` fails open(); `faults[index]` replaces all-good facts."""
    gpus: list[GpuInfo] = field(default_factory=list)
    faults: dict[int, GpuHealth] = field(default_factory=dict)
    unavailable: str | None = None
    opened: int = 0
    closed: int = 0
    asked: list[int] = field(default_factory=list)
    busy: dict[int, int] = field(default_factory=dict)     # GPU index -> its utilization, % (absent: unknown)

    @classmethod
    def with_gpus(cls, count: int, *, name: str = "NVIDIA H100 80GB HBM3") -> FakeGpuReader:
        """`count` GPUs at PCI addresses 0000:1b:00.0, 0000:1c:00.0, ... with UUIDs GPU-00000000-..."""
        return cls(gpus=[GpuInfo(index=i, uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444",
                                 bus_id=f"0000:{0x1b + i:02x}:00.0", name=name) for i in range(count)])

    def open(self) -> None:
        if self.unavailable is not None:
            raise NvmlUnavailable(self.unavailable)
        self.opened += 1

    def close(self) -> None:
        self.closed += 1

    def devices(self) -> list[GpuInfo]:
        if self.unavailable is not None:
            raise NvmlUnavailable(self.unavailable)
        return list(self.gpus)

    def health(self, index: int) -> GpuHealth:
        if self.unavailable is not None:
            raise NvmlUnavailable(self.unavailable)
        self.asked.append(index)
        bus_id = next((g.bus_id for g in self.gpus if g.index == index), "")
        return self.faults.get(index, healthy(index, bus_id))

    def utilization(self, index: int) -> int | None:
        return None if self.unavailable is not None else self.busy.get(index)
