"""The warm zygote: an interpreter that imports the preload list once, then forks one worker per request.

Run by the agent as `PYTHON -u zygote.py FD PATH0 MOD[,MOD...] PROBE_NAME` with the worker's interpreter (a MOD of
the form `module:name` imports the module, then looks the name up in it, as `from module import name` does: a lazy
package such as transformers imports its Trainer only then, 1.4 s of every worker's start otherwise): it
imports only the standard library, never node_agent, as it must run under any PYTHON_EXEC (the probe's boot, first
on its PYTHONPATH, has loaded the probe as PROBE_NAME). It forks only while clean (fork_state.py: no other
Python thread, CUDA not initialised, torch's CPU threads held) and opens no socket but FD, the agent's. It dies
with the agent (PR_SET_PDEATHSIG, set by the agent), each child with it. The wire (a SOCK_SEQPACKET datagram
of JSON each):
  zygote -> agent  {"op": "ready", "failed": [[mod, error], ...], "unclean": why}    once, after the preloads
  agent -> zygote  {"op": "spawn", "id": N, ...launch...} + fds [stdin, stdout, stderr]
  zygote -> agent  {"op": "started", "id": N, "pid": P} or {"op": "refused", "id": N, "why": "..."}
  zygote -> agent  {"op": "exited", "pid": P, "code": C}             C: waitpid's exit code, -SIG when killed
"""
from __future__ import annotations

# ruff: noqa: E402
# (E402: the interpreter's own start-up modules are read before the zygote imports any of its own)
import sys

# What `python script.py` has loaded as the script starts: any other module a file beside the script shadows is
# forgotten for the workers (_forget_shadowed), the zygote's own imports (sysconfig, socket) too.
AT_START = frozenset(sys.modules)

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import types
from collections.abc import Callable
from typing import Any

MAX_MESSAGE = 1 << 20        # one launch (argv + environment); the agent starts a larger one cold
_PR_SET_PDEATHSIG = 1


def _sibling(name: str) -> types.ModuleType:
    """A module of this folder, loaded by its path under a name no user's module has: the zygote runs as a script
    under the worker's interpreter, where node_agent may not be importable."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_node_agent_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fast_exit, _import_output, _own_code = _sibling("fast_exit"), _sibling("import_output"), _sibling("own_code")
_fork_state = _sibling("fork_state")
exit_at_once: Callable[..., None] = _fast_exit.exit_at_once
AT_EXIT: str = _fast_exit.AT_EXIT


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


class Zygote:
    def __init__(self, sock: socket.socket, printed: tuple[bytes, bytes] = (b"", b""),
                 env: tuple[dict[str, str], dict[str, str]] = ({}, {})) -> None:
        self.sock = sock
        self.printed = printed        # what the preloads printed, repeated by each worker
        self.env = env                # the environment before and after the preloads
        self.children: dict[int, int] = {}    # pidfd -> pid
        self.prctl = ctypes.CDLL(None, use_errno=True).prctl   # loaded before any fork: the child loads nothing
        self.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def serve(self) -> dict[str, Any]:
        """Answer the agent until it is gone; returns only in a forked child, with its launch."""
        while True:
            ready, _, _ = select.select([self.sock.fileno(), *self.children], [], [])
            for fd in ready:
                if fd == self.sock.fileno():
                    launch = self._request()
                    if launch is not None:
                        return launch
                else:
                    self._reap(fd)

    def _request(self) -> dict[str, Any] | None:
        data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 8)
        if not data:   # the agent closed its end: nothing more to do
            os._exit(0)
        message = json.loads(data)
        why = _fork_state.unclean()
        if why:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"op": "refused", "id": message["id"], "why": why})
            return None
        gc.freeze()
        zygote = os.getpid()   # read before the fork: the child's getppid() is already init's if we died since
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"op": "refused", "id": message["id"], "why": f"fork: {exc.strerror}"})
            return None
        if pid == 0:
            try:
                self._become_worker(message, fds, zygote)
            except BaseException as exc:   # noqa: BLE001 - a child that failed to set up must not serve
                os.write(2, f"node-agent: the warm worker could not be set up: {exc!r}\n".encode())
                os._exit(127)
            return dict(message)
        for fd in fds:
            os.close(fd)
        self.children[os.pidfd_open(pid)] = pid
        _send(self.sock, {"op": "started", "id": message["id"], "pid": pid})
        return None

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        _send(self.sock, {"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def _become_worker(self, launch: dict[str, Any], fds: list[int], parent: int) -> None:
        """What a cold worker gets from Popen and Python's start-up, done in the forked child."""
        gc.enable()                                   # as in a cold interpreter (the zygote's stay frozen)
        os.setsid()                                   # its own session and process group
        self.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)   # dies with the zygote, which dies with the agent
        if os.getppid() != parent:
            os._exit(1)
        # The signal handlers stay as the preloads' imports left them, as a cold worker's imports leave them (a
        # package that handles SIGTERM as it loads): the zygote installs none of its own.
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        # The launch's fds onto 0, 1, 2; the zygote's own fds are closed.
        high = [os.dup(fd) for fd in fds]
        for fd in [*fds, self.sock.fileno(), *self.children]:
            os.close(fd)
        self.sock.detach()
        targets = [0, 1, 2]
        for src, dst in zip(high, targets, strict=False):
            os.dup2(src, dst, inheritable=True)
        for fd in high:
            if fd not in targets:
                os.close(fd)
        _import_output.repeat(self.printed)
        _per_worker_setup(launch)
        _show_the_command(launch["orig_argv"])
        os.chdir(launch["cwd"])
        os.environ.clear()
        os.environ.update(_as_the_preloads_left_it(launch["env"], *self.env))
        _start_probe()
        _ranks_read_at_import()


