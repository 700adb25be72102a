"""The node's CPU topology from sysfs (every path under one root, for tests' fake trees), and torchrun's
`--numa-binding` modes planned per local rank, purely, as in torch 2.13's `torch.numa.binding` (local rank r
uses the r-th visible GPU; CPUs only, always within the agent's own affinity):
- node: the CPUs of the GPU's NUMA node. socket: those of every NUMA node on that node's socket.
- exclusive: the node's physical cores (each with all its usable SMT siblings) by lowest CPU, cut into one
  contiguous slice per GPU on the node in index order; the lowest-indexed GPUs get the cores left over.
- core-complex: the node's CPUs grouped by shared last-level cache (highest Data or Unified), largest group
  first, then lowest CPU; the k-th GPU on the node gets group k modulo the number of groups.
Where torch raises (no CPUs left, fewer cores than GPUs, no cache facts) the rank runs unbound, with a reason;
so does a GPU with `numa_node` -1 on a machine of several nodes (torch pretends node 0; on one node, so do we).
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

NODE_DIR = "sys/devices/system/node"
CPU_DIR = "sys/devices/system/cpu"
PCI_DIR = "sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"
_T = TypeVar("_T")


class BindMode(str, Enum):
    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"


def parse_bind_mode(text: str) -> BindMode:
    """`--numa-binding`'s value (torchrun's spellings, exactly); ValueError naming the modes otherwise."""
    try:
        return BindMode(text)
    except ValueError:
        raise ValueError(f"expected one of {', '.join(m.value for m in BindMode)}; got {text!r}") from None


def parse_cpu_list(text: str) -> frozenset[int]:
    """sysfs's list form ("0-3,8,10-11", maybe empty) -> the numbers. ValueError on anything else."""
    out: set[int] = set()
    for item in (i.strip() for i in text.split(",") if i.strip()):
        lo, sep, hi = item.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {item!r}")
        out.update(range(first, last + 1))
    return frozenset(out)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The numbers in sysfs's list form, ranges joined: {0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []       # [first, last] of each run of consecutive numbers
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


_BUS_ID = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


def normalize_bus_id(text: str) -> str:
    """A PCI address as sysfs names it: NVML's "00000000:3B:00.0" -> "0000:3b:00.0"."""
    m = _BUS_ID.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a PCI address: {text!r}")
    domain, bus, device, function = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


@dataclass(frozen=True)
class CpuFacts:
    """One logical CPU: its socket, its physical core and its last-level cache, each named by the lowest
    CPU number sharing it (torch's choice of key), None where sysfs does not say."""
    socket: int | None = None
    core: int | None = None
    cache: int | None = None


@dataclass(frozen=True)
class Topology:
    nodes: Mapping[int, frozenset[int]]          # online NUMA node -> its CPUs (empty for memory-only)
    cpus: Mapping[int, CpuFacts]


def listdir(path: str) -> list[str]:
    """The names in directory `path`; none when it cannot be read (no such directory, no sysfs)."""
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read(root: str, *parts: str) -> str | None:
    try:
        with open(os.path.join(root, *parts)) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _read_as(parse: Callable[[str], _T], root: str, *parts: str) -> _T | None:
    """A sysfs file read with `parse` (int, parse_cpu_list); None when missing or not in that form."""
    text = _read(root, *parts)
    try:
        return parse(text) if text is not None else None
    except ValueError:
        return None


def _last_level_cache(root: str, cpu: int) -> frozenset[int] | None:
    """The CPUs sharing `cpu`'s highest-level Data or Unified cache (instruction caches do not count)."""
    cache_dir = os.path.join(root, CPU_DIR, f"cpu{cpu}", "cache")
    best: tuple[int, frozenset[int]] | None = None
    for entry in listdir(cache_dir):
        if not re.fullmatch(r"index\d+", entry):
            continue
        kind = _read(cache_dir, entry, "type")
        level = _read_as(int, cache_dir, entry, "level")
        shared = _read_as(parse_cpu_list, cache_dir, entry, "shared_cpu_list")
        if kind is None or kind.strip() not in ("Data", "Unified") or level is None or not shared:
            continue
        if best is None or level > best[0]:
            best = (level, shared)
    return best[1] if best is not None else None


