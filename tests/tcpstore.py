"""A real c10d TCPStore in a subprocess (torch is imported there only), for tests that point a client at one."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

_SERVE = """
import sys
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, 1, True, use_libuv={libuv})
print(store.port, flush=True)
sys.stdin.read()          # until the test closes our stdin (or kills us)
"""


@contextlib.contextmanager
def tcp_store(libuv: bool = True) -> Iterator[int]:
    """The port of a TCPStore (torch's default libuv backend, or the older one) on 127.0.0.1."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE.format(libuv=libuv)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        assert line.strip().isdigit(), f"the TCPStore did not start (exit {proc.poll()})"
        yield int(line)
    finally:
        proc.kill()
        proc.wait(10)
