"""Error files in torch's format: reading a worker's (what torch's `@record` wrote to its
TORCHELASTIC_ERROR_FILE when it failed), and writing the agent's own for whoever launched it."""
from __future__ import annotations

import contextlib
import json
import os

from node_agent.workers.console import agent_console


def read_error_file(path: str) -> tuple[str, str, float] | None:
    """(message, traceback, unix timestamp) from a torch `@record` error.json, or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
        body = data["message"]
        if isinstance(body, str):   # some writers put a plain string here
            return body, "", os.path.getmtime(path)
        if not isinstance(body, dict):
            return None
        extra = body.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        try:
            ts = float(extra["timestamp"])
        except (KeyError, TypeError, ValueError):
            ts = os.path.getmtime(path)
        return str(body.get("message", "")), str(extra.get("py_callstack") or ""), ts
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_reply_file(path: str, message: str, traceback: str, timestamp: float, error_code: int | None) -> None:
    """Write an error file as torch's `@record` does (schedulers show it as the job's root cause): whole, by
    rename; a failure is said on stderr and leaves the agent's exit status alone."""
    body: dict[str, object] = {"message": message,
                               "extraInfo": {"py_callstack": traceback, "timestamp": str(int(timestamp))}}
    if error_code is not None:
        body["errorCode"] = error_code
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"message": body}, f)
        os.replace(tmp, path)
    except OSError as exc:
        agent_console("stderr").write(f"node-agent: cannot write the error file {path}: {exc.strerror or exc}\n")
        with contextlib.suppress(OSError):
            os.unlink(tmp)
