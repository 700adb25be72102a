"""What a warm worker's fast exit (node_agent/workers/warm/fast_exit.py, `exit_at_once`) does with a thread of ours
still running when the script ends, said on the thread itself (the zygote imports nothing of ours and reads the
attribute by this name):
- JOIN: it ends by itself, soon, and its work is wanted: a snapshot's write (unmarked, a crash right after a
  snapshot took the full exit: the interpreter's teardown, CUDA's and NCCL's with it, before the restart);
- DROP: its work is worth nothing to a process that ends: pinned buffers allocated ahead.
A live non-daemon thread without a mark (the user's) keeps the full exit, which waits for it."""
from __future__ import annotations

import threading

ATTRIBUTE = "node_agent_at_exit"
JOIN = "join"
DROP = "drop"


def mark(thread: threading.Thread, what: str) -> threading.Thread:
    setattr(thread, ATTRIBUTE, what)
    return thread
