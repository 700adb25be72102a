"""The snapshot file (node_agent/training/layout.py) and how a capture writes it (capture.py): read back as
taken, written over in place (a predecessor's file too), never under a restored state's feet, and refused whole
with the reason named when any part of it does not hold together."""
from __future__ import annotations

import os
import struct
from collections import OrderedDict

import pytest
import torch

from node_agent.copies import files
from node_agent.training import layout, snapshot
from node_agent.training.capture import Capture


def state(seed: float) -> dict[str, object]:
    return {"w": torch.full((300, 7), seed), "half": torch.arange(5, dtype=torch.bfloat16) + seed,
            "t": (torch.zeros(0), 3, "x"), "od": OrderedDict(a=torch.tensor([True, False])), 0: None,
            "lr": seed / 10, "d": torch.float16, "cols": torch.ones(4, 6)[:, 1:3]}


def take(capture: Capture, step: int, tree: object) -> None:
    capture.take(step, tree)
    capture.wait()


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_snapshot_reads_back_as_taken_containers_dtypes_and_plain_values_alike(memory) -> None:
    capture = Capture(memory)
    take(capture, 4, state(1.5))
    back = layout.read(snapshot.path(4), 4)
    assert not isinstance(back, str) and same(back, state(1.5))
    assert layout.read(snapshot.path(4), 5) == f"not a snapshot of step 5 in the format {layout.FORMAT}"


def test_the_file_a_snapshot_replaces_is_written_over_in_place_and_reads_back_right(memory) -> None:
    capture = Capture(memory, keep=2)
    inodes = {}
    for step in range(1, 6):
        take(capture, step, state(float(step)))
        inodes[step] = os.stat(snapshot.path(step)).st_ino
        assert snapshot.steps() == [step - 1, step][-min(step, 2):]
    assert inodes[3] == inodes[1] and inodes[4] == inodes[2] and inodes[5] == inodes[1]
    for step in (4, 5):
        back = layout.read(snapshot.path(step), step)
        assert not isinstance(back, str) and same(back, state(float(step)))


def predecessors_files(memory: str) -> None:
    """Steps 1 and 2, written by a capture whose process is gone (its mappings with it)."""
    before = Capture(memory)
    take(before, 1, state(1.0))
    take(before, 2, state(2.0))
    before._keep_slabs(lambda _: False)


def test_a_predecessors_file_is_written_over_unless_a_restored_state_lies_in_it(memory) -> None:
    predecessors_files(memory)
    restored = layout.read(snapshot.path(1), 1)       # a new worker's restore: tensors in a private mapping
    assert not isinstance(restored, str)
    inodes = {step: os.stat(snapshot.path(step)).st_ino for step in (1, 2)}
    after = Capture(memory)                           # the new worker's capture: it wrote none of these files
    take(after, 3, state(3.0))                        # drops step 1's file: mapped, so removed
    take(after, 4, state(4.0))                        # drops step 2's: its pages are there, written over
    assert same(restored, state(1.0))
    assert os.stat(snapshot.path(3)).st_ino != inodes[1] and os.stat(snapshot.path(4)).st_ino == inodes[2]
    for step in (3, 4):
        back = layout.read(snapshot.path(step), step)
        assert not isinstance(back, str) and same(back, state(float(step)))


def test_a_predecessors_file_with_another_name_too_is_never_written_over(memory) -> None:
    predecessors_files(memory)
    other = os.path.join(memory, "held-elsewhere")
    os.link(snapshot.path(1), other)                  # another name: someone else's as well
    after = Capture(memory)
    take(after, 3, state(3.0))
    assert os.stat(snapshot.path(3)).st_ino != os.stat(other).st_ino
    back = layout.read(other, 1)
    assert not isinstance(back, str) and same(back, state(1.0))


