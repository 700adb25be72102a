"""Hostile values, and MessagePack / JSON bodies that no well-behaved encoder would write.

Bodies are encoded with the plain `msgpack` package; what it cannot write (invalid UTF-8 in a str,
nesting deeper than its recursion limit, duplicate keys, float32, lying lengths) is spliced in as
`Raw` bytes: the encoder writes a unique placeholder string and the placeholder's encoding is then
replaced by the raw value, so the map around it stays well formed.
"""
from __future__ import annotations

import functools
import json
import math
import struct
from typing import Any

import msgpack
from hypothesis import strategies as st


class Raw:
    """An already-encoded value (MessagePack, or JSON text in `json_body`) put into a body verbatim."""
    __slots__ = ("data", "what")

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.what = what

    def __repr__(self) -> str:
        return f"Raw<{self.what}, {len(self.data)} bytes>"


class Pairs:
    """A MessagePack map written from key/value pairs as given: keys may repeat or be of any type."""
    __slots__ = ("items",)

    def __init__(self, items: list[tuple[Any, Any]]) -> None:
        self.items = items

    def __repr__(self) -> str:
        return f"Pairs({self.items!r})"


def _header(n: int, small: int, small_max: int, codes: tuple[int, int]) -> bytes:
    if n <= small_max:
        return bytes([small | n])
    if n < 1 << 16:
        return bytes([codes[0]]) + struct.pack(">H", n)
    return bytes([codes[1]]) + struct.pack(">I", n)


def map_header(n: int) -> bytes:
    return _header(n, 0x80, 15, (0xDE, 0xDF))


def str_header(n: int) -> bytes:
    if n <= 31:
        return bytes([0xA0 | n])
    if n < 256:
        return b"\xd9" + bytes([n])
    return _header(n, 0, -1, (0xDA, 0xDB))


