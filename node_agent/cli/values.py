"""Parsers of node-agent's flag values. Each takes `fail(why)`, which raises the caller's OptionsError naming the
flag as typed."""
from __future__ import annotations

import itertools
import os
import re
import signal
from collections.abc import Callable, Mapping
from typing import NoReturn

from node_agent.settings import Std, StdSpec
from protocol.tokens import read_token_file, token_problem

DEFAULT_PORT = 29400          # torchrun's default when the endpoint names no port
_J_SPEC = re.compile(r"^(?:(\d+):)?(\d+)x(\d+)$")
Fail = Callable[[str], NoReturn]   # raises OptionsError naming a flag, with the reason given


def _int(text: str, fail: Fail) -> int:
    try:
        return int(text.strip())
    except ValueError:
        fail(f"expected an integer, got {text!r}")


def _on_off(value: str | bool, fail: Fail) -> bool:
    """An on/off flag (True) or a value: on/off, true/false, yes/no, 1/0."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower()
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    fail(f"expected on or off, got {value!r}")


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
MAX_SIZE = 2**50   # a petabyte: no node has that much memory


def parse_size(text: str, fail: Fail) -> int:
    """Bytes from `8G`, `512M`, `1.5GiB`, `4096` (K/M/G/T are powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        fail(f"expected a size such as 8G, 512M or 0, got {text!r}")
    size = int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))
    if size > MAX_SIZE:
        fail(f"at most {MAX_SIZE} bytes (1P), got {text!r}")
    return size


def _seconds(text: str, fail: Fail) -> float:
    try:
        return float(text)
    except ValueError:
        fail(f"expected a number of seconds, got {text!r}")


def _rank(text: str, fail: Fail) -> int:
    rank = _int(text, fail)
    if rank < 0:
        fail(f"local rank must be >= 0, got {rank}")
    return rank


def parse_endpoint(text: str, fail: Fail, allow_port_0: bool = False) -> tuple[str, int]:
    """`host:port`, `host` (default port), `[v6]:port` or `[v6]` -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not host:
            fail(f"bad IPv6 address in {text!r}, expected [ADDR]:PORT")
        if rest and not rest.startswith(":"):
            fail(f"unexpected {rest!r} after the address in {text!r}")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        fail(f"IPv6 addresses need brackets, e.g. [::1]:{DEFAULT_PORT}; got {text!r}")
    else:
        host, sep, port_text_ = text.partition(":")
        port_text = port_text_ if sep else None
    if not host:
        fail(f"missing host in {text!r}, expected HOST:PORT")
    if port_text is None:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not (0 if allow_port_0 else 1) <= int(port_text) <= 65535:
        fail(f"bad port {port_text!r} in {text!r}, expected 1-65535")
    return host, int(port_text)


def parse_server(text: str, tls_ca: str | None, fail: Fail, allow_port_0: bool = False) -> tuple[str, str, int]:
    """`[http[s]://]HOST[:PORT]` -> (scheme, host, port); https when the URL says so or a CA is given."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() not in ("http", "https"):
        fail(f"expected http:// or https://, got {scheme + sep!r}")
    scheme = scheme.lower() if sep else ("https" if tls_ca else "http")
    if scheme == "http" and tls_ca:
        fail(f"--tls-ca needs an https endpoint, got {text!r}")
    return (scheme, *parse_endpoint(rest if sep else text, fail, allow_port_0))


def server_token(path: str | None, flag: str, environ: Mapping[str, str], fail: Fail) -> str | None:
    """The server's token from `path`, else $RDZV_TOKEN_FILE, else $RDZV_TOKEN (None: no token); `fail` gets the
    whole line (naming the flag, variable or file), not just the reason."""
    where = flag
    if path is None and environ.get("RDZV_TOKEN_FILE"):
        path, where = environ["RDZV_TOKEN_FILE"], "$RDZV_TOKEN_FILE"
    if path is not None:
        try:
            return read_token_file(path).decode()
        except ValueError as exc:
            fail(f"{where} {path}: {exc}")
    if not environ.get("RDZV_TOKEN"):
        return None
    raw = environ["RDZV_TOKEN"].strip().encode()
    if problem := token_problem(raw):
        fail(f"$RDZV_TOKEN: {problem}")
    return raw.decode()


def parse_nnodes(text: str, fail: Fail) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) > 2:
        fail(f"expected MIN:MAX or N, got {text!r}")
    lo, hi = _int(parts[0], fail), _int(parts[-1], fail)
    if lo < 1:
        fail(f"need at least 1 node, got {text!r}")
    if lo > hi:
        fail(f"MIN ({lo}) is larger than MAX ({hi}) in {text!r}")
    return lo, hi


