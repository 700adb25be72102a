"""deploy/README.md and docs/deploy.md: every file in deploy/ is described and exercised by a test here,
and every path the guides name exists."""
from __future__ import annotations

import glob
import os
import re

from tests.deploy.tools import DEPLOY, ROOT

TESTS = os.path.dirname(os.path.abspath(__file__))
GUIDE = os.path.join(ROOT, "docs", "deploy.md")
README = os.path.join(DEPLOY, "README.md")
INSTALL_TIME = {"token", "admin-token"}     # made by the installer, ignored by git


def deploy_files() -> list[str]:
    out = []
    for dirpath, _, names in os.walk(DEPLOY):
        for name in names:
            if name not in INSTALL_TIME:
                out.append(os.path.relpath(os.path.join(dirpath, name), ROOT))
    return sorted(out)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_every_deploy_file_is_exercised_by_a_test():
    sources = {os.path.basename(p): read(p) for p in glob.glob(os.path.join(TESTS, "test_*.py"))}
    missing = []
    for path in deploy_files():
        parts = path.split(os.sep)
        if parts[1] == "kubernetes" and path.endswith(".yaml"):
            owner = "test_kubernetes.py"      # rendered by kustomize; that test checks none is left out
        elif path == os.path.join("deploy", "README.md"):
            owner = "test_docs.py"
        elif parts[-1] == ".gitignore":
            owner = "test_kubernetes.py" if parts[1] == "kubernetes" else None
        else:
            owner = next((name for name, src in sources.items() if f'"{parts[-1]}"' in src), None)
        if owner is None or owner not in sources:
            missing.append(path)
    assert not missing, f"files in deploy/ that no test in tests/deploy/ exercises: {missing}"


def test_readme_describes_every_file():
    text = read(README)
    undescribed = [p for p in deploy_files()
                   if os.path.basename(p) not in text and os.path.basename(os.path.dirname(p)) + "/" not in text]
    assert not undescribed


def test_every_path_the_guides_name_exists():
    for doc in (GUIDE, README):
        text = read(doc)
        # (deploy/rdzv-server elsewhere is kubectl's name for the Deployment)
        named = set(re.findall(r"deploy/(?:container|kubernetes|slurm|systemd|README)[A-Za-z0-9_./@-]*[A-Za-z0-9_@]",
                               text))
        named |= {"deploy/" + m for m in re.findall(r"`((?:container|kubernetes|slurm|systemd)/[^`\s]*)`", text)}
        assert named, doc
        for path in named:
            if os.path.basename(path) in INSTALL_TIME:
                continue
            assert os.path.exists(os.path.join(ROOT, path.rstrip("/"))), f"{doc} names {path}, which does not exist"


def test_guide_covers_what_operators_ask_first():
    text = read(GUIDE)
    for topic in ("29400", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "127.0.1.1",
                  "ip_local_port_range", "per 1,000 nodes", "--server-wait", ".backup", "WAL",
                  "## Containers", "## Kubernetes", "## Slurm", "## systemd"):
        assert topic in text, f"docs/deploy.md says nothing about {topic}"
