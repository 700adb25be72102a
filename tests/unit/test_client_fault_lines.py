"""Lines about requests a client broke (malformed HTTP, a body never sent) go to the server's log at a bounded rate,
all clients together (rdzv_server/logs.py ClientFaultLines): anyone who reaches the port can send them, before any
token is read; what was not logged is counted and said with a later line."""
from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage

from rdzv_server import logs
from rdzv_server.logs import CLIENT_FAULT_LINES, CLIENT_FAULT_WINDOW_S, ClientFaultLines, _ClientErrorFilter


@pytest.fixture(autouse=True)
def fresh_budget(monkeypatch):
    monkeypatch.setattr(logs, "CLIENT_FAULTS", ClientFaultLines())


def test_past_the_budget_lines_are_counted_and_the_count_said_with_a_later_window_s_first() -> None:
    lines = ClientFaultLines()
    shown = [lines.admit(0.01 * i) for i in range(3 * CLIENT_FAULT_LINES)]
    assert [show for show, _ in shown].count(True) == CLIENT_FAULT_LINES
    assert all(unsaid == 0 for _, unsaid in shown)
    assert lines.admit(CLIENT_FAULT_WINDOW_S + 1) == (True, 2 * CLIENT_FAULT_LINES)
    assert lines.admit(CLIENT_FAULT_WINDOW_S + 2) == (True, 0)


def malformed(created: float) -> logging.LogRecord:
    exc = BadHttpMessage("Invalid header value char")
    rec = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (),
                            (type(exc), exc, None))
    rec.created = created
    return rec


def test_a_flood_of_malformed_requests_writes_a_bounded_number_of_lines() -> None:
    kept = [rec for i in range(3 * CLIENT_FAULT_LINES) if _ClientErrorFilter().filter(rec := malformed(100 + 0.01 * i))]
    assert len(kept) == CLIENT_FAULT_LINES
    assert all(rec.levelno == logging.INFO and rec.exc_info is None for rec in kept)
    later = malformed(100 + CLIENT_FAULT_WINDOW_S + 1)
    assert _ClientErrorFilter().filter(later)
    assert later.getMessage().endswith(f"({2 * CLIENT_FAULT_LINES} more lines about clients' malformed or abandoned "
                                       "requests were not logged)"), later.getMessage()


def test_other_records_pass_whatever_the_budget() -> None:
    for i in range(3 * CLIENT_FAULT_LINES):
        _ClientErrorFilter().filter(malformed(0.01 * i))
    rec = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "a bug", (), None)
    assert _ClientErrorFilter().filter(rec) and rec.levelno == logging.ERROR
