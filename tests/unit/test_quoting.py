"""How client values are quoted in messages (protocol/quoting.py) and shown in the server's log."""
from __future__ import annotations

import json
import logging

from aiohttp.web import RequestPayloadError

from protocol.quoting import QUOTE_CHARS, lines_kept, one_line, quote
from rdzv_server import logs
from rdzv_server.logs import ClientFaultLines, JsonFormatter, TextFormatter, _ClientErrorFilter

UNSAFE = "a\nb\rc\x00d\x1be\x7ff\x85g\x9bh\u2028i\u2029j\u202ek\ud800l"


def test_quote_is_repr_for_a_short_value():
    assert quote("abc") == "'abc'"
    assert quote(b"\xff") == "b'\\xff'"
    assert quote(3) == "3"


def test_quote_cuts_a_long_value_and_says_how_long_it_was():
    quoted = quote("r" * 200_000)
    assert quoted == repr("r" * QUOTE_CHARS) + "... (200000 characters)"
    assert quote(["r" * 200_000]).endswith("... (200004 characters)")
    assert len(quote(["r" * 200_000])) < 200


def test_quote_and_one_line_leave_no_line_break_nor_control_character():
    for text in (quote(UNSAFE), one_line(UNSAFE)):
        assert text.isprintable(), text
        assert "\\n" in text and "\\x85" in text and "\\u2028" in text and "\\ud800" in text
        text.encode()          # no lone surrogate left: any UTF-8 writer takes it


def test_invisible_characters_are_shown_as_escapes():
    """Zero-width spaces, the byte-order mark and tag characters hide text from whoever reads the line."""
    hidden = "drain\u200bnode-a\ufeff\U000e0041\u00ad"
    for text in (one_line(hidden), lines_kept(hidden)):
        assert text == "drain\\u200bnode-a\\ufeff\\U000e0041\\xad", text


def test_one_line_keeps_printable_text_and_tabs_as_they_are():
    assert one_line("é ü 日本 \t tab") == "é ü 日本 \t tab"


def record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    return logging.LogRecord("rdzv_server", logging.INFO, __file__, 1, message, args,
                             (type(exc), exc, None) if exc else None)


def test_the_text_log_escapes_c0_and_c1_controls_and_line_separators():
    line = TextFormatter().format(record("node a left: %s", UNSAFE))
    assert "\n" not in line and line.isprintable(), line
    assert "left: a\\nb\\rc\\x00d\\x1be\\x7ff\\x85g\\x9bh\\u2028i\\u2029j\\u202ek\\ud800l" in line


def test_the_json_log_is_one_ascii_line():
    line = JsonFormatter().format(record("%s", UNSAFE))
    assert line.isascii() and "\n" not in line
    assert json.loads(line)["message"] == UNSAFE


def test_a_body_aiohttp_cannot_decode_is_one_info_line_without_traceback(monkeypatch):
    monkeypatch.setattr(logs, "CLIENT_FAULTS", ClientFaultLines())     # the budget of such lines, whole
    rec = record("Unhandled exception", exc=RequestPayloadError("Can not decode content-encoding: deflate"))
    rec.levelno, rec.levelname = logging.ERROR, "ERROR"
    assert _ClientErrorFilter().filter(rec)
    assert rec.levelno == logging.INFO and rec.exc_info is None
    assert rec.getMessage() == "malformed request from a client: RequestPayloadError: " \
                               "Can not decode content-encoding: deflate"
