"""docs/deploy.md's backup and upgrade advice, run as written: the guide's backup commands copy a
running server's store consistently, a server started on the copy has the job, and a clean stop
leaves no committed change behind in the WAL."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request

import msgpack
import pytest

from tests.deploy.tools import ROOT
from tests.e2e.harness import Cluster

GUIDE = os.path.join(ROOT, "docs", "deploy.md")
DB = "rdzv-state.sqlite3"
JOB = "backup-job"


def guide_command(starts_with: str) -> str:
    """The guide's command (a line, or a line continued with a backslash) that starts with this word."""
    with open(GUIDE) as f:
        text = re.sub(r"\\\n\s*", " ", f.read())
    for line in text.splitlines():
        if line.startswith(starts_with + " "):
            return line
    raise AssertionError(f"docs/deploy.md has no command starting with {starts_with!r}")


def join(port: int, node: str) -> None:
    body = {"v": 1, "node_id": node, "addr": "127.0.0.1", "local_world_size": 1, "master_port": 1,
            "config": {"min_nodes": 2, "max_nodes": 2, "last_call_s": 1.0, "lease_timeout_s": 60.0}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/jobs/{JOB}/join", data=msgpack.packb(body),
                                 headers={"Content-Type": "application/msgpack"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def node_ids(cluster: Cluster) -> set[str]:
    view = cluster.get(f"/v1/jobs/{JOB}")
    return {n["node_id"] for n in view["nodes"] + view["waiting"]}


@pytest.mark.parametrize("tool", ["sqlite3", "python"])
def test_backup_of_a_running_server_restores_its_jobs(tmp_path, tool):
    command = guide_command(tool)
    if tool == "sqlite3" and shutil.which("sqlite3") is None:
        pytest.skip("the sqlite3 tool is not installed here: `make deploy-tools` installs it")
    live, out = tmp_path / "live", tmp_path / "backups"
    out.mkdir()
    cluster = Cluster(tmp_path)
    try:
        port = cluster.start_server("--state-dir", str(live))
        join(port, "node-a")                     # a job waiting for its second node
        # the guide's command, run by a shell, with this test's folders for the server's and the backup's
        line = command.replace("/var/lib/rdzv-server/", f"{live}/")
        line = line.replace("/backup/rdzv-", f"{out}/rdzv-").replace("/tmp/rdzv-", f"{out}/rdzv-")
        if tool == "python":
            line = shlex.quote(sys.executable) + line[len("python"):]
        result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30)  # while it runs
        (backup,) = out.glob("rdzv-*.sqlite3")
        assert result.returncode == 0, (line, result.stderr)
        cluster.server.popen.send_signal(signal.SIGTERM)
        assert cluster.server.wait(30) == 0
        # a clean stop folds the WAL into the store file
        wal = live / (DB + "-wal")
        assert not wal.exists() or wal.stat().st_size == 0
        # restore: the backup alone, in an empty state dir
        restored = tmp_path / "restored"
        restored.mkdir()
        shutil.copy(backup, restored / DB)
        cluster.start_server("--state-dir", str(restored))
        assert node_ids(cluster) == {"node-a"}
    finally:
        cluster.close()