def packb(value: Any) -> bytes:
    """`value` as MessagePack; `Raw` and `Pairs` anywhere inside are written as they are."""
    raws: dict[str, bytes] = {}

    def swap(v: Any) -> Any:
        if isinstance(v, Pairs):
            v = Raw(map_header(len(v.items)) + b"".join(packb(k) + packb(x) for k, x in v.items), "pairs")
        if isinstance(v, Raw):
            token = f"\x00fuzz-raw-{len(raws)}\x00"
            raws[token] = v.data
            return token
        if isinstance(v, dict):
            return {swap(k): swap(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [swap(x) for x in v]
        return v

    out: bytes = msgpack.packb(swap(value), use_bin_type=True)
    for token, data in raws.items():
        out = out.replace(msgpack.packb(token), data, 1)
    return out


def bad_utf8(data: bytes, what: str) -> Raw:
    """A MessagePack str whose bytes are not UTF-8."""
    return Raw(str_header(len(data)) + data, f"str of invalid UTF-8 {what}")


def nested_lists(depth: int) -> Raw:
    return Raw(b"\x91" * depth + b"\xc0", f"lists nested {depth} deep")


def nested_maps(depth: int) -> Raw:
    return Raw(b"\x81\xa1k" * depth + b"\xc0", f"maps nested {depth} deep")


INVALID_UTF8 = [bad_utf8(b"\xff", "0xff"), bad_utf8(b"\xc3\x28", "bad continuation"),
                bad_utf8(b"\xed\xa0\x80", "surrogate"), bad_utf8(b"\xf4\x90\x80\x80", "above U+10FFFF"),
                bad_utf8(b"\xc0\xaf", "overlong"), bad_utf8(b"node-\x80", "mid-string")]

# Values msgpack.packb cannot write, or that claim more than the body holds.
RAW_VALUES = [
    *INVALID_UTF8,
    nested_lists(64), nested_lists(1000), nested_lists(200_000), nested_maps(100_000),
    Raw(b"\xca" + struct.pack(">f", math.nan), "float32 NaN"),
    Raw(b"\xca" + struct.pack(">f", math.inf), "float32 inf"), Raw(b"\xca" + struct.pack(">f", 1.5), "float32 1.5"),
    Raw(b"\xdd\xff\xff\xff\xff", "array32 claiming 2**32-1 items"),
    Raw(b"\xdf\xff\xff\xff\xff", "map32 claiming 2**32-1"),
    Raw(b"\xdb\xff\xff\xff\xff", "str32 claiming 4 GiB"), Raw(b"\xc6\xff\xff\xff\xff", "bin32 claiming 4 GiB"),
    Raw(b"\xc1", "reserved byte 0xc1"), Raw(b"\xd4\x05\x00", "ext type 5"),
    Raw(b"\xd6\xff\x00\x00\x00\x01", "timestamp32"), Raw(b"\xc7\x0c\xff" + b"\xff" * 12, "timestamp96 bad nanos"),
    Raw(b"\xcf" + b"\xff" * 8, "uint64 max"), Raw(b"\xd3\x80" + b"\x00" * 7, "int64 min"),
    Raw(msgpack.packb(list(range(100_000))), "list of 100000 ints"),
    Raw(msgpack.packb({f"k{i}": i for i in range(20_000)}), "map of 20000 keys"),
    Raw(msgpack.packb("x" * 300_000), "str of 300000 chars"),
]

HOSTILE_INTS = [0, -1, 1, 2, 3, 65535, 65536, 4096, 4097, 100_001, 2 ** 31, -(2 ** 31) - 1, 2 ** 53, 2 ** 53 + 1,
                2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, -(2 ** 63), 10 ** 18]
HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e300, -1e300, 5e-324, 1e-300, 1.7976931348623157e308,
                  604800.0, 604800.5, 1e16, 60.000001, -1.0, 0.5]
HOSTILE_TEXT = ["", " ", "\x00", "a\nb", "\r\n", "x\r\nX-Injected: 1", "node\njob succeeded: all 64 nodes",
                "\x1b[2J\x1b[31m", "\u202egnp.exe", "<script>alert('fz')</script>", "\"'><img src=x>", "%s%s%n",
                "../../etc/passwd", "\ufeff", "\U0001f916" * 70, "a" * 65, "a" * 129, "a" * 257, "a" * 1025,
                "a" * 4097, "a" * 70_000, "1", "nan", "Infinity", "default", "node-a", "-leading", "é" * 200]

MSGPACK_INTS = st.integers(min_value=-(2 ** 63), max_value=2 ** 64 - 1)
_SCALARS = st.one_of(st.sampled_from(HOSTILE_INTS), MSGPACK_INTS, st.sampled_from(HOSTILE_FLOATS), st.floats(),
                     st.sampled_from(HOSTILE_TEXT), st.text(max_size=30), st.binary(max_size=30), st.booleans(),
                     st.none())


@functools.cache           # (one strategy object: hypothesis validates each new one)
def msgpack_values() -> st.SearchStrategy[Any]:
    """Any value a hostile MessagePack field could hold."""
    small = st.one_of(_SCALARS, st.sampled_from(RAW_VALUES))
    return st.one_of(small, st.lists(_SCALARS, max_size=4), st.dictionaries(st.text(max_size=8), _SCALARS, max_size=3))


@functools.cache
def msgpack_keys() -> st.SearchStrategy[Any]:
    """Map keys: unknown names, and keys of other types than str."""
    return st.one_of(st.text(max_size=20), st.sampled_from(["credential ", "V", "__class__", "", "\x00", "a" * 5000]),
                     st.integers(min_value=-5, max_value=2 ** 64 - 1), st.binary(max_size=8), st.none(),
                     st.booleans(), st.sampled_from(INVALID_UTF8[:2]))


# -- JSON (admin routes) -------------------------------------------------------------------------

RAW_JSON = [Raw(t.encode(), t[:20]) for t in (
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1.0", "2e0", "-0", "1" + "0" * 5000, "2" * 4000,
    str(2 ** 70), str(2 ** 64 - 1), str(-(2 ** 63)), '"\\ud800"', '"\\udfff"', '"a\\ud83d"', '"\\u0000"', '"a\\nb"',
    '"\\u202e"', "true",
    "null", "[]", "{}", '"2"', "[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000)]
RAW_JSON += [Raw(b'"\xff\xfe"', "invalid UTF-8 string"), Raw(b'"\x01\x1f"', "raw control characters"),
             Raw(b'"' + b"r" * 600 + b'"', "600-character string"), Raw(b'"' + b"r" * 200_000 + b'"', "200 kB string")]


@functools.cache
def json_values() -> st.SearchStrategy[Any]:
    json_scalars = st.one_of(st.integers(min_value=-(2 ** 80), max_value=2 ** 80), st.sampled_from(HOSTILE_INTS),
                             st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(HOSTILE_TEXT),
                             st.text(max_size=30), st.booleans(), st.none())
    return st.one_of(json_scalars, st.sampled_from(RAW_JSON), st.lists(json_scalars, max_size=3))


def json_body(value: Any) -> bytes:
    """`value` as JSON bytes; `Raw` values inside are written as the JSON text they hold."""
    raws: dict[str, bytes] = {}

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            token = f"fuzz-raw-{len(raws)}-token"
            raws[token] = v.data
            return token
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [swap(x) for x in v]
        return v

    out = json.dumps(swap(value)).encode()
    for token, data in raws.items():
        out = out.replace(json.dumps(token).encode(), data, 1)
    return out
