"""A snapshot file as it lies in the memory directory, written and read at memory speed:

    [0, 4096)      MAGIC, then the header's offset, length and xxh3-64 (three little-endian u64; a hash of 0:
                   a file from before it, its header not checked)
    [4096, ...)    every tensor's bytes, each at a 4096-byte boundary, in the tree's order
    [header]       torch.save of {format, step, tree, table, sums}: the tree with every tensor replaced by
                   an empty placeholder, (offset, shape, dtype) per tensor, and an xxh3-64 of each tensor's bytes

The rules:
- The tensors' bytes are written where they will be read: a writer maps the file and copies into it
  (capture.py); nothing is serialised tensor by tensor. The header is read with `torch.load(weights_only=True)`,
  so a peer's file runs no code.
- A file is refused whole when its head, header or table do not hold together, its header or any tensor fails
  its hash; the reason names the tensor. The header's hash covers the plain values (a scheduler's step, the RNG
  states, the learning rate): a flipped bit there unpickles as well as the right one. xxh3 runs at memory speed
  (24 GB/s a core here, CRC-32 at 4), and the tensors' hashes are taken in parallel threads (xxhash releases the
  GIL).
- A reader's tensors lie in a private (copy-on-write) mapping of the file, each with a storage of its own:
  nothing is copied until the caller loads them, and writing to them never reaches the file."""
from __future__ import annotations

import io
import mmap
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from node_agent.training import trees

FORMAT = "node-agent-snapshot/2"
MAGIC = b"node-agent-snap2"
HEAD = struct.Struct("<16sQQQ")
ALIGN = 4096
HEADER_LIMIT = 1 << 30        # a header (tree, table, sums) past this is not ours
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
_PLACEHOLDER = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class Plan:
    """Where each tensor of a state goes in its file, and the data region's end."""
    offsets: list[int]
    nbytes: list[int]
    end: int


def plan(live: list[torch.Tensor]) -> Plan:
    offsets, sizes, at = [], [], ALIGN
    for t in live:
        n = t.numel() * t.element_size()
        offsets.append(at)
        sizes.append(n)
        at += -(-n // ALIGN) * ALIGN if n else 0
    return Plan(offsets, sizes, at)


def views(region: torch.Tensor, live: list[torch.Tensor], where: Plan) -> list[torch.Tensor]:
    """Tensors shaped like `live`'s, lying at the plan's offsets in `region` (a uint8 tensor over the file)."""
    return [region[off:off + n].view(t.dtype).view(t.shape)
            for t, off, n in zip(live, where.offsets, where.nbytes, strict=True)]


def digest(t: torch.Tensor) -> int:
    """xxh3-64 of a contiguous host tensor's bytes."""
    if t.numel() == 0:
        return 0
    return xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy().data)


def digests(tensors: list[torch.Tensor], fill: Callable[[int], object] | None = None) -> list[int]:
    """Every tensor's hash, the large ones spread over threads. `fill(i)`, where given, first writes tensor i, in
    the thread that hashes it: the copy runs in as many threads, and the hash reads bytes still in the cache."""
    def one(i: int) -> int:
        if fill is not None:
            fill(i)
        return digest(tensors[i])

    if len(tensors) < 2 or sum(t.numel() * t.element_size() for t in tensors) < (64 << 20):
        return [one(i) for i in range(len(tensors))]
    try:
        with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="node-agent hash") as pool:
            return list(pool.map(one, range(len(tensors))))
    except RuntimeError as exc:
        # The interpreter is ending (a crash right after the snapshot, the full exit): its shutdown refuses new
        # futures before it waits for the write, which would be lost for them. Hashed here, one by one.
        if "interpreter shutdown" not in str(exc):
            raise
        return [one(i) for i in range(len(tensors))]


def digest_of(sums: list[int]) -> int:
    """One 63-bit digest of tensors' hashes, in order: what replicas compare (heartbeat.digest; the wire's
    integers are signed 64-bit)."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(sums)}Q", *sums)) & (2**63 - 1)


def skeleton(tree: Any) -> Any:
    """The tree with every tensor replaced by an empty placeholder (what the header holds of it)."""
    return trees.rebuild(tree, lambda leaf: _PLACEHOLDER if isinstance(leaf, torch.Tensor) else trees.plain(leaf))


def header(step: int, shape: Any, live: list[torch.Tensor], where: Plan, sums: list[int]) -> bytes:
    """The header of the snapshot of `step`: its tree's skeleton `shape`, its tensors `live` placed by `where`."""
    table = [(off, tuple(t.shape), t.dtype) for t, off in zip(live, where.offsets, strict=True)]
    out = io.BytesIO()
    torch.save({"format": FORMAT, "step": step, "tree": shape, "table": table, "sums": sums}, out)
    return out.getvalue()


