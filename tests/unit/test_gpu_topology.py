"""NUMA binding from a fake sysfs tree (node_agent/gpu/topology.py): each mode's CPU sets written by hand,
then the same trees given to torch 2.13's own torch.numa.binding and compared, rank by rank."""
from __future__ import annotations

import os
import tempfile
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.gpu.topology import (
    BindMode,
    Bound,
    Unbound,
    format_cpu_list,
    gpu_numa_node,
    normalize_bus_id,
    parse_bind_mode,
    parse_cpu_list,
    pci_gpus,
    plan_binding,
    read_topology,
)


def put(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_machine(root: Path, *, nodes: Mapping[int, Iterable[int]], socket: Mapping[int, int],
                  siblings: Mapping[int, Iterable[int]], l3: Mapping[int, Iterable[int]] | None,
                  gpus: Mapping[str, int], sibling_file: str = "thread_siblings_list") -> None:
    """A sysfs tree: NUMA nodes with their CPUs, each CPU's socket, SMT siblings and caches (L1d, L1i,
    L2 private to the core, L3 as given), and NVIDIA GPUs (bus id -> numa_node, -1 allowed)."""
    put(root, "sys/devices/system/node/possible", format_cpu_list(nodes))
    for node, cpus in nodes.items():
        put(root, f"sys/devices/system/node/node{node}/cpulist", format_cpu_list(cpus))
    for cpu, package in socket.items():
        base = f"sys/devices/system/cpu/cpu{cpu}"
        put(root, f"{base}/topology/physical_package_id", str(package))
        put(root, f"{base}/topology/{sibling_file}", format_cpu_list(siblings[cpu]))
        if l3 is None:
            continue
        core = format_cpu_list(siblings[cpu])
        # index1 is an instruction cache shared oddly: it must never be taken for the last level.
        for index, (kind, level, shared) in enumerate([("Data", 1, core), ("Instruction", 1, "0-4095"),
                                                       ("Unified", 2, core), ("Unified", 3, format_cpu_list(l3[cpu]))]):
            put(root, f"{base}/cache/index{index}/type", kind)
            put(root, f"{base}/cache/index{index}/level", str(level))
            put(root, f"{base}/cache/index{index}/shared_cpu_list", shared)
    for bus_id, node in gpus.items():
        put(root, f"sys/bus/pci/devices/{bus_id}/numa_node", str(node))
        put(root, f"sys/bus/pci/devices/{bus_id}/vendor", "0x10de")
        put(root, f"sys/bus/pci/devices/{bus_id}/class", "0x030200")


def cpus(text: str) -> frozenset[int]:
    return parse_cpu_list(text)


# 2 sockets, 4 NUMA nodes of 8 cores, SMT 2 (CPU c and c+32 share a core), an L3 per 4 cores,
# 8 GPUs, two per node.
GPUS = {"0000:18:00.0": 0, "0000:2a:00.0": 0, "0000:3a:00.0": 1, "0000:5d:00.0": 1,
        "0000:9a:00.0": 2, "0000:ab:00.0": 2, "0000:ba:00.0": 3, "0000:db:00.0": 3}
BUS_IDS = list(GPUS)
ALL = frozenset(range(64))


NODES = {n: [*range(8 * n, 8 * n + 8), *range(32 + 8 * n, 40 + 8 * n)] for n in range(4)}
SOCKET = {c: (c % 32) // 16 for c in range(64)}


def l3_of(cpu: int) -> list[int]:
    first = cpu % 32 // 4 * 4           # the first core of its group of 4
    return [*range(first, first + 4), *range(32 + first, 36 + first)]


def big_machine(root: Path, gpus: Mapping[str, int] = GPUS, **kw: Any) -> None:
    write_machine(root, nodes=NODES, socket=SOCKET, siblings={c: [c % 32, c % 32 + 32] for c in range(64)},
                  l3={c: l3_of(c) for c in range(64)}, gpus=gpus, **kw)


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The big machine, written once for the tests that read it as it is."""
    root = tmp_path_factory.mktemp("sysfs")
    big_machine(root)
    return root


def plan(root: Path, mode: BindMode, nproc: int = 8, allowed: frozenset[int] = ALL,
         bus_ids: list[str] = BUS_IDS) -> list[Bound | Unbound]:
    topo = read_topology(str(root), mode)
    return list(plan_binding(topo, mode, [gpu_numa_node(str(root), b) for b in bus_ids], nproc, allowed).ranks)


def sets(found: list[Bound | Unbound]) -> list[frozenset[int] | None]:
    return [r.cpus if isinstance(r, Bound) else None for r in found]


def test_cpu_lists_and_bus_ids_parse_and_print():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == frozenset()
    assert format_cpu_list({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("3b:00.0") == "0000:3b:00.0"
    for bad in ("0-", "3-1", "x"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    with pytest.raises(ValueError):
        normalize_bus_id("GPU-1234")


def test_modes_are_torchrun_s_and_an_unknown_one_is_refused_with_the_list():
    assert [parse_bind_mode(m) for m in ("node", "socket", "exclusive", "core-complex")] == list(BindMode)
    for bad in ("core_complex", "NODE", ""):
        with pytest.raises(ValueError, match="expected one of node, socket, exclusive, core-complex; got"):
            parse_bind_mode(bad)


def test_node_mode_gives_the_numa_node_of_each_rank_s_gpu(machine):
    assert sets(plan(machine, BindMode.NODE)) == [
        cpus("0-7,32-39"), cpus("0-7,32-39"), cpus("8-15,40-47"), cpus("8-15,40-47"),
        cpus("16-23,48-55"), cpus("16-23,48-55"), cpus("24-31,56-63"), cpus("24-31,56-63")]


def test_socket_mode_gives_every_numa_node_of_the_socket(machine):
    assert sets(plan(machine, BindMode.SOCKET)) == [cpus("0-15,32-47")] * 4 + [cpus("16-31,48-63")] * 4


def test_exclusive_splits_the_node_s_whole_cores_among_its_gpus(machine):
    assert sets(plan(machine, BindMode.EXCLUSIVE, nproc=4)) == [
        cpus("0-3,32-35"), cpus("4-7,36-39"), cpus("8-11,40-43"), cpus("12-15,44-47")]


def test_exclusive_gives_the_lower_gpus_one_core_more_when_cores_do_not_divide(tmp_path):
    big_machine(tmp_path, gpus={"0000:18:00.0": 0, "0000:19:00.0": 0, "0000:1a:00.0": 0})
    found = plan(tmp_path, BindMode.EXCLUSIVE, nproc=3, bus_ids=["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"])
    assert sets(found) == [cpus("0-2,32-34"), cpus("3-5,35-37"), cpus("6-7,38-39")]


def test_exclusive_counts_only_cores_the_agent_may_use(machine):
    allowed = ALL - {0, 32}                 # core 0 (both threads) is not ours: 7 cores for 2 GPUs
    assert sets(plan(machine, BindMode.EXCLUSIVE, nproc=2, allowed=allowed)) == [
        cpus("1-4,33-36"), cpus("5-7,37-39")]


def test_exclusive_splits_among_all_visible_gpus_on_the_node_not_only_the_used_ones(machine):
    # one worker, yet GPU 1 on node 0 keeps its half
    assert sets(plan(machine, BindMode.EXCLUSIVE, nproc=1)) == [cpus("0-3,32-35")]


def test_exclusive_with_fewer_cores_than_gpus_leaves_them_unbound(machine):
    found = plan(machine, BindMode.EXCLUSIVE, nproc=2, allowed=cpus("0,32,8-15"))
    assert all(isinstance(r, Unbound) and "1 usable physical cores for its 2 GPUs" in r.reason for r in found)


def test_core_complex_gives_each_gpu_of_a_node_its_own_l3(machine):
    assert sets(plan(machine, BindMode.CORE_COMPLEX, nproc=4)) == [
        cpus("0-3,32-35"), cpus("4-7,36-39"), cpus("8-11,40-43"), cpus("12-15,44-47")]


def test_core_complex_prefers_the_l3_with_more_usable_cpus_then_the_lower_cpu(machine):
    allowed = ALL - {0, 32}                 # the first L3 of node 0 has 6 usable CPUs, the second 8
    assert sets(plan(machine, BindMode.CORE_COMPLEX, nproc=2, allowed=allowed)) == [
        cpus("4-7,36-39"), cpus("1-3,33-35")]


def test_core_complex_wraps_around_when_a_node_has_more_gpus_than_l3s(tmp_path):
    three = {"0000:18:00.0": 0, "0000:19:00.0": 0, "0000:1a:00.0": 0}
    big_machine(tmp_path, gpus=three)
    assert sets(plan(tmp_path, BindMode.CORE_COMPLEX, nproc=3, bus_ids=list(three))) == [
        cpus("0-3,32-35"), cpus("4-7,36-39"), cpus("0-3,32-35")]


def test_core_complex_without_cache_information_runs_unbound(tmp_path):
    write_machine(tmp_path, nodes={0: range(4)}, socket=dict.fromkeys(range(4), 0),
                  siblings={c: [c] for c in range(4)}, l3=None, gpus={"0000:18:00.0": 0})
    [found] = plan(tmp_path, BindMode.CORE_COMPLEX, nproc=1, bus_ids=["0000:18:00.0"])
    assert isinstance(found, Unbound) and "last-level cache" in found.reason


def test_core_siblings_come_from_core_cpus_list_when_thread_siblings_list_is_absent(tmp_path):
    big_machine(tmp_path, sibling_file="core_cpus_list")
    assert sets(plan(tmp_path, BindMode.EXCLUSIVE, nproc=2)) == [cpus("0-3,32-35"), cpus("4-7,36-39")]


def test_every_mode_is_cut_to_the_agent_s_affinity(machine):
    allowed = cpus("0-3,8-11")              # e.g. a Slurm cgroup: 8 CPUs, no SMT siblings
    assert sets(plan(machine, BindMode.NODE, nproc=3, allowed=allowed)) == [cpus("0-3"), cpus("0-3"), cpus("8-11")]
    assert sets(plan(machine, BindMode.SOCKET, nproc=1, allowed=allowed)) == [cpus("0-3,8-11")]


def test_a_node_outside_the_agent_s_affinity_leaves_its_ranks_unbound_but_socket_mode_binds(machine):
    allowed = cpus("0-7")
    found = plan(machine, BindMode.NODE, nproc=3, allowed=allowed)
    assert sets(found)[:2] == [cpus("0-7")] * 2
    assert isinstance(found[2], Unbound) and "none of NUMA node 1's CPUs (8-15,40-47)" in found[2].reason
    assert sets(plan(machine, BindMode.SOCKET, nproc=3, allowed=allowed))[2] == cpus("0-7")


def test_a_gpu_with_numa_node_minus_one_runs_unbound_on_a_multi_node_machine(tmp_path):
    gpus = dict(GPUS)
    gpus["0000:3a:00.0"] = -1
    big_machine(tmp_path, gpus=gpus)
    found = plan(tmp_path, BindMode.NODE, nproc=4)
    assert sets(found)[:2] == [cpus("0-7,32-39")] * 2 and sets(found)[3] == cpus("8-15,40-47")
    assert isinstance(found[2], Unbound) and "numa_node -1" in found[2].reason
    # With GPU 2 unplaced, GPU 3 is node 1's only GPU: it gets all of node 1's cores.
    assert sets(plan(tmp_path, BindMode.EXCLUSIVE, nproc=4))[3] == cpus("8-15,40-47")


def test_numa_node_minus_one_on_a_one_node_machine_means_that_node(tmp_path):
    write_machine(tmp_path, nodes={0: range(4)}, socket=dict.fromkeys(range(4), 0),
                  siblings={c: [c] for c in range(4)}, l3={c: range(4) for c in range(4)},
                  gpus={"0000:18:00.0": -1, "0000:19:00.0": -1})
    found = plan(tmp_path, BindMode.EXCLUSIVE, nproc=2, bus_ids=["0000:18:00.0", "0000:19:00.0"])
    assert sets(found) == [cpus("0-1"), cpus("2-3")]


def test_a_machine_without_numa_information_runs_every_rank_unbound_with_one_warning(tmp_path):
    put(tmp_path, "sys/devices/system/cpu/cpu0/topology/physical_package_id", "0")
    put(tmp_path, "sys/bus/pci/devices/0000:18:00.0/numa_node", "-1")
    for mode in BindMode:
        result = plan_binding(read_topology(str(tmp_path), mode), mode, [None], 2, ALL)
        assert [r.local_rank for r in result.ranks if isinstance(r, Unbound)] == [0, 1]
        assert result.affinity() == {}
        [warning] = result.warnings()
        assert warning.startswith(f"--numa-binding {mode.value}: local ranks 0-1 unbound: no NUMA information")


def test_ranks_beyond_the_visible_gpus_run_unbound(machine):
    result = plan_binding(read_topology(str(machine)), BindMode.NODE, [0, 1], 4, ALL)
    assert result.affinity() == {0: cpus("0-7,32-39"), 1: cpus("8-15,40-47")}
    assert result.warnings() == ["--numa-binding node: local ranks 2-3 unbound: no GPU of its own (2 visible)"]
    assert isinstance(result.ranks[0], Bound)
    assert result.ranks[0].describe(BindMode.NODE) == "local rank 0: NUMA node 0, CPUs 0-7,32-39 (node)"


def test_unknown_pci_devices_and_the_gpu_list_from_sysfs(tmp_path):
    write_machine(tmp_path, nodes={}, socket={}, siblings={}, l3=None, gpus={"0000:9a:00.0": 2, "0000:18:00.0": 0})
    put(tmp_path, "sys/bus/pci/devices/0000:05:00.0/vendor", "0x10de")    # an NVSwitch: a bridge, not a GPU
    put(tmp_path, "sys/bus/pci/devices/0000:05:00.0/class", "0x068000")
    put(tmp_path, "sys/bus/pci/devices/0000:06:00.0/vendor", "0x8086")
    put(tmp_path, "sys/bus/pci/devices/0000:06:00.0/class", "0x030000")
    assert pci_gpus(str(tmp_path)) == ["0000:18:00.0", "0000:9a:00.0"]
    assert gpu_numa_node(str(tmp_path), "00000000:9A:00.0") == 2
    assert gpu_numa_node(str(tmp_path), "0000:77:00.0") is None
    assert pci_gpus(str(tmp_path / "nothing")) == []


# torch's own implementation, pointed at the same fake tree: its sysfs reads go under the root, its
# CUDA device list and the thread affinity come from the test.
binding = pytest.importorskip("torch.numa.binding")


def torch_sets(monkeypatch: pytest.MonkeyPatch, root: Path, mode: BindMode, bus_ids: list[str],
               allowed: frozenset[int]) -> list[frozenset[int] | None]:
    def under(path: str) -> str:
        return str(root / path.lstrip("/")) if path.startswith("/sys/") else path

    fake_os = types.SimpleNamespace(listdir=lambda p: os.listdir(under(p)), path=os.path,
                                    sched_getaffinity=lambda pid: set(allowed))

    def props(index: int) -> types.SimpleNamespace:
        domain, bus, rest = bus_ids[index].split(":")
        return types.SimpleNamespace(pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16),
                                     pci_device_id=int(rest.split(".")[0], 16))

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(device_count=lambda: len(bus_ids),
                                                                  get_device_properties=props))
    monkeypatch.setattr(binding, "open", lambda p, *a, **k: open(under(p), *a, **k), raising=False)
    monkeypatch.setattr(binding, "os", fake_os)
    monkeypatch.setattr(binding, "torch", fake_torch)
    out: list[frozenset[int] | None] = []
    for rank in range(len(bus_ids)):
        try:
            found = binding._get_logical_cpus_to_bind_to(
                gpu_index=rank, numa_options=binding.NumaOptions(affinity_mode=binding.AffinityMode(mode.value)))
            out.append(frozenset(found) if found else None)
        except Exception:                           # torch's way of saying "no binding"
            out.append(None)
    return out


def assert_as_torch(ours: list[frozenset[int] | None], theirs: list[frozenset[int] | None], mode: BindMode,
                    nodes: Mapping[int, Iterable[int]], socket: Mapping[int, int], gpu_nodes: list[int],
                    allowed: frozenset[int]) -> None:
    """Rank by rank the same, but for one documented difference: torch's socket mode fails outright when
    any NUMA node has none of the allowed CPUs (it takes min() of an empty set); ours binds to the allowed
    CPUs of the GPU's socket."""
    for rank, (mine, torch_s) in enumerate(zip(ours, theirs, strict=True)):
        if mode is BindMode.SOCKET and torch_s is None and mine is not None:
            assert any(not set(c) & allowed for c in nodes.values()), rank
            home = socket[min(nodes[gpu_nodes[rank]])]
            assert mine == frozenset().union(*(set(c) & allowed for c in nodes.values() if socket[min(c)] == home))
        else:
            assert mine == torch_s, rank


@pytest.mark.parametrize("mode", list(BindMode))
@pytest.mark.parametrize("allowed", [ALL, ALL - {0, 32}, cpus("0-3,8-11,40-47")])
def test_the_big_machine_binds_as_torch_does(machine, monkeypatch, mode, allowed):
    theirs = torch_sets(monkeypatch, machine, mode, BUS_IDS, allowed)
    ours = sets(plan(machine, mode, allowed=allowed))
    assert_as_torch(ours, theirs, mode, NODES, SOCKET, list(GPUS.values()), allowed)


@st.composite
def machines(draw: st.DrawFn) -> dict[str, Any]:
    """A random machine: sockets, NUMA nodes, cores, SMT, L3 size, shuffled CPU numbers, GPUs, affinity."""
    sockets, per_socket = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    cores, smt, per_l3 = draw(st.integers(1, 5)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    nnodes = sockets * per_socket
    total = nnodes * cores * smt
    number = draw(st.permutations(range(total)))
    nodes: dict[int, list[int]] = {n: [] for n in range(nnodes)}
    socket, siblings, l3 = {}, {}, {}
    for n in range(nnodes):
        for core in range(cores):
            threads = [number[(n * cores + core) * smt + t] for t in range(smt)]
            nodes[n].extend(threads)
            group = [number[(n * cores + c) * smt + t] for c in range(core - core % per_l3,
                                                                     min(cores, core - core % per_l3 + per_l3))
                     for t in range(smt)]
            for cpu in threads:
                socket[cpu], siblings[cpu], l3[cpu] = n // per_socket, threads, group
    gpu_nodes = draw(st.lists(st.integers(0, nnodes - 1), min_size=1, max_size=8))
    allowed = frozenset(draw(st.sets(st.sampled_from(range(total)), min_size=1)))
    return {"nodes": nodes, "socket": socket, "siblings": siblings, "l3": l3, "allowed": allowed,
            "gpus": {f"0000:{0x10 + i:02x}:00.0": n for i, n in enumerate(gpu_nodes)}}


SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None      # many small files per example


@settings(max_examples=30, deadline=None)
@given(drawn=machines(), mode=st.sampled_from(list(BindMode)))
def test_random_machines_bind_as_torch_does(drawn, mode):
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp, pytest.MonkeyPatch.context() as monkeypatch:
        root = Path(tmp)
        machine = dict(drawn)
        allowed = machine.pop("allowed")
        write_machine(root, **machine)
        bus_ids = list(machine["gpus"])
        ours = sets(plan(root, mode, nproc=len(bus_ids), allowed=allowed, bus_ids=bus_ids))
        assert_as_torch(ours, torch_sets(monkeypatch, root, mode, bus_ids, allowed), mode, machine["nodes"],
                        machine["socket"], list(machine["gpus"].values()), allowed)