def test_a_state_that_grows_gets_a_larger_file_and_one_past_the_limit_keeps_the_last(memory, monkeypatch,
                                                                                       capsys) -> None:
    capture = Capture(memory, keep=1)
    take(capture, 1, {"w": torch.ones(10)})
    take(capture, 2, {"w": torch.ones(10), "m": torch.ones(100_000)})    # an optimizer's lazy state appears
    back = layout.read(snapshot.path(2), 2)
    assert not isinstance(back, str) and torch.equal(back["m"], torch.ones(100_000))
    monkeypatch.setenv(snapshot.LIMIT_VAR, str(200_000))
    take(capture, 3, {"w": torch.ones(10), "m": torch.ones(100_000)})
    take(capture, 4, {"w": torch.ones(10), "m": torch.ones(100_000)})
    assert snapshot.steps() == [2] and not [n for n in os.listdir(memory) if n.endswith(".tmp")]   # it stays
    assert capsys.readouterr().err.count("does not fit the memory directory") == 1


def damage(path: str, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def flip_in_header(path: str, value: bytes) -> None:
    """One bit flipped in a plain value the header holds (the tree's `lr`): it unpickles as well as the right one."""
    at, length = head_of(path)
    with open(path, "rb") as f:
        f.seek(at)
        found = f.read(length).find(value)
    assert found >= 0
    damage(path, at + found, bytes([value[0] ^ 1]))


def head_of(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        _, at, length = struct.unpack_from("<16sQQ", f.read(layout.HEAD.size))
    return at, length


@pytest.mark.parametrize(("spoil", "says"), [
    (lambda p: os.truncate(p, 100), "too short for a snapshot (100 bytes)"),
    (lambda p: damage(p, 0, b"PK\x03\x04"), "not a snapshot in the format node-agent-snapshot/2 (written by another"),
    (lambda p: damage(p, 16, struct.pack("<Q", 2**40)), "its head points outside the file (header at 1099511627776"),
    (lambda p: damage(p, head_of(p)[0], b"\0" * 8), "its header fails its checksum"),
    (lambda p: damage(p, 32, b"\0" * 8) or damage(p, head_of(p)[0], b"\0" * 8), "unreadable ("),
    (lambda p: flip_in_header(p, struct.pack(">d", 0.2)), "its header fails its checksum"),
    (lambda p: damage(p, layout.ALIGN + 8, b"\x01"), "tensor /w fails its checksum"),
])
def test_a_file_that_does_not_hold_together_is_refused_with_the_reason(memory, spoil, says) -> None:
    take(Capture(memory), 2, state(2.0))
    spoil(snapshot.path(2))
    got = layout.read(snapshot.path(2), 2)
    assert isinstance(got, str) and got.startswith(says), got


def test_a_header_weights_only_refuses_is_named_in_one_line_by_the_global_refused(memory) -> None:
    """torch's refusal is a page of advice over lines with terminal escapes, its reason last: the refusal's line
    broke in two, cut before the reason."""
    import numpy as np

    take(Capture(memory), 2, {**state(2.0), "loss": np.float32(0.5)})
    got = layout.read(snapshot.path(2), 2)
    assert isinstance(got, str) and got.startswith("unreadable (UnpicklingError: Unsupported global: GLOBAL numpy"), got
    assert "\n" not in got and "\x1b" not in got and len(got) <= 240, got


def test_a_table_entry_outside_the_tensors_region_is_named() -> None:
    record = {"format": layout.FORMAT, "step": 1, "tree": {"w": torch.empty(0)}, "sums": [0],
              "table": [(layout.ALIGN, (10**9,), torch.float32)]}
    assert layout._assemble(record, b"", 2 * layout.ALIGN) == (   # type: ignore[arg-type]
        f"tensor /w: its 4000000000 bytes at offset {layout.ALIGN} lie outside the tensors' region")


def test_a_file_put_under_a_written_name_by_someone_else_is_renamed_away_before_it_is_written_over(memory) -> None:
    """The agent may remove a snapshot and a peer's copy come under its name: that file is not this capture's
    slab; the next snapshot renames it away before a byte changes, so a reader that checks the name, as the
    agent's copy senders do (copies/files.names), sees it go and drops what it read."""
    capture = Capture(memory, keep=2)
    take(capture, 1, state(1.0))
    take(capture, 2, state(2.0))
    os.unlink(snapshot.path(1))
    with open(snapshot.path(1), "wb") as f:
        f.write(b"a peer's copy" * 1000)
    with open(snapshot.path(1), "rb") as reader:
        since = os.fstat(reader.fileno()).st_mtime_ns
        assert files.names(snapshot.path(1), reader.fileno(), since)
        take(capture, 3, state(3.0))
        assert not files.names(snapshot.path(1), reader.fileno(), since)
    back = layout.read(snapshot.path(3), 3)
    assert not isinstance(back, str) and same(back, state(3.0)) and snapshot.steps() == [2, 3]


def test_a_file_written_over_and_then_unlinked_is_no_longer_the_snapshot_its_sender_read(memory) -> None:
    """A worker dies writing over a dropped file (renamed step-N.tmp); its successor removes the .tmp. The sender
    that opened the old name must drop what it read (before: an unlinked file passed as untouched, and a torn copy
    was stored), while one whose file the keep rule only unlinked keeps it."""
    capture = Capture(memory, keep=2)
    take(capture, 1, state(1.0))
    take(capture, 2, state(2.0))
    with open(snapshot.path(1), "rb") as written, open(snapshot.path(2), "rb") as unlinked:
        since = {f: os.fstat(f.fileno()).st_mtime_ns for f in (written, unlinked)}
        capture._slab_for(3, capture._slabs[os.fstat(written.fileno()).st_ino].size)   # step 1's file: renamed
        os.unlink(snapshot.path(3) + ".tmp")                                           # ... and the .tmp removed
        os.unlink(snapshot.path(2))                                                     # the keep rule's drop
        assert not files.names(snapshot.path(1), written.fileno(), since[written])
        assert files.names(snapshot.path(2), unlinked.fileno(), since[unlinked])


def test_a_limit_that_holds_one_snapshot_where_keep_is_two_keeps_the_newest(memory, monkeypatch, capsys) -> None:
    """Before, every snapshot after the first was refused ("does not fit") and the job resumed from the first. And
    (a review) the last complete one was dropped before the next was written: a node killed during the write left
    the rank none, a sharded job's every rank from step 0. It now stays beside it until the next is complete, and
    no longer (a review: kept past the limit at rest, a worker was OOM-killed at its next allocation)."""
    capture = Capture(memory, keep=2)
    monkeypatch.setenv(snapshot.LIMIT_VAR, str(600_000))           # one snapshot of ~400 KB, not two
    seen: list[list[str]] = []
    digests = layout.digests

    def watched(tensors, fill=None):
        seen.append(sorted(os.listdir(memory)))                    # as the write runs
        return digests(tensors, fill)

    monkeypatch.setattr(layout, "digests", watched)
    for step in (1, 2, 3):
        take(capture, step, {"m": torch.full((100_000,), float(step))})
    assert seen == [["step-1.tmp"], ["step-1", "step-2.tmp"], ["step-2", "step-3.tmp"]], seen
    assert snapshot.steps() == [3], os.listdir(memory)         # at rest, within the limit
    back = layout.read(snapshot.path(3), 3)
    assert not isinstance(back, str) and torch.equal(back["m"], torch.full((100_000,), 3.0))
    err = capsys.readouterr().err
    assert err.count("holds 1 snapshot(s)") == 1 and "stays beside the next until it is complete" in err, err
    assert "does not fit" not in err


def test_with_no_room_beside_the_last_snapshot_it_makes_room_and_says_what_that_risks(memory, monkeypatch,
                                                                                        capsys) -> None:
    """No room beside the last complete snapshot (the memory or the file system short): it makes room in place, as
    before, and the user is told what that risks."""
    capture = Capture(memory, keep=2)
    monkeypatch.setenv(snapshot.LIMIT_VAR, str(600_000))
    take(capture, 1, {"m": torch.full((100_000,), 1.0)})
    monkeypatch.setattr(snapshot.headroom, "room_beside", lambda where, new, freed: False)
    take(capture, 2, {"m": torch.full((100_000,), 2.0)})
    assert snapshot.steps() == [2] and os.listdir(memory) == ["step-2"]
    back = layout.read(snapshot.path(2), 2)
    assert not isinstance(back, str) and torch.equal(back["m"], torch.full((100_000,), 2.0))
    err = capsys.readouterr().err
    assert "no room beside it" in err and "a node killed meanwhile leaves this rank none" in err, err


def test_room_beside_taken_by_others_as_it_writes_keeps_the_last_snapshot(memory, monkeypatch, capsys) -> None:
    """The headroom was there, but the node's other ranks (or another program) took it first: ENOSPC. A review:
    the last one was dropped to try again, and where the second try failed too the rank held none. The snapshot is
    skipped, said once, and the last one stays; the next one is written once there is room."""
    capture = Capture(memory, keep=2)
    monkeypatch.setenv(snapshot.LIMIT_VAR, str(600_000))
    take(capture, 1, {"m": torch.full((100_000,), 1.0)})
    fallocate = os.posix_fallocate

    def short(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", short)
    take(capture, 2, {"m": torch.full((100_000,), 2.0)})
    assert os.listdir(memory) == ["step-1"]
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    take(capture, 3, {"m": torch.full((100_000,), 3.0)})
    assert os.listdir(memory) == ["step-3"]
    err = capsys.readouterr().err
    assert err.count("the last complete snapshot stays") == 1, err


def test_a_snapshot_the_agent_is_sending_is_not_written_over_and_its_send_stays_whole(memory) -> None:
    """The agent sends a snapshot under a second name (copies/files.pin): the worker's next snapshots write over
    no file with two names, so a send slower than two snapshots still sends step 1's bytes, unchanged."""
    capture = Capture(memory, keep=2)
    take(capture, 1, state(1.0))
    take(capture, 2, state(2.0))
    with open(snapshot.path(1), "rb") as sent:
        opened = os.fstat(sent.fileno())
        pinned = files.pin(snapshot.path(1), opened)
        assert pinned is not None and os.stat(snapshot.path(1)).st_nlink == 2
        before = os.pread(sent.fileno(), opened.st_size, 0)
        take(capture, 3, state(3.0))                 # step 1 dropped: a new file, step 1's only unlinked
        take(capture, 4, state(4.0))
        assert files.names(snapshot.path(1), sent.fileno(), opened.st_mtime_ns)
        assert os.pread(sent.fileno(), opened.st_size, 0) == before
        os.unlink(pinned)
    assert snapshot.steps() == [3, 4]
    back = layout.read(snapshot.path(4), 4)
    assert not isinstance(back, str) and same(back, state(4.0))
    take(capture, 5, state(5.0))                     # unpinned: written over in place again
    assert snapshot.steps() == [4, 5] and not [n for n in os.listdir(memory) if n.startswith(files.SENDING)]


def test_a_pin_a_gone_agent_left_is_removed_by_the_next_send(memory) -> None:
    capture = Capture(memory, keep=2)
    take(capture, 1, state(1.0))
    stale = os.path.join(memory, f"{files.SENDING}999999999-abc")
    os.link(snapshot.path(1), stale)
    with open(snapshot.path(1), "rb") as f:
        pinned = files.pin(snapshot.path(1), os.fstat(f.fileno()))
    assert pinned is not None and not os.path.exists(stale) and os.stat(snapshot.path(1)).st_nlink == 2


def test_the_snapshots_from_the_step_the_agent_names_are_kept_within_the_limit(memory, monkeypatch) -> None:
    """KEEP_FROM (NodeStatus.copies_floor): the job's oldest peer copy is of step 2, so a node lost now is taken over
    from a copy that old, and this rank keeps steps 2 on besides keep=2; the memory limit still wins, newest first;
    the mark gone, the keep rule alone."""
    capture = Capture(memory, keep=2)
    with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
        f.write("2")
    for step in (1, 2, 3, 4, 5):
        take(capture, step, state(float(step)))
    assert snapshot.steps() == [2, 3, 4, 5]
    back = layout.read(snapshot.path(2), 2)
    assert not isinstance(back, str) and same(back, state(2.0))
    one = os.path.getsize(snapshot.path(5))
    monkeypatch.setenv(snapshot.LIMIT_VAR, str(3 * one + one // 2))     # three snapshots fit, not five
    take(capture, 6, state(6.0))
    assert snapshot.steps() == [4, 5, 6]
    os.remove(os.path.join(memory, snapshot.KEEP_FROM))
    monkeypatch.delenv(snapshot.LIMIT_VAR)
    take(capture, 7, state(7.0))
    assert snapshot.steps() == [6, 7]


def test_snapshots_kept_for_the_floor_go_where_the_memory_has_no_room_left_and_it_is_said(memory, monkeypatch,
                                                                                          capsys) -> None:
    """A floor (KEEP_FROM) that lags keeps more snapshots than keep=2, within the limit; where /dev/shm or the memory
    would be left without its reserve (headroom.py: a container's limit counts /dev/shm), the keep rule alone
    decides, and the rank says so once."""
    capture = Capture(memory, keep=2)
    with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
        f.write("1")
    for step in (1, 2, 3):
        take(capture, step, state(float(step)))
    assert snapshot.steps() == [1, 2, 3]
    monkeypatch.setattr(snapshot, "_said", set())
    monkeypatch.setattr(snapshot.headroom, "room_beside", lambda where, new, freed: False)
    take(capture, 4, state(4.0))
    take(capture, 5, state(5.0))
    assert snapshot.steps() == [4, 5]
    said = capsys.readouterr().err
    assert said.count("keeps no more snapshots than keep=2 for the job's slower ranks or peer copies: /dev/shm or "
                      "the memory has too little room left") == 1, said


def test_a_held_floor_keeps_at_most_one_snapshot_more_than_the_keep_rule(memory) -> None:
    """The held floor (the slowest rank's newest, as the server last heard, maybe long ago): ranks step together, so
    the slowest rank's newest is at most one older than what the keep rule keeps: the newest the rule lets go stays
    where it is of the floor or later, and no other (a floor that lags costs one snapshot, not every one since)."""
    capture = Capture(memory, keep=2)
    with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
        f.write("-1 0")
    assert snapshot.floors(memory) == (None, 0) and snapshot.keep_from(memory) is None
    for step in (1, 2, 3, 4, 5):
        take(capture, step, state(float(step)))
    assert snapshot.steps() == [3, 4, 5]
    with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
        f.write("-1 5")                        # every rank holds 5: nothing more kept
    take(capture, 6, state(6.0))
    assert snapshot.steps() == [5, 6]


def test_the_held_floors_own_step_stays_where_a_slower_ranks_last_write_failed(memory) -> None:
    """(A review): the slower rank's write of 3 failed (its memory directory full), so its newest is 2 while it
    writes 4: the ranks ahead, writing 5, keep 2 itself besides the one more, or a failure then finds no step every
    rank holds (the slower one 2, these 3 and 4)."""
    capture = Capture(memory, keep=2)
    for step in (1, 2, 3, 4):
        with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
            f.write("-1 0")
        take(capture, step, state(float(step)))
    with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
        f.write("-1 2")
    take(capture, 5, state(5.0))
    assert snapshot.steps() == [2, 3, 4, 5]
    with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
        f.write("-1 4")                        # its write of 4 landed: 2 and 3 go
    take(capture, 6, state(6.0))
    assert snapshot.steps() == [4, 5, 6]


def test_with_both_floors_the_one_more_is_the_newest_the_keep_rule_lets_go(memory) -> None:
    """(A review): steps 7-10 held, keep=2, the copies floor 9 and the held floor 0: the copies floor keeps 9, the
    newest the keep rule lets go, so the held floor keeps no other (8 went, as 7)."""
    capture = Capture(memory, keep=2)
    for step in (7, 8, 9, 10):
        with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
            f.write("0")                               # all kept while they are written
        take(capture, step, state(float(step)))
    with open(os.path.join(memory, snapshot.KEEP_FROM), "w") as f:
        f.write("9 0")
    take(capture, 11, state(11.0))
    assert snapshot.steps() == [9, 10, 11]

