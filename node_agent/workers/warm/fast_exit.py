"""How a warm worker ends: at once where Python's finalization would only cost time (the teardown of torch's
modules, its slow destructors), keeping what a user relies on (atexit handlers, flushed files, the exit status,
the `__del__` of what the script made where it ended). Loaded by the zygote from its own folder (it imports only
the standard library, never node_agent)."""
from __future__ import annotations

import contextlib
import gc
import io
import os
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

AT_EXIT = "node_agent_at_exit"     # a thread's mark: node_agent/training/exit_marks.py says what each means


_before: frozenset[str] = frozenset()        # the modules loaded before the script ran: the zygote's
_own: Callable[[object], bool] | None = None   # whether a file is the user's own code (own_code.own)


def script_starts(own: Callable[[object], bool]) -> None:
    global _before, _own
    _before, _own = frozenset(sys.modules), own


def exit_at_once(code: int, *, ended: bool = False, frames: types.TracebackType | None = None) -> None:
    """End a finished worker now, not after finalization (with torch: slow teardowns that delay the next round
    and could hang in gloo). Kept: atexit handlers, flushed files, the exit status, and where the script ended
    (`ended`: it returned or called sys.exit; not a crash, where the restart waits) the objects it made freed
    (`frames`: the traceback sys.exit left, whose locals go first); skipped: the teardown of torch's and other
    libraries' modules. A thread of ours still running is waited for (a snapshot's write) or left (buffers
    allocated ahead), as its mark says; any other live non-daemon thread (maybe finishing a write) or
    NODE_AGENT_FULL_EXIT=1: the full exit."""
    import threading
    if os.environ.get("NODE_AGENT_FULL_EXIT") == "1":
        return
    running = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    try:
        for thread in running:
            if getattr(thread, AT_EXIT, None) == "join":
                thread.join()
    except BaseException:  # noqa: BLE001, S110 - a signal handler's exception (a user's SIGTERM handler calling
        pass               # sys.exit(0)) ends the wait, as in Python's own shutdown, never the crash's exit status
    if any(t.is_alive() and getattr(t, AT_EXIT, None) not in ("join", "drop") for t in running):
        return
    try:
        if frames is not None:
            import traceback
            traceback.clear_frames(frames)     # the locals of the frames sys.exit() left (running ones kept)
        import atexit
        atexit._run_exitfuncs()
        _flush_open_files()
        if ended:           # flushed first too: a `__del__` may block (a DataLoader joining its workers) and the
            _free_the_scripts_objects()     # agent's stop then ends the worker with nothing lost
            _flush_open_files()
    finally:
        os._exit(code & 0xFF)


def _free_the_scripts_objects() -> None:
    """Free what the script made, as the interpreter's teardown would, for what their `__del__` does (a zip file's
    directory written, gzip's trailer, a temporary file removed, a paused generator's `finally`): the namespaces
    of `__main__` and of the user's own modules it imported, cleared as Python clears a module (names with one
    underscore first, `__builtins__` kept), the last imported first, then a collection."""
    for name, module in reversed(list(sys.modules.items())):
        if name == "__main__" or (name not in _before and _own is not None and _own(getattr(module, "__file__", None))):
            with contextlib.suppress(Exception):
                namespace = module.__dict__
                for key in [k for k in namespace if k[:1] == "_" and k[1:2] != "_"]:
                    namespace[key] = None
                for key in [k for k in namespace if k != "__builtins__"]:
                    namespace[key] = None
    gc.collect()


def _flush_open_files() -> None:
    """Flush what finalization would have: the standard streams, the file objects a preload opened in the zygote
    (frozen before the fork, so gc.get_objects() no longer lists them: a log file a package opens at import would
    lose every worker's writes) and the worker's own. One that fails to flush is passed over, as finalization
    does."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _flush(list(_zygote_files))
    _flush(_files(gc.get_objects()))


def _files(objects: list[Any]) -> list[Any]:
    """The file objects among `objects`, told by their type alone: an isinstance would look `__class__` up, which
    a lazy proxy (Django's settings, accelerate's) answers by building its object, or raising; the answer per
    type is kept, as an ABC's issubclass is slow over a torch interpreter's objects."""
    kinds: dict[type, bool] = {}
    found = []
    for obj in objects:
        kind = type(obj)
        is_file = kinds.get(kind)
        if is_file is None:
            try:
                is_file = kinds[kind] = issubclass(kind, io.IOBase)
            except Exception:  # noqa: BLE001 - a metaclass of a user's own: not a file
                is_file = kinds[kind] = False
        if is_file:
            found.append(obj)
    return found


def _flush(files: list[Any]) -> None:
    for obj in files:
        try:
            if not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001, S112 - a file that cannot flush: finalization would pass it over too
            continue


_zygote_files: weakref.WeakSet[Any] = weakref.WeakSet()   # file objects the preloads left open


def flush_the_zygotes_files() -> None:
    """Flush, once the preloads are done, the file objects they opened, and remember them for the workers'
    exit: a byte still buffered here would reach the file once per worker that flushes it."""
    _zygote_files.update(_files(gc.get_objects()))      # io.IOBase's objects all take weak references
    _flush(list(_zygote_files))
