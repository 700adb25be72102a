"""Which GPU each local rank uses: rank r the r-th GPU the agent sees, as torchrun's workers address it
(cuda:LOCAL_RANK; with --virtual-local-rank, cuda:0 with the r-th entry as CUDA_VISIBLE_DEVICES).
"Sees" is CUDA's reading of CUDA_VISIBLE_DEVICES: ordinals ("1gpu2" is 1, like strtoul), UUIDs or unique UUID
prefixes, MIG ids; the first entry naming no device ends the list, a device named twice leaves none. Unset:
every GPU in PCI order (CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID, and on one-model nodes). Nothing refuses:
doubts become notes, an unresolved GPU is kept with `gpu=None` (no NUMA binding or check) so the ranks line up.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from node_agent.gpu.nvml import GpuInfo
from node_agent.gpu.topology import gpu_numa_node, listdir, pci_gpus
from protocol.quoting import quote


@dataclass(frozen=True)
class VisibleGpu:
    ordinal: int                 # CUDA's number for it in the agent's view
    entry: str                   # its CUDA_VISIBLE_DEVICES entry; the ordinal as text when unset
    gpu: GpuInfo | None          # the physical GPU (a MIG instance's parent); None: not resolved


@dataclass(frozen=True)
class Visible:
    gpus: tuple[VisibleGpu, ...]
    notes: tuple[str, ...] = ()


def _ordinal(entry: str) -> int | None:
    """strtoul's reading, as CUDA does: leading digits (an optional +), else None."""
    m = re.match(r"\+?(\d+)", entry)
    return int(m.group(1)) if m else None


def _by_prefix(prefix: str, uuids: Sequence[str]) -> int | None | str:
    """The one position whose uuid starts with `prefix` (case-insensitive); None: no match; "ambiguous"."""
    hits = [i for i, u in enumerate(uuids) if u and u.lower().startswith(prefix.lower())]
    if len(hits) > 1:
        return "ambiguous"
    return hits[0] if hits else None


def visible_gpus(devices: Sequence[GpuInfo] | None, cuda_visible_devices: str | None,
                 cuda_device_order: str | None = None) -> Visible:
    """The GPUs CUDA shows the workers, in its order; `devices` None (no reader): ordinals are kept unresolved."""
    known = sorted(devices, key=lambda g: g.bus_id) if devices and all(g.bus_id for g in devices) \
        else list(devices or [])
    notes: list[str] = []
    if cuda_visible_devices is None:
        if devices is None:
            return Visible((), ("the GPUs are unknown (no NVML) and CUDA_VISIBLE_DEVICES is unset",))
        out = [VisibleGpu(i, str(i), g) for i, g in enumerate(known)]
        return Visible(tuple(out), tuple(_order_note(out, cuda_device_order, numbered=True)))
    shown = f"CUDA_VISIBLE_DEVICES={quote(cuda_visible_devices)}"
    out = []
    seen: set[object] = set()
    numbered = False
    for position, raw in enumerate(cuda_visible_devices.split(",")):
        entry = raw.strip()
        found = _resolve(entry, known, devices is not None)
        if isinstance(found, str):
            notes.append(f"{shown}: CUDA stops at entry {position + 1} ({quote(entry)}: {found}), "
                         f"{len(out)} GPU{'s' if len(out) != 1 else ''} visible")
            break
        gpu, mig = found
        number = _ordinal(entry)
        key: object = mig or (gpu.index if gpu is not None else number if number is not None else entry)
        if key in seen:
            notes.append(f"{shown} names {quote(entry)} twice: CUDA then shows no GPU at all")
            return Visible((), tuple(notes))
        seen.add(key)
        numbered = numbered or number is not None
        out.append(VisibleGpu(len(out), entry, gpu))
    unresolved = [v.entry for v in out if v.gpu is None]
    if unresolved and devices is not None:
        notes.append(f"{shown}: no NVML device for {', '.join(quote(e) for e in unresolved)}: "
                     f"their workers run without NUMA binding or GPU check")
    notes.extend(_order_note(out, cuda_device_order, numbered=numbered))
    return Visible(tuple(out), tuple(notes))