def read_topology(root: str = "/", mode: BindMode | None = None) -> Topology:
    """NUMA nodes and, for their CPUs, what `mode` needs (everything when None). A machine without
    /sys/devices/system/node gives no nodes; a missing per-CPU file leaves that fact None."""
    nodes: dict[int, frozenset[int]] = {}
    for name in listdir(os.path.join(root, NODE_DIR)):
        m = re.fullmatch(r"node(\d+)", name)
        if m is not None:
            cpus = _read_as(parse_cpu_list, root, NODE_DIR, name, "cpulist")
            if cpus is not None:
                nodes[int(m.group(1))] = cpus
    facts: dict[int, CpuFacts] = {}
    for cpu in sorted(set().union(*nodes.values())):
        topo = os.path.join(CPU_DIR, f"cpu{cpu}", "topology")
        socket = core = cache = None
        if mode in (None, BindMode.SOCKET):
            socket = _read_as(int, root, topo, "physical_package_id")
        if mode in (None, BindMode.EXCLUSIVE):
            siblings = (_read_as(parse_cpu_list, root, topo, "thread_siblings_list")
                        or _read_as(parse_cpu_list, root, topo, "core_cpus_list"))
            core = min(siblings) if siblings else None
        if mode in (None, BindMode.CORE_COMPLEX):
            shared = _last_level_cache(root, cpu)
            cache = min(shared) if shared else None
        facts[cpu] = CpuFacts(socket=socket, core=core, cache=cache)
    return Topology(nodes=nodes, cpus=facts)


def gpu_numa_node(root: str, bus_id: str) -> int | None:
    """The NUMA node sysfs gives a PCI device; None when unknown (-1, no such device, no file)."""
    node = _read_as(int, root, PCI_DIR, normalize_bus_id(bus_id), "numa_node")
    return node if node is not None and node >= 0 else None


def pci_gpus(root: str = "/") -> list[str]:
    """NVIDIA display-class PCI devices (class 0x03xxxx: not NVSwitches) in PCI order. A container may see the
    host's whole PCI tree: the caller checks the count against the GPUs it may use."""
    found = []
    for name in listdir(os.path.join(root, PCI_DIR)):
        vendor, klass = ((_read(root, PCI_DIR, name, fact) or "").strip().lower() for fact in ("vendor", "class"))
        if vendor == NVIDIA_VENDOR and klass.startswith("0x03"):
            with contextlib.suppress(ValueError):
                found.append(normalize_bus_id(name))
    return sorted(found)


@dataclass(frozen=True)
class Bound:
    local_rank: int
    numa_node: int
    cpus: frozenset[int]

    def describe(self, mode: BindMode) -> str:
        return (f"local rank {self.local_rank}: NUMA node {self.numa_node}, CPUs {format_cpu_list(self.cpus)}"
                f" ({mode.value})")


@dataclass(frozen=True)
class Unbound:
    local_rank: int
    reason: str


@dataclass(frozen=True)
class BindingPlan:
    mode: BindMode
    ranks: tuple[Bound | Unbound, ...]

    def affinity(self) -> dict[int, frozenset[int]]:
        """The CPUs to pin each bound local rank's worker to (a rank not named runs unbound)."""
        return {r.local_rank: r.cpus for r in self.ranks if isinstance(r, Bound)}

    def warnings(self) -> list[str]:
        """One line per distinct reason some ranks run unbound, naming those ranks."""
        by_reason: dict[str, list[int]] = {}
        for r in self.ranks:
            if isinstance(r, Unbound):
                by_reason.setdefault(r.reason, []).append(r.local_rank)
        return [f"--numa-binding {self.mode.value}: local rank{'s' if len(ranks) > 1 else ''} "
                f"{format_cpu_list(ranks)} unbound: {reason}" for reason, ranks in by_reason.items()]