def _split_j(text: str, fail: Fail) -> tuple[str, str]:
    """TorchX `[MIN:]NxM` (or a bare M: one node of M workers) -> (nnodes text, nproc text)."""
    text = text.strip()
    if text.isdigit():
        return "1", text
    m = _J_SPEC.match(text)
    if not m:
        fail(f"expected [MIN:]NxM such as 2x4 or 1:4x8, got {text!r}")
    lo, hi, per_node = m.groups()
    return (f"{lo}:{hi}" if lo is not None else hi), per_node


def resolve_nproc(text: str, environ: Mapping[str, str], fail: Fail) -> int:
    text = text.strip()
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        gpus = count_gpus(environ)
        if gpus > 0:
            return gpus
        if text == "gpu":
            fail("'gpu' asked for one worker per GPU, but no GPU is visible "
                 "(CUDA_VISIBLE_DEVICES, /proc/driver/nvidia/gpus, /dev/nvidia*)")
        return os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        fail(f"expected an integer >= 1 or gpu, cpu, auto; got {text!r}")
    if n < 1:
        fail(f"must be >= 1, got {n}")
    return n


def count_gpus(environ: Mapping[str, str], proc_dir: str = "/proc/driver/nvidia/gpus", dev_dir: str = "/dev") -> int:
    """NVIDIA GPUs this process may use, found without importing torch or loading CUDA."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:   # CUDA stops at the first invalid index ("-1"): it and later are hidden
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        return len(list(itertools.takewhile(lambda e: not e.startswith("-"), entries)))
    # The driver lists one directory per GPU in /proc; without /proc, count the device nodes.
    for directory, pattern in ((proc_dir, r".+"), (dev_dir, r"nvidia\d+")):
        try:
            found = sum(1 for n in os.listdir(directory) if re.fullmatch(pattern, n))
        except OSError:
            found = 0
        if found:
            return found
    return 0


def parse_std(text: str, fail: Fail) -> StdSpec:
    """torchrun's Std spec: `3` for every rank, or `0:1,1:2` per local rank."""
    def one(value: str) -> Std:
        v = value.strip()
        if v not in ("0", "1", "2", "3"):
            fail(f"expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), got {value!r}")
        return Std(int(v))

    text = text.strip()
    if ":" not in text:
        return StdSpec(default=one(text))
    pairs: dict[int, Std] = {}
    for item in text.split(","):
        rank_text, sep, value = item.partition(":")
        if not sep:
            fail(f"expected LOCAL_RANK:STD items such as 0:1,1:2, got {item!r}")
        rank = _rank(rank_text, fail)
        if rank in pairs:
            fail(f"local rank {rank} given twice")
        pairs[rank] = one(value)
    return StdSpec(per_rank=tuple(sorted(pairs.items())))


def parse_signals(text: str, fail: Fail) -> tuple[int, ...]:
    """torchrun's `SIGTERM,SIGUSR1,...` (names; SIG may be left out) -> signal numbers, in order."""
    found: list[int] = []
    for item in (i.strip().upper() for i in text.split(",") if i.strip()):
        name = item if item.startswith("SIG") else "SIG" + item
        number = getattr(signal.Signals, name, None) if not name.startswith("SIG_") else None
        if number is None:
            fail(f"{item!r} is not a signal name (such as SIGTERM or SIGUSR1)")
        if number in (signal.SIGKILL, signal.SIGSTOP):
            fail(f"{name} cannot be handled by any process")
        if number not in found:
            found.append(int(number))
    if not found:
        fail("expected at least one signal name, such as SIGTERM")
    return tuple(found)


MAX_PRELOAD = 64     # modules in --warm-preload
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?")


def parse_modules(text: str, fail: Fail) -> tuple[str, ...]:
    """`a,b.c,d:e` -> module names, each a dotted Python name, or `module:name` (a name looked up in the module, as
    `from module import name`) (at most MAX_PRELOAD, 200 characters each)."""
    names = tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
    if len(names) > MAX_PRELOAD:
        fail(f"at most {MAX_PRELOAD} modules, got {len(names)}")
    for name in names:
        if len(name) > 200 or not _MODULE.fullmatch(name):
            fail(f"{name[:200]!r} is not a module name (such as torch or torch.distributed), nor module:name "
                 f"(such as transformers:Trainer)")
    return names


def parse_filters(text: str) -> tuple[str, ...]:
    """torchrun's duplicate filters: comma-separated, `,,` for a comma inside one. As in torchrun an
    empty item is kept, and matches every line."""
    return tuple(p.replace("\x00", ",") for p in text.replace(",,", "\x00").split(","))


def _rank_set(text: str | None, fail: Fail) -> frozenset[int] | None:
    if text is None or not text.strip():
        return None   # torchrun treats an empty filter as "all ranks"
    return frozenset(_rank(item, fail) for item in text.split(","))