def head(header_at: int, header: bytes) -> bytes:
    return HEAD.pack(MAGIC, header_at, len(header), _header_hash(header))


def _header_hash(header: bytes) -> int:
    return xxhash.xxh3_64_intdigest(header) or 1      # never 0: a file with no hash


def read(path: str, step: int) -> dict[str, Any] | str:
    """The tree of the snapshot file at `path` (of `step`), its tensors views of a private mapping, or a line
    saying why it cannot be used."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < ALIGN:
                return f"too short for a snapshot ({size} bytes)"
            magic, at, length, hashed = HEAD.unpack(f.read(HEAD.size))
            if magic != MAGIC:
                return f"not a snapshot in the format {FORMAT} (written by another version of node-agent?)"
            if not (ALIGN <= at and 0 < length <= HEADER_LIMIT and at + length <= size):
                return f"its head points outside the file (header at {at}, {length} bytes, file {size} bytes)"
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        header = mapped[at:at + length]
        if hashed and _header_hash(header) != hashed:
            return "its header fails its checksum"
        record = torch.load(io.BytesIO(header), weights_only=True)
    except Exception as exc:  # noqa: BLE001  (any unreadable file is refused the same way)
        return f"unreadable ({type(exc).__name__}: {_one_line(str(exc))})"
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("step") != step:
        return f"not a snapshot of step {step} in the format {FORMAT}"
    return _assemble(record, mapped, at)


def _one_line(message: str) -> str:
    """An error's message as one line of at most 200 characters: torch's weights_only refusal is a page of advice
    over lines, with terminal escapes, its reason (the global it refused) last; printed whole, a refusal's line
    broke in two, escapes and all, cut before the reason (a review)."""
    reason = message.rpartition("WeightsUnpickler error:")[2]
    return " ".join(re.sub(r"\x1b\[[0-9;]*[A-Za-z]|[\x00-\x1f\x7f]", " ", reason).split())[:200]


def _assemble(record: dict[str, Any], mapped: mmap.mmap, data_end: int) -> dict[str, Any] | str:
    tree, table, sums = record.get("tree"), record.get("table"), record.get("sums")
    if not isinstance(tree, dict) or not isinstance(table, list) or not isinstance(sums, list):
        return "its record is incomplete"
    slots = trees.tensors(tree)
    if not len(slots) == len(table) == len(sums):
        return f"{len(slots)} tensors for {len(table)} places and {len(sums)} hashes"
    held: list[torch.Tensor] = []
    for (name, _), entry in zip(slots, table, strict=True):
        problem = _entry_problem(entry, data_end)
        if problem:
            return f"tensor {name}: {problem}"
        off, shape, dtype = entry
        n = _numel(shape) * dtype.itemsize     # each tensor its own storage: saving one saves its bytes only
        held.append(torch.frombuffer(mapped, dtype=torch.uint8, count=n, offset=off).view(dtype).view(shape)
                    if n else torch.empty(shape, dtype=dtype))
    found = digests(held)
    bad = next((name for (name, _), got, want in zip(slots, found, sums, strict=True) if got != want), None)
    if bad is not None:
        return f"tensor {bad} fails its checksum"
    tensors = iter(held)
    rebuilt: dict[str, Any] = trees.rebuild(
        tree, lambda leaf: next(tensors) if isinstance(leaf, torch.Tensor) else leaf)
    return rebuilt


def _entry_problem(entry: Any, data_end: int) -> str | None:
    if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], int)
            and isinstance(entry[1], tuple) and all(isinstance(d, int) and d >= 0 for d in entry[1])
            and isinstance(entry[2], torch.dtype)):
        return "its place in the table is not (offset, shape, dtype)"
    off, shape, dtype = entry
    n = _numel(shape) * dtype.itemsize
    if off < ALIGN or off % ALIGN or off + n > data_end:
        return f"its {n} bytes at offset {off} lie outside the tensors' region"
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
