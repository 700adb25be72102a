"""The agent's checks of its own node: the shell around node_agent/gpu/ (when and what it means: core/node_health.py).
- `start()`: with /dev/nvidia* and the check on, NVML is opened once and held until exit (the check's
  handle, and the driver kept initialised between workers: docs/deploy.md); NVML missing: one warning, the
  check skipped and said so (never "healthy"). The GPU survey (ranks, --numa-binding CPU sets) is made once.
- `check(CheckNode)`: workers alive after SIGKILL, a failure naming a GPU fault, the GPUs through NVML (in
  a thread: it blocks), then --health-check (not after a failure: it would hold up every restart). The
  answer is a `NodeChecked`; nothing here raises for what the node, NVML or the script do."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from node_agent.core.actions import CheckNode
from node_agent.core.facts import NodeChecked, Stage
from node_agent.gpu import has_nvidia_devices
from node_agent.settings import CheckSettings
from protocol.messages import UnhealthyKind as Kind
from protocol.messages import WorkerFailure
from protocol.quoting import one_line

if TYPE_CHECKING:      # the GPU modules are imported where used: a CPU node's agent starts without them
    from node_agent.gpu.node import NodeGpus
    from node_agent.gpu.nvml import GpuReader

ReaderFactory = Callable[[], "GpuReader"]


class NodeChecks:
    def __init__(self, opts: CheckSettings, say: Callable[[str], None], *, reader: ReaderFactory | None = None,
                 root: str = "/", dev_dir: str = "/dev", environ: Mapping[str, str] = os.environ) -> None:
        self.opts = opts
        self._say = say
        self._make_reader = reader
        self._root, self._dev_dir, self._environ = root, dev_dir, environ
        self.gpu_node = opts.gpu_check and has_nvidia_devices(dev_dir)
        self.reader: GpuReader | None = None
        self.skipped: str | None = None        # why the GPU check is skipped on this GPU node
        self.gpus: NodeGpus | None = None
        self._lock = asyncio.Lock()             # one NVML check at a time
        self._said: set[str] = set()

    @property
    def enabled(self) -> bool:
        """Whether the node checks itself (core/node_health.py's rules apply)."""
        return self.gpu_node or self.opts.health_check is not None

    @property
    def cpu_affinity(self) -> Mapping[int, frozenset[int]]:
        return self.gpus.cpu_affinity if self.gpus is not None else {}

    def gpu_busy(self, local_rank: int) -> int | None:
        """The utilization of `local_rank`'s GPU, % (None: it has none, or NVML is not open or cannot say)."""
        if self.reader is None or self.gpus is None or local_rank >= len(self.gpus.ranks.ranks):
            return None
        gpu = self.gpus.ranks.ranks[local_rank].gpu
        if gpu is None or gpu.gpu is None:
            return None
        return self.reader.utilization(gpu.gpu.index)

    @property
    def summary(self) -> str:
        """What the node checks of itself, one short line for the server's views ("": nothing to say)."""
        gpus = "" if not self.gpu_node else f"GPU check skipped: {self.skipped}" if self.skipped is not None \
            else "GPU check on (NVML, held open)" if self.reader is not None else ""
        script = "--health-check" if self.opts.health_check is not None else ""
        return "; ".join(p for p in (gpus, script) if p)[:200]

    def start(self) -> None:
        """Open NVML where it is needed and survey the GPUs; say what the workers will get, once."""
        has_gpus = has_nvidia_devices(self._dev_dir)
        if not has_gpus and self.opts.numa_binding is None:
            return                  # a CPU node: nothing to survey (the agent's start-up stays as it was)
        from node_agent.gpu.node import survey
        from node_agent.gpu.nvml import NvmlReader, NvmlUnavailable
        if self.gpu_node or (has_gpus and self.opts.numa_binding is not None):   # --no-gpu-check: NVML only to bind
            reader = (self._make_reader or NvmlReader)()
            try:
                reader.open()
                self.reader = reader
            except NvmlUnavailable as exc:
                if self.gpu_node:
                    self.skipped = one_line(str(exc))
                    self._say(f"warning: GPU check skipped: {self.skipped}")
        self.gpus = survey(self.opts.nproc, self._environ, reader=self.reader, numa_binding=self.opts.numa_binding,
                           root=self._root, dev_dir=self._dev_dir)
        for warning in self.gpus.warnings:
            self._say(f"warning: {warning}")
        for line in self.gpus.lines:
            self._say(line)
        if self.reader is not None and not self.gpu_node:   # opened for the binding only (--no-gpu-check)
            self.close()

    def close(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None:
            reader.close()

    async def check(self, action: CheckNode, stuck: Sequence[int] = ()) -> NodeChecked:
        from node_agent.gpu.health import Healthy, Unhealthy, check_gpus, run_health_check

        def bad(problem: str, kind: Kind) -> NodeChecked:
            return NodeChecked(action.stage, action.round_id, one_line(problem), kind, action.failures)

        alive = [pid for pid in stuck if os.path.exists(f"/proc/{pid}")]   # noqa: ASYNC240 - a stat each
        if alive:
            return bad(f"worker process{'es' if len(alive) > 1 else ''} {', '.join(map(str, alive))} still alive "
                       f"after SIGKILL (uninterruptible sleep: a GPU or driver fault?)", Kind.STUCK_WORKER)
        fault = _named_fault(action.failures) if self.gpu_node else None
        if fault is not None:
            return bad(fault, Kind.GPU_FAULT)
        if self.reader is not None and self.gpus is not None:
            async with self._lock:
                verdict = await asyncio.to_thread(check_gpus, self.reader, self.gpus.ranks.nvml_indices())
            self._warn(verdict.warnings)
            if isinstance(verdict, Unhealthy):
                return bad(f"GPU check: {verdict.reason}", Kind.GPU)
            if not isinstance(verdict, Healthy):
                self._warn((f"GPU check skipped: {verdict.reason}",))
        if self.opts.health_check is not None and action.stage != Stage.FAILURE:
            script = await run_health_check(self.opts.health_check, timeout=self.opts.health_check_timeout)
            if isinstance(script, Unhealthy):
                return bad(script.reason, Kind.HEALTH_CHECK)
        return NodeChecked(action.stage, action.round_id, None, None, action.failures)

    def _warn(self, warnings: Sequence[str]) -> None:
        for warning in warnings:       # each once: a throttled GPU is not news every 5 s
            if warning not in self._said:
                self._said.add(warning)
                self._say(f"warning: {warning}")


def _named_fault(failures: Sequence[WorkerFailure]) -> str | None:
    """The first failure whose error names a GPU fault (a device-side assert is the program's own bug)."""
    from node_agent.gpu.health import classify_failure
    for f in failures:
        phrase = classify_failure(f"{f.message}\n{f.traceback}")
        if phrase is not None:
            return f"worker rank {f.rank} (local {f.local_rank}) failed with a GPU fault: {phrase}"
    return None
