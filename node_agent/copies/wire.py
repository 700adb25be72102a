"""The copy wire between agents: one request line, one answer line, then the payload and a trailer.

  push:  `rdzv-agent push key=K node=N rank=R step=S size=B round=G` -> `go`, B bytes, `sha256=HEX` -> `stored step=S`
         (G: the pusher's round, its incarnation: a newer round's copies supersede an older one's)
  fetch: `rdzv-agent fetch key=K node=N rank=R`  -> `copy step=S size=B`, B bytes, `sha256=HEX` (or `none`)
         `rdzv-agent fetch-at key=K node=N rank=R step=S`: the same for that step (a node's common step)
         `rdzv-agent fetch-before key=K node=N rank=R step=S`: the newest below S, of S's round (a spare: files.spares;
         an older holder's listener takes no such line, and the fetcher goes on with the newest alone)
  drop:  `rdzv-agent drop key=K node=N`  -> `dropped` (N's copies removed: it left the job cleanly)
  either may be answered `rdzv-agent refused REASON` instead.

Every line ends in "\\n", is at most MAX_LINE bytes, and each field is bounded (K: node N's token,
N: a node id that is also a directory name, R: a local rank, S: a snapshot step as in snapshot.py, B: a
size, G: a round id); a line that does not match exactly raises WireError naming the field and quoting (repr, truncated)
what was sent. The key is never quoted back: it is the node's secret. Pure: no I/O here."""
from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = b"rdzv-agent "
MAX_LINE = 512
MAX_REASON = 200
MAX_RANK = 4095
MAX_STEP = 10**18 - 1           # snapshot.py names steps `step-(\d{1,18})`
MAX_SIZE = 2**40
MAX_ROUND = 2**53               # protocol.bounds.MAX_ROUND
QUOTE_CHARS = 80                # how much of a peer's text a reason or log quotes
AHEAD_WAIT_S = 30.0             # a holder answers a push's header within this (it waits for its own ranks' step)

GO = b"rdzv-agent go\n"
NONE = b"rdzv-agent none\n"
DROPPED = b"rdzv-agent dropped\n"
_WORDS = {GO: "go", NONE: "none", DROPPED: "dropped"}     # the answers of one word

_KEY = re.compile(r"[A-Za-z0-9_-]{16,128}")
_NODE = re.compile(r"[A-Za-z0-9_.:@+=~-]{1,128}")
_HEX = re.compile(r"[0-9a-f]{64}")
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,17}")       # canonical: no sign, no leading zero, at most 18 digits
_SECRET = re.compile(rb"key=\S*")
_SECRET_TEXT = re.compile(r"key=\S*")
_FIELDS = {"push": ("key", "node", "rank", "step", "size", "round"), "fetch": ("key", "node", "rank"),
           "fetch-at": ("key", "node", "rank", "step"), "fetch-before": ("key", "node", "rank", "step"),
           "drop": ("key", "node")}
_STORED = re.compile(rb"rdzv-agent stored step=(0|[1-9][0-9]{0,17})\n")
_COPY = re.compile(rb"rdzv-agent copy step=(0|[1-9][0-9]{0,17}) size=(0|[1-9][0-9]{0,12})\n")
_REFUSED = re.compile(rb"rdzv-agent refused ([ -~]{1,%d})\n" % MAX_REASON)
_TRAILER = re.compile(rb"sha256=([0-9a-f]{64})\n")


class WireError(ValueError):
    """A line or a value that breaks the wire's rules; the message names the field."""


def quote(data: bytes | str) -> str:
    """What a peer sent, safe to log or answer: its key hidden, truncated, as repr() writes it."""
    hidden = _SECRET_TEXT.sub("key=<hidden>", data) if isinstance(data, str) else _SECRET.sub(b"key=<hidden>", data)
    return repr(hidden[:QUOTE_CHARS]) + ("..." if len(hidden) > QUOTE_CHARS else "")


