"""The round's c10d store, hosted beside the workers instead of inside worker rank 0.

Run on the group-rank-0 node as `PYTHON -u store_host.py PORT`, started like a worker (forked from the
warm zygote when it is ready, which takes milliseconds, else a new interpreter): it listens on
MASTER_PORT as a TCPStore server, says so on stdout, and lives until the round's group is stopped. The
workers run with TORCHELASTIC_USE_AGENT_STORE=True, so every rank, rank 0 included, is a client of an
already listening store (torch.distributed.rendezvous._create_c10d_store), as under torchrun's agent.
Why: with rank 0 hosting it, the other ranks often reach the port before rank 0 listens, and TCPStore's
client then waits 0.3-0.8 s before it tries again (docs/benchmarks.md, "Crash -> training again").
A fresh store per round: torch adds no prefix per attempt to an agent's store.

torch is imported only when run as a program: the agent imports this module for its path alone.
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

    port = int(sys.argv[1])
    store = TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), port, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"{READY} {store.port}", flush=True)
    while True:            # until the agent stops the round's group
        signal.pause()


if __name__ == "__main__":
    main()
