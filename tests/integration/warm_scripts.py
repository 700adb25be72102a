"""Programs the warm-worker tests run cold and warm: each dumps what a worker sees, then ends as told."""
from __future__ import annotations

DUMP = '''
"""Dumps what a worker sees to argv[1], then ends as argv[2] says."""
import json, os, signal, subprocess, sys
def link(path):
    try:
        return os.readlink(path)
    except OSError:          # the descriptor listdir itself held
        return ""
d = {"environ": dict(os.environ), "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__,
     "file": __file__, "spec": __spec__ and [__spec__.name, __spec__.origin, type(__spec__.loader).__name__],
     "loader": type(__loader__).__name__, "package": __package__, "doc": __doc__, "cached": __cached__,
     "main_keys": sorted(k for k in globals() if k.startswith("__")), "orig_argv": sys.orig_argv,
     "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                 if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)},
     "fds": sorted(os.listdir("/proc/self/fd")), "session_leader": os.getsid(0) == os.getpid(),
     "group_leader": os.getpgrp() == os.getpid(), "flags": str(sys.flags), "stdin": os.readlink("/proc/self/fd/0"),
     "main_is_globals": sys.modules["__main__"].__dict__ is globals(),
     "sigmask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
     "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding],
     "modules": sorted(sys.modules), "sockets": [fd for fd in os.listdir("/proc/self/fd")
                                                 if link(f"/proc/self/fd/{fd}").startswith("socket:")],
     "cuda_initialized": "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()}
with open(sys.argv[1], "w") as f:
    json.dump(d, f, indent=1, sort_keys=True)
how = sys.argv[2]
if how == "raise":
    raise ValueError("boom")
if how == "interrupt":
    raise KeyboardInterrupt
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "os_exit":
    os._exit(7)
if how == "message":
    sys.exit("a message")
if how == "child":   # leaves a child behind in its process group
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", p.pid, flush=True)
if how.isdigit():
    sys.exit(int(how))
'''

RECORD = '''
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise RuntimeError("recorded failure")

if __name__ == "__main__":
    main()
'''

# A failing worker and what its end leaves behind: OUT/atexit (an atexit handler ran), OUT/buffered (a
# file left open with unflushed text), OUT/finalized (an object's __del__ at interpreter teardown),
# OUT/thread (a non-daemon thread's late write, with argv[2] == "thread"); argv[2] == "ok": it succeeds.
FAILING = '''
import atexit, os, sys, threading, time
out = sys.argv[1]
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write("ran"))
log = open(os.path.join(out, "buffered"), "w")
log.write("kept")

class Finalized:
    def __del__(self, _open=open, _path=os.path.join(out, "finalized")):   # builtins may be gone by then
        with _open(_path, "w") as f:
            f.write("ran")

marker = Finalized()
if sys.argv[2] == "thread":
    def late():
        time.sleep(0.3)
        open(os.path.join(out, "thread"), "w").write("ran")
    threading.Thread(target=late).start()
if sys.argv[2] != "ok":
    raise RuntimeError("failed")
'''

# A one-rank gloo group, destroyed: prints what the script can see of destroy_process_group and whether
# the group is gone after it.
DESTROY = '''
import os, sys, tempfile
import torch.distributed as dist
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
print("before", dist.is_initialized(), flush=True)
dist.destroy_process_group()
print("after", dist.is_initialized(), dist.destroy_process_group.__name__, flush=True)
print("paused", hasattr(dist.destroy_process_group, "__wrapped__"), flush=True)
'''

# A script that ends (argv[2]: "end", or "exit": sys.exit(0) in a function) leaving what Python's teardown
# finishes: an unclosed zip file and gzip file (its own and its own module's), a temporary file, a paused
# generator, and a zip file in the frame sys.exit() left.
LEFT_OPEN = '''
import gzip, os, sys, tempfile, zipfile
import ownmod
out = sys.argv[1]
archive = zipfile.ZipFile(os.path.join(out, "run.zip"), "w")
archive.writestr("m.json", "{}")
packed = gzip.open(os.path.join(out, "log.gz"), "wt")
packed.write("line\\n")
scratch = tempfile.NamedTemporaryFile(dir=out, prefix="scratch")


def paused():
    try:
        yield 1
    finally:
        print("generator finalized", flush=True)


gen = paused()
next(gen)


def main():
    local = zipfile.ZipFile(os.path.join(out, "local.zip"), "w")
    local.writestr("a", "b")
    if sys.argv[2] == "exit":
        sys.exit(0)


main()
'''

OWNMOD = '''
import gzip, os, sys
LOG = gzip.open(os.path.join(sys.argv[1], "own.gz"), "wt")
LOG.write("own\\n")
'''

# An atexit handler that reads what the interpreter keeps of an uncaught exception.
LAST_VALUE = '''
import atexit, sys
atexit.register(lambda: print("at exit:", type(getattr(sys, "last_value", None)).__name__,
                              sys.excepthook is sys.__excepthook__, flush=True))
raise RuntimeError("failed")
'''