def _as_the_preloads_left_it(env: dict[str, str], before: dict[str, str], after: dict[str, str]) -> dict[str, str]:
    """The worker's environment with what the preloads' imports set or removed in the zygote's (lightning.fabric
    sets PYTORCH_NVML_BASED_CUDA_CHECK), as a cold worker's imports leave its own; a variable the worker has
    otherwise than the zygote had (its rank) stays the worker's, as a setdefault leaves it."""
    env = dict(env)
    for key in before.keys() | after.keys():
        if before.get(key) != after.get(key) and env.get(key) == before.get(key):
            if key in after:
                env[key] = after[key]
            else:
                env.pop(key, None)
    return env


def _per_worker_setup(launch: dict[str, Any]) -> None:
    """What the cold path's deathsig.child_setup does per worker beyond session and death signal, from the
    launch (eligible.WarmLaunch): "cpus", the --numa-binding affinity. Keep the two alike."""
    cpus = launch.get("cpus")
    if cpus:
        # as cold: a CPU taken away since the plan: run unbound rather than not at all
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


def _show_the_command(argv: list[str]) -> None:
    """Write the worker's command line over the zygote's in the process's argument area, where ps, `pgrep -f`,
    top and /proc/PID/cmdline read it (a cold worker's `python -u train.py ...`): as one line, as setproctitle
    does (its last byte not NUL: the kernel then reads the line up to its NUL), cut to the area's size. Done only
    where the area holds the zygote's own command line, as expected; else the zygote's stays."""
    with contextlib.suppress(Exception):
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        start, end = int(fields[45]), int(fields[46])          # arg_start, arg_end (proc(5), fields 48 and 49)
        size = end - start
        if size < 3 or size > 1 << 20 or ctypes.string_at(start, size) != \
                b"".join(os.fsencode(arg) + b"\0" for arg in sys.orig_argv):
            return
        line = b" ".join(os.fsencode(arg) for arg in argv)[:size - 2]
        ctypes.memmove(start, line + b"\0" * (size - 1 - len(line)) + b" ", size)


# Modules that keep the process's rank as the environment said when they were imported, each as its import reads
# it: the zygote's environment has none. A forked worker reads it again from its own, as a cold one would.
RANK_AT_IMPORT: dict[str, Callable[[types.ModuleType], int]] = {
    "lightning.fabric.utilities.rank_zero": lambda module: module._get_rank() or 0,
    "lightning_fabric.utilities.rank_zero": lambda module: module._get_rank() or 0,
    "torchmetrics.utilities.prints": lambda _: int(os.environ.get("LOCAL_RANK", 0)),   # its own rank_zero_only
}


