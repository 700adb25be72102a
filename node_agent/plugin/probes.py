"""node-agent's progress probe in torch's workers, for one fact: whether a worker that failed failed at start (before
its process group, no step taken: core/steps.failed_at_start), which node-agent's reports say in
WorkerFailure.before_group. The server takes that same failure on several nodes for the script's error (an
ImportError), not a node's, and excludes none of them one by one.

torch's agent starts each worker with a copy of its own environment plus its variables (LOCAL_RANK among them), so
the plugin puts the probe's loader (the boot folder first on PYTHONPATH) and NODE_AGENT_PROGRESS in torchrun's own
environment, its record path naming `{local_rank}` (probe.RANK_FIELD): one record per local rank, made afresh before
each round starts and read after torch stopped the round's workers. No stacks file: nobody asks a worker for its
stacks here. Only for a Python script or module: a worker that is another program has no probe, as under node-agent.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

from node_agent.core.steps import failed_at_start
from node_agent.training.probe import ENV, RANK_FIELD
from node_agent.workers.environment import BOOT_DIR
from node_agent.workers.probes import BadRecord, ProbeFiles, ProbeRoot, RecordReader

PROBED_KINDS = ("python", "module")   # torch runs them as `python -u [-m] X`: a fresh interpreter, LOCAL_RANK set


def without_probe(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less the probe's variable, for a process of the plugin's own (the agent store): it is no worker."""
    return {k: v for k, v in environ.items() if k != ENV}


class WorkerProbes:
    def __init__(self, local_world_size: int) -> None:
        self._root = ProbeRoot()
        self._ranks = local_world_size
        self._path_before: str | None = None   # torchrun's own PYTHONPATH, restored at close
        self._armed = False

    def arm(self) -> None:
        """Fresh records for the workers torch starts next, and the environment they inherit from torchrun."""
        files = [self._root.files(rank) for rank in range(self._ranks)]
        for f in files:
            f.create()
        if not self._armed:
            self._armed, self._path_before = True, os.environ.get("PYTHONPATH")
            path = self._path_before
            os.environ["PYTHONPATH"] = BOOT_DIR + (os.pathsep + path if path else "")
        record = os.path.join(os.path.dirname(files[0].record), f"{RANK_FIELD}.progress")
        os.environ[ENV] = ProbeFiles(record, "").env()

    def failed_at_start(self, local_rank: int) -> bool:
        """What local rank `local_rank`'s probe says of the round just stopped (False: no record, or none of it)."""
        if not self._armed or not 0 <= local_rank < self._ranks:
            return False
        try:
            reader = RecordReader(self._root.files(local_rank).record)
        except (OSError, ValueError):
            return False
        try:
            return failed_at_start(reader.read(None, time.time()))
        except BadRecord:
            return False
        finally:
            reader.close()

    def close(self) -> None:
        """torchrun's environment as it was (a launcher in a tool's own process goes on), and the records gone."""
        if self._armed:
            self._armed = False
            os.environ.pop(ENV, None)
            if self._path_before is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = self._path_before
        self._root.close()
