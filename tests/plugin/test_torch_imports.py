"""Only the plugin's package (node_agent/plugin/) and the torch side of node_agent/training/ (protect and the
framework snapshots, which no agent module imports: tests/test_layers.py) may import torch; the worker side's
torch-free half (snapshot, heartbeat, the probe, the package itself) imports none; and the entry point torch loads in
every torchrun launch (node_agent/plugin/entry.py) imports nothing heavy."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.harness import child_env
from tests.packages import modules

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'aiohttp', 'msgspec'))))
"""


def loaded_after_import(*modules: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], env=child_env(), capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return json.loads(out)


def test_no_agent_or_server_module_outside_the_plugin_imports_torch():
    torch_side = ("node_agent.training.protection", "node_agent.training.capture", "node_agent.training.resume",
                  "node_agent.training.trees", "node_agent.training.rng", "node_agent.training.lightning",
                  "node_agent.training.hf", "node_agent.training.layout", "node_agent.training.ddp_buckets",
                  "node_agent.training.restored", "node_agent.training.upload", "node_agent.training.staging",
                  "node_agent.training.slabs")
    outside = [m for m in modules() if not m.startswith(("node_agent.plugin", *torch_side))
               and not m.endswith("__main__")]
    assert "node_agent.training.snapshot" in outside and "node_agent.training" in outside
    assert "node_agent.agent" in outside and "rdzv_server.web.app" in outside
    assert not [m for m in loaded_after_import(*outside) if m.split(".")[0] == "torch"]


def test_the_entry_point_module_loads_nothing():
    assert loaded_after_import("node_agent.plugin.entry") == []