def _resolve(entry: str, known: Sequence[GpuInfo], have_devices: bool) -> tuple[GpuInfo | None, str | None] | str:
    """(physical GPU, MIG uuid) for one entry, or why CUDA would stop there."""
    upper = entry.upper()
    if upper.startswith("MIG-GPU-"):            # MIG-GPU-<gpu uuid>/<gi>/<ci>
        parent = _by_prefix(entry[4:].split("/")[0], [g.uuid for g in known])
        return (known[parent] if isinstance(parent, int) else None), entry
    if upper.startswith("MIG-"):
        for g in known:
            hit = _by_prefix(entry, g.mig_uuids)
            if isinstance(hit, int):
                return g, g.mig_uuids[hit]
        return None, entry
    if upper.startswith("GPU-"):
        hit = _by_prefix(entry, [g.uuid for g in known])
        if hit == "ambiguous":
            return "a prefix of several GPUs' UUIDs"
        if hit is None:
            return "no GPU has this UUID" if have_devices else "a UUID, and the GPUs' UUIDs are unknown (no NVML)"
        return known[int(hit)], None
    ordinal = _ordinal(entry)
    if ordinal is None:
        return "not a device number, GPU- UUID or MIG- id"
    if not have_devices:
        return None, None
    if ordinal >= len(known):
        return f"only {len(known)} GPU{'s' if len(known) != 1 else ''} on this node"
    return known[ordinal], None


def _order_note(out: Sequence[VisibleGpu], order: str | None, *, numbered: bool) -> list[str]:
    names = sorted({v.gpu.name for v in out if v.gpu is not None and v.gpu.name})
    if numbered and len(names) > 1 and (order or "").strip().upper() != "PCI_BUS_ID":
        return [f"GPUs of different models ({', '.join(names)}) and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA "
                f"may number them fastest first, not in the PCI order assumed here; set CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    return []


@dataclass(frozen=True)
class RankGpu:
    local_rank: int
    gpu: VisibleGpu | None           # None: more workers than visible GPUs


@dataclass(frozen=True)
class RankGpus:
    ranks: tuple[RankGpu, ...]
    warning: str | None = None       # more workers than GPUs (legitimate: CPU workers on a GPU node)

    def nvml_indices(self) -> list[int]:
        """The distinct physical GPUs (NVML indices) the workers use: the ones to check."""
        return list(dict.fromkeys(r.gpu.gpu.index for r in self.ranks if r.gpu is not None and r.gpu.gpu is not None))


def rank_gpus(visible: Visible, nproc: int) -> RankGpus:
    """Local rank r -> visible GPU r, for r < nproc (--virtual-local-rank too: only the worker's name for it
    differs); one warning when nproc exceeds the visible GPUs."""
    ranks = tuple(RankGpu(r, visible.gpus[r] if r < len(visible.gpus) else None) for r in range(nproc))
    warning = None
    if visible.gpus and nproc > len(visible.gpus):
        warning = (f"{nproc} workers but {len(visible.gpus)} GPU{'s' if len(visible.gpus) != 1 else ''} visible: "
                   f"local ranks {len(visible.gpus)}-{nproc - 1} have no GPU of their own")
    return RankGpus(ranks, warning)


def gpu_numa_nodes(visible: Visible, root: str = "/") -> list[int | None]:
    """Each visible GPU's NUMA node from sysfs (None: unknown), in CUDA's order: plan_binding's input."""
    return [gpu_numa_node(root, v.gpu.bus_id) if v.gpu is not None and v.gpu.bus_id else None
            for v in visible.gpus]


def gpus_from_sysfs(root: str = "/", dev_dir: str = "/dev") -> list[GpuInfo] | None:
    """The GPUs without NVML (no UUIDs): NVIDIA display-class PCI devices, trusted only when as many as the
    /dev/nvidiaN nodes (a container may see the host's whole PCI tree but only its own devices)."""
    bus_ids = pci_gpus(root)
    nodes = [n for n in listdir(dev_dir) if re.fullmatch(r"nvidia\d+", n)]
    if not bus_ids or len(bus_ids) != len(nodes):
        return None
    return [GpuInfo(index=i, uuid="", bus_id=b) for i, b in enumerate(bus_ids)]
