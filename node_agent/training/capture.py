"""Taking a snapshot without holding up the training: `take` copies the state's tensors straight into the snapshot's
file, mapped (on a GPU: into pinned buffers, on a side stream, then into the file by the threads that hash them),
and a thread hashes the copy, writes the file's header and names it complete while the training goes on (layout.py:
the file's layout). The rules:
- The training waits only for the copy. On a GPU not even for that: the next optimizer step waits, on the GPU,
  for the copy of the tensors it is about to change (`before_update`).
- The file a snapshot replaces (the keep rule, node_agent.snapshot.make_room) is written over in place, whoever
  wrote it (this process, a restarted worker's predecessor, the agent's fetched copy): its pages are already
  there, so the copy runs at memory speed, not at the speed tmpfs hands out new pages. Never one this process
  maps (a restored state lies in it) or one with another name too. It is renamed `step-N.tmp` and its
  modification time set before a byte changes: a sender of its bytes (copies/files.names) drops what it read.
- A write still running when the next snapshot comes is waited for (the file is its): snapshots never queue.
- A snapshot that does not fit the memory directory, or fails to write, is said once; training goes on and the
  last complete snapshot stays."""
from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from node_agent.training import exit_marks, headroom, heartbeat, layout, slabs, snapshot, staging, trees


def check_cadence(call: str, every: object, keep: object) -> None:
    """`every` a whole number of optimizer steps >= 1 and `keep` of snapshots >= 1, or a ValueError naming `call`'s
    argument (protect, and the framework callbacks alike)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{call}(every=...): {every!r} is not a whole number of optimizer steps >= 1")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"{call}(keep=...): {keep!r} is not a number of snapshots >= 1")


def say(text: str) -> None:
    """One line on the worker's stderr, naming its rank."""
    print(f"node-agent snapshot (rank {os.environ.get('RANK', '?')}): {text}", file=sys.stderr, flush=True)


@dataclass
class _Pending:
    """A snapshot whose tensors are copied (or queued, on a GPU) into its file, its header not yet written."""
    step: int
    slab: slabs.Slab
    shape: Any
    views: list[torch.Tensor]
    plan: layout.Plan
    staged: list[tuple[torch.Tensor, torch.Tensor]]     # (view, pinned buffer) for tensors on a GPU
    copied: staging.Events
    room: snapshot.Room
    replicated: list[bool]      # per tensor: every replica holds it alike (its hash goes into the digest)
    sources: list[torch.Tensor]     # the GPU tensors being copied: not freed (and their memory reused) meanwhile