def plan_binding(topology: Topology, mode: BindMode, gpu_nodes: Sequence[int | None], nproc: int,
                 allowed: AbstractSet[int]) -> BindingPlan:
    """Per local rank 0..nproc-1 the CPUs `mode` gives it. `gpu_nodes[i]`: the i-th visible GPU's NUMA node
    (None: unknown); `allowed`: the agent's own affinity."""
    if not topology.nodes:
        reason = "no NUMA information (no /sys/devices/system/node/node*/cpulist)"
        return BindingPlan(mode, tuple(Unbound(r, reason) for r in range(nproc)))
    only = next(iter(topology.nodes)) if len(topology.nodes) == 1 else None
    resolved = [node if node is not None else only for node in gpu_nodes]
    ranks: list[Bound | Unbound] = []
    for rank in range(nproc):
        node = resolved[rank] if rank < len(resolved) else None
        if rank >= len(resolved):
            ranks.append(Unbound(rank, f"no GPU of its own ({len(resolved)} visible)"))
        elif node is None:
            ranks.append(Unbound(rank, f"its GPU's NUMA node is unknown (numa_node -1 on a machine with "
                                       f"{len(topology.nodes)} NUMA nodes)"))
        elif node not in topology.nodes:
            ranks.append(Unbound(rank, f"its GPU is on NUMA node {node}, which sysfs does not list"))
        else:
            peers = [i for i, n in enumerate(resolved) if n == node]
            found = _cpus_for(topology, mode, node, peers.index(rank), len(peers), allowed)
            ranks.append(Bound(rank, node, found) if isinstance(found, frozenset) else Unbound(rank, found))
    return BindingPlan(mode, tuple(ranks))


def _cpus_for(topo: Topology, mode: BindMode, node: int, position: int, peers: int,
              allowed: AbstractSet[int]) -> frozenset[int] | str:
    """The CPU set for the GPU that is `position`-th of `peers` GPUs on `node`, or why there is none."""
    where, cpus = f"NUMA node {node}", topo.nodes[node]
    if mode is BindMode.SOCKET:
        socket = _socket(topo, node)
        if socket is None:
            return f"sysfs gives no socket (physical_package_id) for NUMA node {node}'s CPUs"
        where = f"socket {socket}"
        cpus = frozenset().union(*(c for n, c in topo.nodes.items() if _socket(topo, n) == socket))
    usable = cpus & allowed
    if not usable:
        return f"none of {where}'s CPUs ({format_cpu_list(cpus) or 'none'}) is in the agent's affinity " \
               f"({format_cpu_list(allowed)})"
    if mode is BindMode.EXCLUSIVE:
        return _exclusive(topo, node, usable, position, peers)
    if mode is BindMode.CORE_COMPLEX:
        return _core_complex(topo, node, usable, position)
    return usable


def _socket(topo: Topology, node: int) -> int | None:
    """A NUMA node's socket, by its lowest CPU (torch takes the lowest allowed one: the same socket)."""
    cpus = topo.nodes.get(node)
    if not cpus:
        return None
    facts = topo.cpus.get(min(cpus))
    return facts.socket if facts is not None else None


def _groups(topo: Topology, usable: frozenset[int], key: str) -> dict[int, set[int]] | None:
    out: dict[int, set[int]] = {}
    for cpu in usable:
        facts = topo.cpus.get(cpu)
        value = getattr(facts, key) if facts is not None else None
        if value is None:
            return None
        out.setdefault(value, set()).add(cpu)
    return out


def _exclusive(topo: Topology, node: int, usable: frozenset[int], position: int, peers: int) -> frozenset[int] | str:
    cores = _groups(topo, usable, "core")
    if cores is None:
        return "sysfs gives no core siblings for its NUMA node's CPUs"
    ordered = [cores[k] for k in sorted(cores)]
    each, extra = divmod(len(ordered), peers)
    if each < 1:
        return f"NUMA node {node} has {len(ordered)} usable physical cores for its {peers} GPUs"
    start = position * each + min(position, extra)
    end = start + each + (1 if position < extra else 0)
    return frozenset().union(*ordered[start:end])


def _core_complex(topo: Topology, node: int, usable: frozenset[int], position: int) -> frozenset[int] | str:
    caches = _groups(topo, usable, "cache")
    if caches is None:
        return f"sysfs gives no last-level cache (cache/index*/shared_cpu_list) for NUMA node {node}'s CPUs"
    ordered = sorted(caches.items(), key=lambda item: (-len(item[1]), item[0]))
    return frozenset(ordered[position % len(ordered)][1])
