"""How much memory a snapshot written beside the last one may take (node_agent/training/headroom.py): the least
any memory cgroup the process is in, or any above it, leaves (a review: only the leaf of cgroup v2 was read, so a
limit on a v1 host or on a parent group, a Slurm step's or a pod's, went unseen and a worker was OOM-killed)."""
from __future__ import annotations

import os
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
    room = headroom.memory_room()
    assert room and all(0 < free <= total for free, total in room[:1]), room      # the kernel's figures


class FakeStat:
    f_frsize = 4096
    f_blocks = 1000            # 4,096,000 bytes in all
    f_bavail = 500             # 2,048,000 free


def test_room_beside_leaves_a_quarter_of_the_file_system_and_counts_what_the_drops_give_back(tmp_path,
                                                                                            monkeypatch) -> None:
    """A review: /dev/shm was held at 9 MB free of 110 (a peer's copy refused, another program's write failed), and
    a rank's own drops were not counted, so every other save found no room and dropped its only snapshot first."""
    monkeypatch.setattr(headroom.os, "statvfs", lambda where: FakeStat)
    monkeypatch.setattr(headroom, "memory_room", lambda: [])
    monkeypatch.setenv(headroom.LOCAL_RANKS_VAR, "2")
    # 2 ranks x 500,000 leaves 1,048,000 of 4,096,000: past the quarter; 2 x 600,000 does not
    assert headroom.room_beside(str(tmp_path), 500_000)
    assert not headroom.room_beside(str(tmp_path), 600_000)
    assert headroom.room_beside(str(tmp_path), 600_000, freed=100_000)
    monkeypatch.setattr(headroom, "memory_room", lambda: [(10_000_000, 50_000_000), (1_400_000, 2_000_000)])
    assert headroom.room_beside(str(tmp_path), 500_000)       # 400,000 of 2,000,000 left: a tenth and more
    assert not headroom.room_beside(str(tmp_path), 650_000, freed=100_000)   # 300,000: past the reserve


def test_what_a_drop_gives_back_is_a_file_of_one_name_no_mapping_holds(tmp_path) -> None:
    import mmap
    alone, linked, mapped = (tmp_path / n for n in ("alone", "linked", "mapped"))
    for f in (alone, linked, mapped):
        f.write_bytes(b"x" * 8192)
    os.link(linked, tmp_path / "second-name")
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 8192):
        assert headroom.freed_by([str(alone), str(linked), str(mapped), str(tmp_path / "gone")]) == 8192
        own = {os.stat(mapped).st_ino}              # a capture's own file: unmapped as it is dropped (a review)
        assert headroom.freed_by([str(alone), str(mapped)], own) == 2 * 8192