class Capture:
    def __init__(self, where: str, keep: int = 2, replicated: Callable[[str], bool] | None = None,
                 group: int = 0) -> None:
        """`replicated(path)`: whether the tensor at `path` of the tree is held alike by every replica of this
        rank's `group` (DDP's parameters: every rank, group 0): their hashes, digested, go to the agent with each
        snapshot (heartbeat.digest)."""
        self.group = group
        self.where = where
        self.keep = keep
        self._replicated = replicated
        self._slabs: dict[int, slabs.Slab] = {}       # inode -> a file this capture wrote
        self._staging: staging.Staging | None = None
        self._preparing: threading.Thread | None = None
        self._prepared: staging.Staging | None = None
        self._thread: threading.Thread | None = None
        self._copied: staging.Events = []
        self._said: set[str] = set()

    def take(self, step: int, tree: Any, optimizers: Iterable[Any] = ()) -> None:
        """Snapshot `tree` as step `step`: returns once its tensors are copied (on a GPU: queued). `optimizers`: those
        whose next step waits for the copy (before_update); the training waits at once for the other tensors'."""
        self.wait()
        held = trees.tensors(tree)
        live = [trees.local(t).detach() for _, t in held]
        alike = [self._replicated is not None and self._replicated(path) for path, _ in held]
        plan = layout.plan(live)
        if _capturing(live):
            self._say_once("graph", "no snapshot is taken while a CUDA graph is captured, and its replays run no "
                                    "hooks: snapshots need the steps run as they are, not replayed")
            return
        try:
            slab, room = self._slab_for(step, plan.end)
        except (snapshot.MemoryDirFull, OSError) as exc:
            self._failed(step, exc)
            return
        try:
            views = layout.views(slab.region, live, plan)
            staged, self._copied = self._copy(views, live, optimizers)
        except Exception as exc:  # noqa: BLE001  (a snapshot never ends the training: said once, its file gone)
            self._dropped(step, slab, exc)
            return
        pending = _Pending(step, slab, layout.skeleton(tree), views, plan, staged, self._copied, room, alike,
                           [t for t in live if _on_gpu(t)])
        self._thread = exit_marks.mark(threading.Thread(target=self._write, args=(pending,),
                                                        name=f"node-agent snapshot {step}"), exit_marks.JOIN)
        self._thread.start()
        snapshot.hold_after(step, self.where, self.wait)

    def prepare(self, tree: Any, optimizers: Iterable[Any] = ()) -> None:
        """The pinned buffers a snapshot of `tree` copies its GPU tensors into, allocated now in a thread, ahead of
        the first snapshot: page-locking them is slower than the copy into them, and would hold that step.
        Callers call it once a step has made the optimizer's state (a step a GradScaler skipped, or a micro-batch
        of an accumulation, makes none). Where it fails, `take` allocates them itself, as before."""
        try:
            live = [trees.local(t) for _, t in trees.tensors(tree)]
            order, split = _gpu_order(live, optimizers)
        except Exception:  # noqa: BLE001  (`take` does the same, and says once where it fails)
            return
        layout_now = _gpu_layout([live[i] for i in order])
        if not layout_now or _fits(self._staging, layout_now, split) or self._preparing is not None:
            return

        def allocate() -> None:
            with contextlib.suppress(Exception):     # (`take` allocates them, and says once where that fails)
                self._prepared = self._staged(layout_now, split)

        # Not a daemon: the interpreter's exit waits for it (a thread stopped inside torch's allocation at exit
        # aborts the process: a worker that finished its training would fail).
        self._preparing = exit_marks.mark(threading.Thread(target=allocate, name="node-agent pinned buffers"),
                                          exit_marks.DROP)
        self._preparing.start()

    def before_update(self) -> None:
        """Before the optimizer changes the tensors: on a GPU, its stream waits for their copy (no host wait)."""
        if self._copied and not torch.cuda.is_current_stream_capturing():
            for device, event in self._copied:
                torch.cuda.current_stream(device).wait_event(event)
            self._copied = []

    def wait(self) -> None:
        """Until the snapshot being written is complete (or failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _slab_for(self, step: int, size: int) -> tuple[slabs.Slab, snapshot.Room]:
        """The file `step-N.tmp`, `size` bytes of data mapped: a dropped one written over (_reused), else a new one;
        beside the last complete snapshot where the limit holds one only and there is room (snapshot.fit): where
        there is none after all (ENOSPC: others took it), MemoryDirFull, and the last one stays (a review: made
        room by dropping it, the rank held none when the second try failed too), unless /dev/shm takes it once the
        older ones go (`_alone`)."""
        made = snapshot.make_room(step, self.where, self.keep)
        bound = snapshot.limit()
        room = snapshot.fit(made, step, self.where, size, bound, set(self._slabs))   # (its own: freed on a drop)
        try:
            return self._slab_in(step, size, made, room, bound)
        except snapshot.MemoryDirFull as exc:
            alone = self._alone(step, size, room, exc)
            if alone is None:
                raise
            return self._slab_in(step, size, made, alone, bound)

    def _alone(self, step: int, size: int, room: snapshot.Room, exc: snapshot.MemoryDirFull) -> snapshot.Room | None:
        """After /dev/shm refused the new file (ENOSPC) beside older snapshots the keep rule kept: `room` with them
        dropped too, where the file system then takes it, said once with what it risks (the line of a limit that
        holds one: snapshot.fewer); else None. Kept, they were every snapshot this rank would ever hold (a review:
        it held its first and refused every later one, and a crash sent the job back to it)."""
        cause = exc.__cause__
        if room.kept_count == 0 or not (isinstance(cause, OSError) and cause.errno in snapshot.FULL):
            return None
        kept = [s for s in snapshot.steps(self.where) if s != step and s not in room.dropped]
        freed = headroom.freed_by([snapshot.path(s, self.where) for s in kept], set(self._slabs))
        try:
            st = os.statvfs(self.where)
        except OSError:
            return None
        if not kept or st.f_bavail * st.f_frsize + freed < size:
            return None
        self._say_once("bare", f"{self.where}'s file system holds no more than one snapshot of {size} bytes "
                                  f"with what else it holds: the last one makes room before the next is written, so "
                                  f"a node killed meanwhile leaves this rank none (more room in /dev/shm keeps it)")
        return snapshot.Room(room.dropped + kept, 0, 0)

    def _slab_in(self, step: int, size: int, made: snapshot.Room, room: snapshot.Room,
                 bound: int | None) -> tuple[slabs.Slab, snapshot.Room]:
        said = snapshot.fewer(made, room, bound, size, self.keep)
        if said is not None:
            self._say_once(*said)
        if bound is not None and room.kept + size > bound:
            raise snapshot.full_error(step, self.where, bound, room)
        tmp = snapshot.path(step, self.where) + ".tmp"
        snapshot.remove(tmp)
        again = self._reused(room.dropped, tmp)
        alive = {slabs.inode(snapshot.path(s, self.where)) for s in snapshot.steps(self.where)}
        self._keep_slabs(lambda s: s.ino in alive or s is again)
        if again is not None and again.size == size:
            return again, room
        written = os.path.exists(tmp)         # a dropped file renamed to it (_reused)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)             # size >= layout.ALIGN: the head's page is mapped too
            os.posix_fallocate(fd, 0, size)    # ENOSPC here, not a SIGBUS when the copy touches the page
            # A file written before has its pages: mapped in one go (a fault per page costs 3 times the copy);
            # a new one's are made as the copy touches them (populating them first costs more).
            flags = mmap.MAP_SHARED | (slabs.POPULATE if written else 0)
            slab = slabs.Slab(fd, os.fstat(fd).st_ino, size,
                              torch.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=torch.uint8))
        except OSError as exc:
            os.close(fd)
            snapshot.remove(tmp)
            if exc.errno in snapshot.FULL:
                raise snapshot.full_error(step, self.where, None, room) from exc
            raise
        self._keep_slabs(lambda s: s is not again)
        self._slabs[slab.ino] = slab
        return slab, room

    def _reused(self, dropped: list[int], tmp: str) -> slabs.Slab | None:
        """Of the dropped snapshots, the one written over as `tmp` (renamed first: a reader of its name sees it go;
        the others are removed): the file this capture wrote (returned), else one another process wrote (a
        restarted worker's predecessor's: its pages are there too, and a copy into pages that exist runs 3 times
        as fast as into new ones), but never one this process maps (a restore's tensors lie in their snapshot's
        private mapping: the optimizer's state until it is written, and a write to the file reaches them), nor one
        with another hard link (someone else's as well, or the agent's while it sends it: copies/files.pin)."""
        names = {old: snapshot.path(old, self.where) for old in dropped}
        stats = {old: slabs.stat(name) for old, name in names.items()}
        own = [old for old, st in stats.items() if st is not None and st.st_ino in self._slabs and st.st_nlink == 1]
        mapped = headroom.mapped_inodes() if not own else set()
        others = [old for old, st in stats.items()
                  if mapped is not None and st is not None and st.st_ino not in mapped and st.st_nlink == 1]
        chosen = (own or others)[:1]
        for old, name in names.items():
            if old in chosen:
                os.rename(name, tmp)
                slabs.touch(tmp)
            else:
                snapshot.remove(name)
        return self._slabs.get(slabs.inode(tmp)) if chosen else None

    def _forget(self, name: str) -> None:
        """Remove a snapshot's file and unmap it: its pages go back at once."""
        ino = slabs.inode(name)
        snapshot.remove(name)
        self._keep_slabs(lambda s: s.ino != ino)

    def _keep_slabs(self, keep: Callable[[slabs.Slab], bool]) -> None:
        for ino, s in list(self._slabs.items()):
            if not keep(s):
                s.close()
                del self._slabs[ino]

    def _copy(self, views: list[torch.Tensor], live: list[torch.Tensor], optimizers: Iterable[Any]
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], staging.Events]:
        """Host tensors into their views now; a GPU's queued into pinned buffers (staging.py; the thread moves them
        into the file), the training's streams made to wait for those the optimizers do not own. Returns the (view,
        pinned buffer) pairs and the events the optimizers' step waits for."""
        for view, t in zip(views, live, strict=True):
            if not _on_gpu(t):
                view.copy_(t)
        order, split = _gpu_order(live, optimizers)
        if not order:
            return [], []
        staged = self._buffers(_gpu_layout([live[i] for i in order]), split)
        first, done, hosts = staged.queue([live[i] for i in order])
        for device, event in first:
            torch.cuda.current_stream(device).wait_event(event)
        return [(views[i], host) for i, host in zip(order, hosts, strict=True)], done

    def _buffers(self, layout_now: staging.Layout, split: int | None = None) -> staging.Staging:
        """Pinned buffers for tensors of `layout_now` (the first `split` copied first): the last snapshot's, or
        those prepared ahead, else new."""
        if self._preparing is not None:
            self._preparing.join()
            prepared, self._preparing, self._prepared = self._prepared, None, None
            if _fits(prepared, layout_now, split) and not _fits(self._staging, layout_now, split):
                self._staging = prepared
        if self._staging is None or not _fits(self._staging, layout_now, split):
            self._staging = self._staged(layout_now, split)
        return self._staging

    def _staged(self, layout_now: staging.Layout, split: int | None = None) -> staging.Staging:
        return staging.Staging(layout_now, _pinned, lambda text: self._say_once("unpacked", text), split)

    def _write(self, p: _Pending) -> None:
        tmp = snapshot.path(p.step, self.where) + ".tmp"
        try:
            for _, event in p.copied:
                event.synchronize()
            p.sources.clear()
            staged = {id(view): buffer for view, buffer in p.staged}     # a GPU's tensors: from pinned buffers

            def fill(i: int) -> None:
                if (buffer := staged.get(id(p.views[i]))) is not None:
                    p.views[i].copy_(buffer)

            sums = layout.digests(p.views, fill if staged else None)
            head = layout.header(p.step, p.shape, p.views, p.plan, sums)
            bound = snapshot.limit()
            if bound is not None and p.room.kept + p.plan.end + len(head) > bound:
                raise snapshot.full_error(p.step, self.where, bound, p.room)
            fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, p.plan.end + len(head))
                os.pwrite(fd, head, p.plan.end)
                os.pwrite(fd, layout.head(p.plan.end, head), 0)
            finally:
                os.close(fd)
            os.replace(tmp, snapshot.path(p.step, self.where))
        except Exception as exc:  # noqa: BLE001  (a thread's failure must reach the user, once, not end the training)
            self._dropped(p.step, p.slab, exc)
            return
        try:      # the snapshot is complete: what fails now is said as such, its file and slab kept
            for old in p.room.after:          # the last complete one, kept beside it for the write's time only
                self._forget(snapshot.path(old, self.where))
            if any(p.replicated):
                heartbeat.digest(p.step, layout.digest_of([s for s, alike in zip(sums, p.replicated, strict=True)
                                                           if alike]), self.group)
        except Exception as exc:  # noqa: BLE001
            self._say_once(f"after-{type(exc).__name__}", f"snapshot of step {p.step} written, but what follows it "
                                                          f"failed: {type(exc).__name__}: {exc}")

    def _dropped(self, step: int, slab: slabs.Slab, exc: BaseException) -> None:
        """A snapshot that failed after its file was made: the file removed, the failure said once."""
        snapshot.remove(snapshot.path(step, self.where) + ".tmp")
        self._keep_slabs(lambda s: s is not slab)
        self._failed(step, exc)

    def _failed(self, step: int, exc: BaseException) -> None:
        if isinstance(exc, snapshot.MemoryDirFull):
            self._say_once("full", f"{exc}; training goes on, the last complete snapshot stays")
        elif isinstance(exc, OSError) and exc.errno in snapshot.FULL:
            self._say_once("full", f"snapshot of step {step}: /dev/shm is full; training goes on, the last "
                                   "complete snapshot stays")
        else:
            self._say_once(type(exc).__name__, f"snapshot of step {step} not written: {type(exc).__name__}: {exc}")

    def _say_once(self, kind: str, text: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            say(text)


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _capturing(live: list[torch.Tensor]) -> bool:
    return any(_on_gpu(t) for t in live) and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _gpu_order(live: list[torch.Tensor], optimizers: Iterable[Any]) -> tuple[list[int], int]:
    """The indices of `live`'s GPU tensors in the order they are copied (those the optimizers do not own first),
    and how many those are."""
    on_gpu = [i for i, t in enumerate(live) if _on_gpu(t)]
    try:
        owned = _owned_by(optimizers) if on_gpu else set()
        guarded = [trees.storage(live[i]) in owned for i in on_gpu]
    except Exception:  # noqa: BLE001  (an optimizer read otherwise: every copy waited for at its step, as before)
        guarded = [True] * len(on_gpu)
    return [on_gpu[k] for k in staging.order(guarded)], guarded.count(False)


def _owned_by(optimizers: Iterable[Any]) -> set[int | None]:
    """Where the optimizers' parameters and state lie: what their next step changes (before_update waits for it)."""
    owned: set[int | None] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            owned.update(trees.storage(p) for p in group["params"])
        for state in optimizer.state.values():
            owned.update(trees.storage(t) for _, t in trees.tensors(state))
    owned.discard(None)
    return owned


def _fits(staged: staging.Staging | None, layout_now: staging.Layout, split: int | None) -> bool:
    return staged is not None and staged.layout == layout_now and \
        staged.split == (len(layout_now) if split is None else split)


def _gpu_layout(live: list[torch.Tensor]) -> staging.Layout:
    """(shape, dtype, device) of each tensor, in order: what the pinned buffers must hold."""
    return [(tuple(t.shape), t.dtype, t.device) for t in live]


def _pinned(size: int) -> torch.Tensor:
    """`size` bytes of page-locked host memory."""
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)
