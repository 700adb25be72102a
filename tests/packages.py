"""The project's own modules, found by walking its packages (sub-packages included)."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("protocol", "rdzv_server", "node_agent", "rdzv_ctl")


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            dotted = os.path.relpath(folder, ROOT).replace(os.sep, ".")
            for name in sorted(files):
                if name.endswith(".py"):
                    found[dotted if name == "__init__.py" else f"{dotted}.{name[:-3]}"] = os.path.join(folder, name)
    return found
