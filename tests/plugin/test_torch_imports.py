"""Only modules whose path contains "plugin" may import torch, and the entry point torch loads in
every torchrun launch (plugin_entry.py) imports nothing heavy."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.e2e.harness import ROOT, child_env

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
    modules = [f"{pkg}.{name[:-3]}" for pkg in ("node_agent", "rdzv_server", "protocol")
               for name in sorted(os.listdir(os.path.join(ROOT, pkg)))
               if name.endswith(".py") and "plugin" not in name and name != "__init__.py"]
    assert "node_agent.agent" in modules and "rdzv_server.app" in modules
    assert not [m for m in loaded_after_import(*modules) if m.split(".")[0] == "torch"]


def test_the_entry_point_module_loads_nothing():
    assert loaded_after_import("node_agent.plugin_entry") == []
