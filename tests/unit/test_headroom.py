"""How much memory a snapshot written beside the last one may take (node_agent/training/headroom.py): the least
any memory cgroup the process is in, or any above it, leaves (a review: only the leaf of cgroup v2 was read, so a
limit on a v1 host or on a parent group, a Slurm step's or a pod's, went unseen and a worker was OOM-killed)."""
from __future__ import annotations

from pathlib import Path

from node_agent.training import headroom


def put(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text + "\n")


def test_a_limit_above_the_process_s_own_group_counts_on_v1_and_v2(tmp_path) -> None:
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    put(v1 / "slurm" / "job", memory_limit_in_bytes=str(200 << 20), memory_usage_in_bytes=str(100 << 20))
    put(v1 / "slurm" / "job" / "step", memory_limit_in_bytes=str(9223372036854771712),   # v1's "none"
        memory_usage_in_bytes=str(50 << 20))
    put(v2 / "pod", memory_max=str(300 << 20), memory_high=str(250 << 20), memory_current=str(10 << 20))
    put(v2 / "pod" / "box", memory_max="max", memory_current=str(5 << 20))
    groups = tmp_path / "cgroup"
    groups.write_text("4:memory:/slurm/job/step\n3:cpu:/elsewhere\n0::/pod/box\n")
    found = headroom.cgroup_limits(str(groups), ((str(v2),), ("memory.max", "memory.high"), "memory.current"),
                                   ((str(v1),), ("memory.limit_in_bytes",), "memory.usage_in_bytes"))
    assert sorted(found) == sorted([(200 << 20, 100 << 20), (300 << 20, 10 << 20), (250 << 20, 10 << 20)])


def test_no_cgroup_to_read_leaves_the_kernel_s_figure(tmp_path) -> None:
    assert headroom.cgroup_limits(str(tmp_path / "missing")) == []
    free = headroom.free_memory()
    assert free is None or free > 0
