"""Reading a worker's error file: what torch's `@record` (TORCHELASTIC_ERROR_FILE) wrote when it failed."""
from __future__ import annotations

import json
import os


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
        extra = body.get("extraInfo") or {}
        raw_ts = extra.get("timestamp") if isinstance(extra, dict) else None
        try:
            ts = float(raw_ts) if raw_ts is not None else os.path.getmtime(path)
        except (TypeError, ValueError):
            ts = os.path.getmtime(path)
        tb = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        return str(body.get("message", "")), str(tb or ""), ts
    except (OSError, ValueError, KeyError, TypeError):
        return None
