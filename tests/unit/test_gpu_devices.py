"""Which GPU each local rank uses (node_agent/gpu/devices.py): CUDA_VISIBLE_DEVICES read as CUDA reads it,
the first nproc GPUs, --virtual-local-rank, and the GPU list without NVML."""
from __future__ import annotations

from pathlib import Path

from node_agent.gpu.devices import Visible, gpu_numa_nodes, gpus_from_sysfs, rank_gpus, visible_gpus
from node_agent.gpu.nvml import GpuInfo
from tests.gpu_fakes import FakeGpuReader

GPUS = FakeGpuReader.with_gpus(4).gpus          # bus ids 0000:1b..1e:00.0, UUIDs GPU-0000000i-...


def entries(v: Visible) -> list[int | None]:
    return [g.gpu.index if g.gpu is not None else None for g in v.gpus]


def test_unset_shows_every_gpu_in_pci_order_whatever_nvml_s_order():
    shuffled = [GPUS[2], GPUS[0], GPUS[3], GPUS[1]]
    v = visible_gpus(shuffled, None)
    assert entries(v) == [0, 1, 2, 3] and [g.ordinal for g in v.gpus] == [0, 1, 2, 3] and v.notes == ()


def test_ordinals_pick_and_reorder_gpus():
    v = visible_gpus(GPUS, "2, 0,3")
    assert entries(v) == [2, 0, 3] and [g.entry for g in v.gpus] == ["2", "0", "3"] and v.notes == ()


def test_an_ordinal_is_read_like_strtoul():
    assert entries(visible_gpus(GPUS, "1gpu2,+3")) == [1, 3]


def test_the_first_invalid_entry_ends_the_list():
    for value, stop in (("0,1,-1,2", "'-1'"), ("0,1,x,2", "'x'"), ("1,9,2", "'9': only 4 GPUs")):
        v = visible_gpus(GPUS, value)
        assert len(v.gpus) == (1 if value.startswith("1,9") else 2), value
        [note] = v.notes
        assert stop in note and "CUDA stops at entry" in note, note


def test_empty_shows_no_gpu():
    v = visible_gpus(GPUS, "")
    assert v.gpus == () and "0 GPUs visible" in v.notes[0]


def test_a_gpu_named_twice_leaves_none_as_cuda_does():
    for value in ("1,1", "0,GPU-00000000"):
        v = visible_gpus(GPUS, value)
        assert v.gpus == () and "twice" in v.notes[0], value


def test_uuids_and_unique_prefixes_resolve():
    v = visible_gpus(GPUS, "GPU-00000003-1111-2222-3333-444444444444,gpu-00000001,2")
    assert entries(v) == [3, 1, 2] and v.notes == ()


def test_an_ambiguous_or_unknown_uuid_ends_the_list():
    v = visible_gpus(GPUS, "GPU-00000002,GPU-0000000")
    assert entries(v) == [2] and "a prefix of several GPUs' UUIDs" in v.notes[0]
    v = visible_gpus(GPUS, "GPU-ffff")
    assert v.gpus == () and "no GPU has this UUID" in v.notes[0]


def test_mig_instances_resolve_to_their_parent_gpu():
    gpus = [GpuInfo(0, "GPU-aaaa", "0000:1b:00.0", "A100", mig_uuids=("MIG-1111", "MIG-2222")),
            GpuInfo(1, "GPU-bbbb", "0000:1c:00.0", "A100", mig_uuids=("MIG-3333",))]
    v = visible_gpus(gpus, "MIG-3333,MIG-GPU-aaaa/1/0,MIG-2222")
    assert entries(v) == [1, 0, 0] and [g.entry for g in v.gpus] == ["MIG-3333", "MIG-GPU-aaaa/1/0", "MIG-2222"]
    # Two instances of one GPU: checked once.
    assert rank_gpus(v, 3).nvml_indices() == [1, 0]


def test_an_unknown_mig_instance_is_kept_unresolved_with_a_note():
    v = visible_gpus(GPUS, "MIG-9999,0")
    assert entries(v) == [None, 0]
    assert "no NVML device for 'MIG-9999'" in v.notes[0]


def test_without_nvml_ordinals_are_kept_unresolved_and_uuids_end_the_list():
    assert entries(visible_gpus(None, "0,1")) == [None, None]
    v = visible_gpus(None, "GPU-1234")
    assert v.gpus == () and "UUIDs are unknown (no NVML)" in v.notes[0]
    v = visible_gpus(None, None)
    assert v.gpus == () and "unknown" in v.notes[0]


def test_mixed_models_without_pci_bus_id_order_get_a_note():
    gpus = [GpuInfo(0, "GPU-a", "0000:1b:00.0", "NVIDIA A100"), GpuInfo(1, "GPU-b", "0000:1c:00.0", "NVIDIA L4")]
    [note] = visible_gpus(gpus, None).notes
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in note and "NVIDIA A100, NVIDIA L4" in note
    assert visible_gpus(gpus, None, "PCI_BUS_ID").notes == ()
    assert visible_gpus(gpus, "GPU-b,GPU-a").notes == ()          # UUIDs name GPUs whatever the order


def test_the_first_nproc_gpus_go_to_the_local_ranks():
    v = visible_gpus(GPUS, "3,2,1,0")
    ranks = rank_gpus(v, 2)
    assert [r.gpu.entry if r.gpu else None for r in ranks.ranks] == ["3", "2"]
    assert ranks.nvml_indices() == [3, 2] and ranks.warning is None


def test_more_workers_than_gpus_is_one_warning_naming_both_numbers():
    ranks = rank_gpus(visible_gpus(GPUS, None), 8)
    assert ranks.warning == "8 workers but 4 GPUs visible: local ranks 4-7 have no GPU of their own"
    assert [r.gpu is None for r in ranks.ranks] == [False] * 4 + [True] * 4
    assert ranks.nvml_indices() == [0, 1, 2, 3]
    assert rank_gpus(visible_gpus(GPUS, ""), 2).warning is None        # no GPU at all: CPU workers


def put(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text + "\n")


def test_numa_nodes_of_the_visible_gpus_come_from_sysfs(tmp_path):
    put(tmp_path, "sys/bus/pci/devices/0000:1b:00.0/numa_node", "0")
    put(tmp_path, "sys/bus/pci/devices/0000:1c:00.0/numa_node", "-1")
    put(tmp_path, "sys/bus/pci/devices/0000:1e:00.0/numa_node", "1")
    v = visible_gpus(GPUS, "3,1,0,2,MIG-x")
    assert gpu_numa_nodes(v, str(tmp_path)) == [1, None, 0, None, None]


def test_gpus_from_sysfs_only_when_the_device_nodes_agree(tmp_path):
    for i, bus in enumerate(("0000:3b:00.0", "0000:1b:00.0")):
        put(tmp_path, f"sys/bus/pci/devices/{bus}/vendor", "0x10de")
        put(tmp_path, f"sys/bus/pci/devices/{bus}/class", "0x030200")
        put(tmp_path, f"dev/nvidia{i}", "")
    put(tmp_path, "dev/nvidiactl", "")
    found = gpus_from_sysfs(str(tmp_path), str(tmp_path / "dev"))
    assert found is not None and [(g.index, g.bus_id, g.uuid) for g in found] == [
        (0, "0000:1b:00.0", ""), (1, "0000:3b:00.0", "")]
    (tmp_path / "dev/nvidia1").unlink()          # a container given one of the host's two GPUs
    assert gpus_from_sysfs(str(tmp_path), str(tmp_path / "dev")) is None