def _ranks_read_at_import() -> None:
    for name, read in RANK_AT_IMPORT.items():
        module = sys.modules.get(name)
        only = getattr(module, "rank_zero_only", None)
        if module is not None and only is not None:
            with contextlib.suppress(Exception):      # another version's: the worker starts as it would have
                only.rank = read(module)


_probe_name = ""     # the progress probe's module: loaded at the zygote's start-up (its boot), before any fork


def _start_probe() -> None:
    """Start the worker's probe as its environment says (NODE_AGENT_PROGRESS), as a cold worker's does."""
    module = sys.modules.get(_probe_name)
    if module is not None:
        with contextlib.suppress(Exception):
            module.install(os.environ)


GLOO_SETTLE_S = 0.05


def _let_gloo_threads_finish_at_destroy() -> None:
    """Make `destroy_process_group()` release the GIL for GLOO_SETTLE_S, against gloo's teardown deadlock (a gloo
    thread freeing tensors needs the GIL, which the DDP Reducer's destructor holds while joining it), a race
    that warm workers lose more often: the pause lets the gloo threads finish first, once per job."""
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    destroy = getattr(c10d, "destroy_process_group", None)
    if dist is None or c10d is None or destroy is None:
        return
    import functools
    import time

    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            return destroy(*args, **kwargs)
        finally:
            time.sleep(GLOO_SETTLE_S)

    for module in (dist, c10d):
        if getattr(module, "destroy_process_group", None) is destroy:
            setattr(module, "destroy_process_group", destroy_process_group)  # noqa: B010 - a module found at run time


def run_as_main(launch: dict[str, Any]) -> None:
    """Run the worker's script or module as `python -u script` / `python -u -m module` would."""
    sys.argv = list(launch["argv"])
    sys.orig_argv = list(launch["orig_argv"])
    if not getattr(sys.flags, "safe_path", False):   # PYTHONSAFEPATH=1: no script directory, as cold
        sys.path[0] = launch["path0"]
    # torch's CPU threads, and the generators an interpreter seeds from the OS at import reseeded as a cold
    # worker's (else every rank draws the same numbers, and every restart the same again): fork_state.py.
    _fork_state.in_worker()
    main = types.ModuleType("__main__")
    main.__dict__.update(__annotations__={}, __builtins__=__builtins__)   # as the interpreter makes __main__
    sys.modules["__main__"] = main
    _fast_exit.script_starts(_own_code.own)
    try:
        if launch["module"]:
            import runpy
            # what `python -m` itself calls: the same __main__, sys.argv[0] and traceback frames
            runpy._run_module_as_main(launch["module"], alter_argv=True)  # type: ignore[attr-defined]
        else:
            _run_script(main, launch["script"])
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):   # sys.exit("message") prints: the full exit
            exit_at_once(exc.code or 0, ended=True, frames=exc.__traceback__)
        raise
    except BaseException as exc:
        # Printed as the interpreter would, less our frames, and kept as it keeps it (sys.last_*, which an atexit
        # handler may read); exit 1 (a KeyboardInterrupt: SIGINT's death, the interpreter's own).
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        exc.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        sys.excepthook(type(exc), exc, exc.__traceback__)
        if isinstance(exc, KeyboardInterrupt):
            sys.excepthook = lambda *_: None      # printed already
            raise
        exit_at_once(1)
        raise SystemExit(1) from None             # the full exit, printed already
    exit_at_once(0, ended=True)


def _run_script(main: types.ModuleType, script: str) -> None:
    # joined to the working directory, never normalised, as `python` does: `sub/..` is the kernel's to resolve
    # (sub may be a link), and __file__ reads as a cold worker's
    path = script if os.path.isabs(script) else os.path.join(os.getcwd(), script)
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    from importlib.machinery import SourceFileLoader
    main.__dict__.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path))
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _preload(entry: str) -> None:
    """Import `module`, or for `module:name` also look `name` up as `from module import name` would (an attribute,
    else a submodule its package does not import itself). A name that is not there is passed over unsaid: it may
    be imported in a branch that never runs (another version's, as `if v5: ... else: from transformers import
    AdamW`), and the script says so itself where it does run."""
    module, _, name = entry.removeprefix("?").partition(":")
    if entry.startswith("?") and not _own_code.installed(module.split(".")[0]):
        return    # the script's import of the user's own code (on PYTHONPATH, an editable install): never preloaded
    loaded = importlib.import_module(module)
    if name and not hasattr(loaded, name):
        with contextlib.suppress(ImportError):
            importlib.import_module(f"{module}.{name}")


