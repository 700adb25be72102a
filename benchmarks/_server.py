"""Start a real `rdzv-server` process on a free loopback port for benchmarks (and stop it)."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def running_server(*extra: str, root: str = ROOT, pids: list[int] | None = None,
                   new_session: bool = False) -> Iterator[int]:
    """Yield the port of a server started from the checkout at `root` (its pid appended to `pids`);
    `new_session`: in a session of its own (so its scheduler autogroup can be given a priority)."""
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    state = tempfile.TemporaryDirectory(prefix="rdzv-bench-state-")
    if not any(arg.startswith("--state-dir") for arg in extra):
        extra = (*extra, "--state-dir", state.name)
    # RDZV_BENCH_LOG=FILE keeps the server's log (info level) for a look at what happened.
    log_path = os.environ.get("RDZV_BENCH_LOG")
    log = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed with the server)
    proc = subprocess.Popen([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0",
                             "--log-level", "info" if log_path else "warning", *extra],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=root,
                            start_new_session=new_session)
    if pids is not None:
        pids.append(proc.pid)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r":(\d+)\s*$", line)
        if not match:
            raise RuntimeError(f"server did not start: {line!r}")
        yield int(match.group(1))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()  # type: ignore[union-attr]
        state.cleanup()