def valid_node(node: str) -> bool:
    """A node id the holder may use as a directory name: no separator, not "." or ".."."""
    return _NODE.fullmatch(node) is not None and node not in (".", "..")


def check_key(key: str) -> str:
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        size = len(key) if isinstance(key, str) else "?"
        raise WireError(f"bad key: {size} chars, wants 16..128 of [A-Za-z0-9_-]")
    return key


def check_node(node: str) -> str:
    if not isinstance(node, str) or not valid_node(node):
        raise WireError(f"bad node: {quote(str(node))}, wants 1..128 chars of [A-Za-z0-9_.:@+=~-], not '.' or '..'")
    return node


def check_number(name: str, value: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise WireError(f"bad {name}: {quote(str(value))}, wants a whole number 0..{maximum}")
    return value


@dataclass(frozen=True)
class PushRequest:
    """A push header; built only with valid fields (WireError otherwise)."""
    key: str
    node: str
    rank: int
    step: int
    size: int
    round: int = 0

    def __post_init__(self) -> None:
        check_key(self.key)
        check_node(self.node)
        check_number("rank", self.rank, MAX_RANK)
        check_number("step", self.step, MAX_STEP)
        check_number("size", self.size, MAX_SIZE)
        check_number("round", self.round, MAX_ROUND)


@dataclass(frozen=True)
class FetchRequest:
    """A fetch header (`step`: that step's copy, else the newest; with `before`, the newest below it); built only
    with valid fields (else WireError)."""
    key: str
    node: str
    rank: int
    step: int | None = None
    before: bool = False

    def __post_init__(self) -> None:
        check_key(self.key)
        check_node(self.node)
        check_number("rank", self.rank, MAX_RANK)
        if self.step is not None:
            check_number("step", self.step, MAX_STEP)


@dataclass(frozen=True)
class DropRequest:
    """A node's goodbye to a holder of its copies; built only with valid fields (WireError otherwise)."""
    key: str
    node: str

    def __post_init__(self) -> None:
        check_key(self.key)
        check_node(self.node)


@dataclass(frozen=True)
class Answer:
    """The holder's answer: kind is "go", "stored", "copy", "none", "dropped" or "refused"."""
    kind: str
    step: int | None = None
    size: int | None = None
    reason: str = ""


def is_copy_request(first_line: bytes) -> bool:
    """Whether the listener should hand this connection to the copy store."""
    return first_line.startswith(tuple(b"%s%s " % (PREFIX, verb.encode()) for verb in _FIELDS))


def push_line(request: PushRequest) -> bytes:
    r = request
    return b"rdzv-agent push key=%s node=%s rank=%d step=%d size=%d round=%d\n" % (
        r.key.encode(), r.node.encode(), r.rank, r.step, r.size, r.round)


def fetch_line(request: FetchRequest) -> bytes:
    r = request
    if r.step is not None:
        return b"rdzv-agent %s key=%s node=%s rank=%d step=%d\n" % (b"fetch-before" if r.before else b"fetch-at",
                                                                    r.key.encode(), r.node.encode(), r.rank, r.step)
    return b"rdzv-agent fetch key=%s node=%s rank=%d\n" % (r.key.encode(), r.node.encode(), r.rank)


def drop_line(request: DropRequest) -> bytes:
    return b"rdzv-agent drop key=%s node=%s\n" % (request.key.encode(), request.node.encode())


def stored_line(step: int) -> bytes:
    return b"rdzv-agent stored step=%d\n" % check_number("step", step, MAX_STEP)


def copy_line(step: int, size: int) -> bytes:
    return b"rdzv-agent copy step=%d size=%d\n" % (check_number("step", step, MAX_STEP),
                                                    check_number("size", size, MAX_SIZE))


def refused_line(reason: str) -> bytes:
    """A refusal; the reason made one line of printable ASCII, at most MAX_REASON chars."""
    text = "".join(c if " " <= c <= "~" else "?" for c in reason)[:MAX_REASON].strip() or "unspecified"
    return b"rdzv-agent refused %s\n" % text.encode("ascii")


def trailer_line(hex_digest: str) -> bytes:
    if _HEX.fullmatch(hex_digest) is None:
        raise WireError(f"bad sha256: {quote(hex_digest)}, wants 64 lowercase hex digits")
    return b"sha256=%s\n" % hex_digest.encode("ascii")


def _text(line: bytes) -> str:
    """The line without its newline, checked for length, ending and ASCII."""
    if len(line) > MAX_LINE:
        raise WireError(f"line longer than {MAX_LINE} bytes ({len(line)}): {quote(line)}")
    if not line.endswith(b"\n"):
        raise WireError(f"line not ended by a newline: {quote(line)}")
    try:
        return line[:-1].decode("ascii")
    except UnicodeDecodeError:
        raise WireError(f"line not ASCII: {quote(line)}") from None


def _fields(verb: str, rest: str) -> dict[str, str]:
    """`name=value` pairs, single-spaced, exactly the verb's names in order."""
    names = _FIELDS[verb]
    parts = rest.split(" ")
    if len(parts) != len(names):
        raise WireError(f"{verb} wants the fields {' '.join(n + '=' for n in names)}, got {quote(rest)}")
    values: dict[str, str] = {}
    for want, part in zip(names, parts, strict=True):
        name, sep, value = part.partition("=")
        if name != want or not sep:
            raise WireError(f"{verb} wants the field {want}= next, got {quote(part)}")
        values[name] = value
    return values


def _number(name: str, text: str, maximum: int) -> int:
    if _DECIMAL.fullmatch(text) is None or int(text) > maximum:
        raise WireError(f"bad {name}: {quote(text)}, wants a whole number 0..{maximum}")
    return int(text)


def parse_request(line: bytes) -> PushRequest | FetchRequest | DropRequest:
    """A push, fetch or drop line (with its newline); WireError naming the first field that is wrong."""
    text = _text(line)
    head, _, rest = text.partition(" ")
    verb, _, rest = rest.partition(" ")
    if head != "rdzv-agent" or verb not in _FIELDS:
        raise WireError(f"not a peer-copy request: {quote(line)}")
    v = _fields(verb, rest)
    check_key(v["key"])
    check_node(v["node"])
    if verb == "drop":
        return DropRequest(v["key"], v["node"])
    rank = _number("rank", v["rank"], MAX_RANK)
    if verb == "fetch":
        return FetchRequest(v["key"], v["node"], rank)
    if verb in ("fetch-at", "fetch-before"):
        return FetchRequest(v["key"], v["node"], rank, _number("step", v["step"], MAX_STEP), verb == "fetch-before")
    return PushRequest(v["key"], v["node"], rank, _number("step", v["step"], MAX_STEP),
                       _number("size", v["size"], MAX_SIZE), _number("round", v["round"], MAX_ROUND))


def parse_answer(line: bytes) -> Answer:
    """The holder's one-line answer; WireError for anything else."""
    if len(line) > MAX_LINE:
        raise WireError(f"answer longer than {MAX_LINE} bytes: {quote(line)}")
    if line in _WORDS:
        return Answer(_WORDS[line])
    if m := _STORED.fullmatch(line):
        return Answer("stored", step=int(m.group(1)))
    if (m := _COPY.fullmatch(line)) and int(m.group(2)) <= MAX_SIZE:
        return Answer("copy", step=int(m.group(1)), size=int(m.group(2)))
    if m := _REFUSED.fullmatch(line):
        return Answer("refused", reason=m.group(1).decode("ascii"))
    raise WireError(f"not an answer of the copy wire: {quote(line)}")


def parse_trailer(line: bytes) -> str:
    """The hex digest of a `sha256=HEX` trailer; WireError for anything else."""
    m = _TRAILER.fullmatch(line[:MAX_LINE + 1])
    if m is None:
        raise WireError(f"bad trailer: {quote(line)}, wants sha256= and 64 lowercase hex digits")
    return m.group(1).decode("ascii")
