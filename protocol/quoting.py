"""How anything a client sent is shown in a message or a log line: short and on one line. `quote`, for a value in
an error message: repr-style (anything unprintable escaped) and cut to a bound, so a 1 MiB field cannot become a
1 MiB reply. `one_line`, for prose: only what a terminal or log viewer takes as a line break or control is escaped."""
from __future__ import annotations

import re

QUOTE_CHARS = 80     # of the client's value; its escapes may make the quote a few times longer

# C0 controls but tab, DEL, C1 controls (NEL U+0085, CSI U+009B, ...), the Unicode line and paragraph
# separators, the bidirectional overrides (which make a viewer show text in another order), and the invisible
# format characters (zero-width spaces and joiners, marks, the byte-order mark, tag characters), which hide text.
_INVISIBLE = "\u00ad\u061c\u180e\u200b-\u200f\u2060-\u2065\u206a-\u206f\ufeff\ufff9-\ufffb\U000e0000-\U000e007f"
_SHOWN_AS_ESCAPES = f"\\x7f-\\x9f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069\\ud800-\\udfff{_INVISIBLE}"
_UNSAFE = re.compile(f"[\\x00-\\x08\\x0a-\\x1f{_SHOWN_AS_ESCAPES}]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def one_line(text: str) -> str:
    """`text` with its line breaks and control characters shown as escapes (`\\n`, `\\x85`, `\\u2028`)."""
    return _UNSAFE.sub(_escaped, text)


_UNSAFE_KEEPING_LINES = re.compile(f"[\\x00-\\x08\\x0b-\\x1f{_SHOWN_AS_ESCAPES}]")


def lines_kept(text: str) -> str:
    """`text` with its control characters shown as escapes but its line breaks kept (a traceback on a page: a
    terminal that shows the page's source must not take an ESC or a BEL in it for its own)."""
    return _UNSAFE_KEEPING_LINES.sub(_escaped, text)


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """`value` quoted for an error message: repr-style (one line, escapes for anything unprintable),
    and at most `limit` characters of it, saying how long it was when it is cut."""
    if isinstance(value, (str, bytes)):
        if len(value) <= limit:
            return repr(value)
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value)} {unit})"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
