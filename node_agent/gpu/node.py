"""What the agent learns about its node's GPUs once, at start: which GPU each local rank uses and (with
--numa-binding) each rank's CPUs. `survey` never raises for anything the machine says.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from node_agent.gpu import has_nvidia_devices
from node_agent.gpu.devices import RankGpus, gpu_numa_nodes, gpus_from_sysfs, rank_gpus, visible_gpus
from node_agent.gpu.nvml import GpuInfo, GpuReader, NvmlUnavailable
from node_agent.gpu.topology import Bound, parse_bind_mode, plan_binding, read_topology


@dataclass(frozen=True)
class NodeGpus:
    ranks: RankGpus                             # local rank -> the GPU it uses
    lines: tuple[str, ...] = ()                 # each bound rank's binding, said once
    warnings: tuple[str, ...] = ()              # said once, before any worker starts
    cpu_affinity: Mapping[int, frozenset[int]] = field(default_factory=dict)


def survey(nproc: int, environ: Mapping[str, str], *, reader: GpuReader | None, numa_binding: str | None = None,
           root: str = "/", dev_dir: str = "/dev",
           allowed: frozenset[int] | None = None) -> NodeGpus:
    """The node's GPUs for `nproc` workers; `reader` open, or None (sysfs alone); `allowed`: default our affinity."""
    devices: list[GpuInfo] | None = None
    if reader is not None:
        with contextlib.suppress(NvmlUnavailable):
            devices = reader.devices()
    if devices is None:
        devices = gpus_from_sysfs(root, dev_dir)
    visible = visible_gpus(devices, environ.get("CUDA_VISIBLE_DEVICES"), environ.get("CUDA_DEVICE_ORDER"))
    ranks = rank_gpus(visible, nproc)
    # notes about CUDA_VISIBLE_DEVICES matter only where there are GPUs to see
    warnings = [*visible.notes] if devices or has_nvidia_devices(dev_dir) else []
    if ranks.warning:
        warnings.append(ranks.warning)
    if numa_binding is None:
        return NodeGpus(ranks, warnings=tuple(warnings))
    mode = parse_bind_mode(numa_binding)
    cpus = allowed if allowed is not None else frozenset(os.sched_getaffinity(0))
    plan = plan_binding(read_topology(root, mode), mode, gpu_numa_nodes(visible, root), nproc, cpus)
    bound = [r for r in plan.ranks if isinstance(r, Bound)]
    return NodeGpus(ranks, lines=tuple(f"NUMA binding, {r.describe(mode)}" for r in bound),
                    warnings=(*warnings, *plan.warnings()), cpu_affinity=plan.affinity())
