"""The round's c10d store, hosted beside the workers instead of inside worker rank 0.
Run on the group-rank-0 node as `PYTHON -u store_host.py PORT`, started like a worker: a TCPStore server on
MASTER_PORT (READY on stdout) until the round's group stops. Workers get TORCHELASTIC_USE_AGENT_STORE=True, so
every rank is a client of a store already listening (as under torchrun's agent), and none waits out TCPStore's
retry while rank 0 starts listening. A fresh store per round: torch adds no per-attempt prefix to an agent's
store. torch is imported only when run: the agent imports this module for its path alone.
"""
from __future__ import annotations

import os
import signal
import sys

SCRIPT = os.path.abspath(__file__)
READY = "c10d store listening on port"


def main() -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(sys.argv[1]), is_master=True,
                     wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"{READY} {store.port}", flush=True)
    while True:            # until the agent stops the round's group
        signal.pause()


if __name__ == "__main__":
    main()
