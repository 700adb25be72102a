"""The open-file limit, at both ends: the server and every agent face connections they did not open, and each
connection is a descriptor. Both raise the soft RLIMIT_NOFILE to the hard limit as they start (as every Go server
does), so the usual soft 1024 is not what a burst of connections runs into; their caps are sized from it."""
from __future__ import annotations

import contextlib
import resource


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft
