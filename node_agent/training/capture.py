"""Taking a snapshot without holding up the training: `take` copies the state's tensors into host buffers kept
from one snapshot to the next (on a GPU: pinned buffers, filled on a side stream), and a thread checksums the copy
and writes it into the memory directory while the training goes on. The rules:
- The training waits only for the copy. On a GPU not even for that: the next optimizer step waits, on the GPU,
  for the copy of the tensors it is about to change (`before_update`).
- A write still running when the next snapshot comes is waited for (the buffers are its): snapshots never queue.
- A snapshot that does not fit the memory directory, or fails to write, is said once; training goes on and the
  last complete snapshot stays (node_agent.snapshot's rules)."""
from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch

from node_agent.training import snapshot, trees

FORMAT = "node-agent-snapshot/1"


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


class Capture:
    def __init__(self, where: str, keep: int = 2) -> None:
        self.where = where
        self.keep = keep
        self.written: list[int] = []         # steps whose write completed, newest last (for tests and logs)
        self._buffers: list[torch.Tensor] = []
        self._layout: list[tuple[tuple[int, ...], torch.dtype, bool]] = []
        self._thread: threading.Thread | None = None
        self._copied: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = None
        self._said: set[str] = set()

    def take(self, step: int, tree: Any) -> None:
        """Snapshot `tree` as step `step`: returns once its tensors are copied (on a GPU: queued)."""
        self.wait()
        live = [trees.local(t).detach() for _, t in trees.tensors(tree)]
        self._fit(live)
        self._copied = self._copy(live)
        buffers = iter(self._buffers)
        copy = trees.rebuild(tree, lambda leaf: next(buffers) if isinstance(leaf, torch.Tensor) else leaf)
        self._thread = threading.Thread(target=self._write, args=(step, copy, self._copied),
                                        name=f"node-agent snapshot {step}")
        self._thread.start()

    def before_update(self) -> None:
        """Before the optimizer changes the tensors: on a GPU, its stream waits for their copy (no host wait)."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)
            self._copied = None

    def wait(self) -> None:
        """Until the snapshot being written is complete (or failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _fit(self, live: list[torch.Tensor]) -> None:
        layout = [(tuple(t.shape), t.dtype, t.is_cuda) for t in live]
        if layout != self._layout:     # the first snapshot, or the state grew (an optimizer's lazy state)
            self._buffers = [torch.empty(shape, dtype=dtype, pin_memory=cuda) for shape, dtype, cuda in layout]
            self._layout = layout

    def _copy(self, live: list[torch.Tensor]) -> torch.cuda.Event | None:
        on_gpu = [(b, t) for b, t in zip(self._buffers, live, strict=True) if t.is_cuda]
        for buffer, t in zip(self._buffers, live, strict=True):
            if not t.is_cuda:
                buffer.copy_(t)
        if not on_gpu:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self._stream.wait_stream(torch.cuda.current_stream())     # the step that made them is done first
        with torch.cuda.stream(self._stream):
            for buffer, t in on_gpu:
                buffer.copy_(t, non_blocking=True)
        copied: torch.cuda.Event = self._stream.record_event()
        return copied

    def _write(self, step: int, copy: Any, copied: torch.cuda.Event | None) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            sums = trees.checksums(copy)
            record = {"format": FORMAT, "step": step, "tree": copy, "sums": sums}
            snapshot.save(lambda f: torch.save(record, f), step, where=self.where, keep=self.keep)
            self.written.append(step)
        except snapshot.MemoryDirFull as exc:
            self._say_once("full", f"{exc}; training goes on, the last complete snapshot stays")
        except Exception as exc:  # noqa: BLE001  (a thread's failure must reach the user, once, not end the training)
            self._say_once(type(exc).__name__, f"snapshot of step {step} not written: {type(exc).__name__}: {exc}")

    def _say_once(self, kind: str, text: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            say(text)
