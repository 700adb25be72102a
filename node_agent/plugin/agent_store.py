"""The torchrun plugin's agent store in a process of its own, as node-agent's: torch's TCPStore, which authenticates
nobody, run by workers/warm/store_host.py instead of inside torchrun's agent. There a stranger who reaches its port
fills a process whose memory is bounded (the store host's NODE_AGENT_STORE_MEMORY_MB) and slows one that runs
nothing else, where inside torchrun it could fill torchrun's memory and slow its agent.

torchrun's process makes the listening socket (its port is published when the node joins) and keeps it, so a store
process that ended is started again on the same port when a round needs it; the process ends with torchrun's (it
watches its parent: torchrun may end by SIGKILL) or at its exit."""
from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable

from node_agent.plugin.probes import without_probe
from node_agent.workers.warm.store_host import SCRIPT, store_socket

CLOSE_WAIT_S = 2.0


class AgentStore:
    """This node's agent store: a listening socket here, a store process serving it."""

    def __init__(self, addr: str, say: Callable[[str], None]) -> None:
        self._addr, self._say = addr, say
        self._listener = store_socket(addr)
        self.port: int = self._listener.getsockname()[1]
        self._process = self._start()
        atexit.register(self.close)

    def ensure(self) -> None:
        """A store process serves the port (this node is a round's group rank 0): started again where it ended."""
        status = self._process.poll()
        if status is not None:
            self._say(f"this node's agent store (pid {self._process.pid}) ended with status {status}; "
                      f"starting it again on port {self.port}")
            self._process = self._start()

    def close(self) -> None:
        """Ends the store process (at torchrun's exit: the store lived as long as torchrun's process before)."""
        with contextlib.suppress(OSError):
            if self._process.poll() is None:
                self._process.terminate()
                try:
                    self._process.wait(CLOSE_WAIT_S)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
        self._listener.close()

    def _start(self) -> subprocess.Popen[bytes]:
        fd = self._listener.fileno()
        # A session of its own: a terminal's Ctrl-C is torchrun's to handle, and ends the store through it
        return subprocess.Popen([sys.executable, "-u", SCRIPT, "--fd", str(fd), "--parent", str(os.getpid())],
                                pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                env={**without_probe(os.environ), "MASTER_ADDR": self._addr}, start_new_session=True)
