"""The server's log: one line per decision, in text or JSON, safe against what clients send.

The text format escapes client strings (protocol/quoting.py), so a newline in a join's `addr` cannot
forge a second log line. A bug's record carries its traceback, indented; aiohttp's complaints about
malformed HTTP become one quoted line each, without one (the client's fault, not ours).
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import time

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web import RequestPayloadError

from protocol.quoting import one_line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": iso(record.created), "level": record.levelname, "message": record.getMessage()}
        for key in ("job_id", "event", "node_id", "round_id"):
            value = getattr(record, key, None)
            if value not in (None, "", -1):      # -1 / "": not about one round / node
                doc[key] = value
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        job = getattr(record, "job_id", None)
        prefix = f"[{one_line(str(job))}] " if job else ""
        message = one_line(record.getMessage())
        line = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname.lower()} {prefix}{message}"
        if record.exc_info:
            trace = self.formatException(record.exc_info)
            line += "\n" + "\n".join("    " + ln for ln in trace.splitlines())
        return line


EVENT_LINES = 50          # a job's events of one kind logged per EVENT_WINDOW_S; past that, counted
EVENT_WINDOW_S = 10.0
_WINDOWS_KEPT = 4096      # (job, kind) windows remembered before the ended ones are forgotten


class EventLines:
    """Which of a job's events go to the log: each of them, up to EVENT_LINES of one kind per EVENT_WINDOW_S; past that
    they are counted, and the count is said with the next of that kind once the window ends. A client that joins and
    leaves in a loop (anyone, on a server without a token) filled the log at 1.2 MB/s; the job's history keeps the
    events, bounded."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], list[float]] = {}     # (job, kind) -> [began, logged, skipped]

    def admit(self, job_id: str, kind: str, now: float) -> tuple[bool, int]:
        """(whether to log this event, how many of its kind the window that just ended did not log)."""
        window = self._windows.get((job_id, kind))
        skipped = 0
        if window is None or now - window[0] >= EVENT_WINDOW_S:
            skipped = int(window[2]) if window is not None else 0
            if window is None and len(self._windows) >= _WINDOWS_KEPT:
                self._windows = {k: w for k, w in self._windows.items() if now - w[0] < EVENT_WINDOW_S or w[2]}
            window = self._windows[(job_id, kind)] = [now, 0.0, 0.0]
        if window[1] < EVENT_LINES:
            window[1] += 1
            return True, skipped
        window[2] += 1
        return False, skipped


CLIENT_FAULT_LINES = 20       # lines about clients' malformed or abandoned requests per CLIENT_FAULT_WINDOW_S
CLIENT_FAULT_WINDOW_S = 60.0


class ClientFaultLines:
    """Lines about requests a client broke (malformed HTTP, a body never sent): anyone who reaches the port sends
    those, before any token is read, so they go to the log at a bounded rate, all clients together: past
    CLIENT_FAULT_LINES in CLIENT_FAULT_WINDOW_S they are counted, and the count is said with the first line of a later
    window. Before, one line each: a flood of half-sent requests wrote 8 MB of log in 45 s."""

    def __init__(self) -> None:
        self._began = -CLIENT_FAULT_WINDOW_S
        self._said = 0
        self._unsaid = 0

    def admit(self, now: float) -> tuple[bool, int]:
        """(whether to log this line, how many lines earlier windows did not log, to say with it)."""
        if now - self._began >= CLIENT_FAULT_WINDOW_S:
            self._began, self._said = now, 0
        if self._said >= CLIENT_FAULT_LINES:
            self._unsaid += 1
            return False, 0
        self._said += 1
        unsaid, self._unsaid = self._unsaid, 0
        return True, unsaid


CLIENT_FAULTS = ClientFaultLines()


def _unsaid_note(unsaid: int) -> str:
    return f" ({unsaid} more lines about clients' malformed or abandoned requests were not logged)" if unsaid else ""


def say_client_fault(logger: logging.Logger, message: str, *args: object) -> None:
    """Log one info line about a request a client broke, within CLIENT_FAULTS' budget."""
    show, unsaid = CLIENT_FAULTS.admit(time.time())
    if show:
        logger.info(message % args + _unsaid_note(unsaid))


class _ClientErrorFilter(logging.Filter):
    """aiohttp's errors for a malformed request or an undecodable body (RequestPayloadError, met while it
    drains a refused request): one line, no traceback, within CLIENT_FAULTS' budget. Anything else it logs keeps
    its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, RequestPayloadError, ConnectionError)):
            show, unsaid = CLIENT_FAULTS.admit(record.created)
            if not show:
                return False
            record.msg = "malformed request from a client: %s: %s%s"
            record.args = (type(exc).__name__, one_line(str(exc))[:200], _unsaid_note(unsaid))
            record.exc_info = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def setup(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    for name in ("rdzv_server", "aiohttp.server"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(level.upper())
    server_log = logging.getLogger("aiohttp.server")
    server_log.addFilter(_ClientErrorFilter())
    server_log.propagate = False


def iso(t: float | None) -> str | None:
    """A wall-clock time as ISO 8601 UTC with milliseconds (logs and the operator views)."""
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