def main() -> None:
    # Python's advice for fork without exec: no collection here, gc.freeze() before each fork, gc.enable() in
    # the child, whose collections then never touch (and copy) the zygote's objects.
    global _probe_name
    gc.disable()
    fd, path0, preload = int(sys.argv[1]), sys.argv[2], [m for m in sys.argv[3].split(",") if m]
    _probe_name = sys.argv[4] if len(sys.argv) > 4 else ""
    safe = getattr(sys.flags, "safe_path", False)      # PYTHONSAFEPATH=1: the zygote's own is not there either
    if not safe:
        sys.path[0:1] = []
        sys.path.append(path0)       # past the library while preloading: _forget_shadowed
    sock = socket.socket(fileno=fd)
    failed: list[list[str]] = []
    env = dict(os.environ)
    printed = _import_output.printed_by(lambda: _preload_all(preload, failed))
    if not safe:
        with contextlib.suppress(ValueError):     # (a preload that took it out of sys.path)
            del sys.path[len(sys.path) - 1 - sys.path[::-1].index(path0)]
        sys.path.insert(0, path0)
        _forget_shadowed(path0, AT_START)
    del sys.argv[1:]
    _send(sock, {"op": "ready", "failed": failed, "unclean": _fork_state.unclean()})
    run_as_main(Zygote(sock, printed, (env, dict(os.environ))).serve())


def _forget_shadowed(path0: str, before: frozenset[str]) -> None:
    """A file of the user's beside the script named as a module a preload imports (statistics.py, profile.py:
    torch._dynamo imports them, a cold `import torch` does not; sysconfig.py, socket.py: the zygote's own) must
    not run in the zygote, with its environment: the preloads found the library's, past the script's directory.
    The worker imports the user's from there, as a cold one does: the library's is forgotten (torch, the zygote
    keep their own reference). The user's own modules preloaded from there (--warm-preload) are forgotten too once
    anything is: they may hold a forgotten one (their `import code` found the library's), where a cold worker's
    get the user's file."""
    new = [n for n in sys.modules if n not in before]
    named = {top for top in {n.partition(".")[0] for n in new} if os.path.isfile(os.path.join(path0, f"{top}.py"))
             or os.path.isfile(os.path.join(path0, top, "__init__.py"))}
    if not named:
        return      # (the common case: no file there is named as a module loaded, and no path is resolved)
    here = os.path.realpath(path0)
    own = {n for n in new if isinstance(f := getattr(sys.modules[n], "__file__", None), str) and _beside(n, f, here)}
    forgotten = [n for n in new if n not in own and n.partition(".")[0] in named]
    for name in [*forgotten, *own] if forgotten else []:
        del sys.modules[name]


def _beside(name: str, file: str, here: str) -> bool:
    """Whether module `name` was found in the script's directory `here` itself (top.py, top.*.so, or the package
    top/), not in a library under it (a project's .venv: forgotten, a loaded numpy or torch cannot load again)."""
    real, top = os.path.realpath(file), name.partition(".")[0]
    return os.path.dirname(real) == here and os.path.basename(real).partition(".")[0] == top or \
        real.startswith(os.path.join(here, top, ""))


def _preload_all(preload: list[str], failed: list[list[str]]) -> None:
    _fork_state.hold_threads()
    _fork_state.note_generators()
    for name in preload:
        try:
            _preload(name)
        except BaseException as exc:   # noqa: BLE001 - a failed preload is reported, never fatal
            failed.append([name.removeprefix("?"), f"{type(exc).__name__}: {exc}"[:300]])
        _fork_state.hold_threads()
        _fork_state.note_generators()
    _fork_state.preloads_done()
    _let_gloo_threads_finish_at_destroy()
    gc.collect()   # the imports' garbage, once; from now on the zygote's objects are frozen (see _request)
    _fast_exit.flush_the_zygotes_files()


if __name__ == "__main__":
    main()
