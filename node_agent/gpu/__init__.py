"""What the agent knows about a node's NVIDIA GPUs (topology, devices, health), learnt without a CUDA context.

Rule: imports only the standard library, `protocol` and (lazily, in the NVML reader) `pynvml`; never torch,
as the agent must not load CUDA. `has_nvidia_devices` lives here, light, so a CPU node imports nothing else.
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
