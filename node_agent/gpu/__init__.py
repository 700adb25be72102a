"""What the agent knows about a node's NVIDIA GPUs, learnt without torch and without a CUDA context.

- `topology`: sysfs read under one root path (NUMA nodes, sockets, cores, last-level caches, a PCI
  device's NUMA node) and the pure plan of torchrun's `--numa-binding` modes per local rank.
- `devices`: which GPU each local rank uses (`CUDA_VISIBLE_DEVICES` honoured, `--virtual-local-rank`).
- `nvml`: the `GpuProbe` interface (devices and their health facts), its NVML implementation and a fake.
- `health`: the pure verdict on a probe's findings, the `--health-check CMD` runner, and the classifier
  of a worker's failure message (GPU fault or not).
- `node`: the survey the agent makes once at start (which GPU each rank uses, --numa-binding's CPUs).

Rule for this package: it imports only the standard library, `protocol`, and (lazily, inside the NVML
probe, on GPU nodes) `pynvml` from nvidia-ml-py. Never torch: the agent must not load CUDA.
`has_nvidia_devices` lives here, light, so that a CPU node's agent imports nothing else of it.
"""
from __future__ import annotations

import os
import re


def has_nvidia_devices(dev_dir: str = "/dev") -> bool:
    """Whether the node has NVIDIA GPU device nodes (/dev/nvidia0, ...): where the GPU check is on."""
    try:
        return any(re.fullmatch(r"nvidia\d+", name) for name in os.listdir(dev_dir))
    except OSError:
        return False
