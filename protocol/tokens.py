"""The bearer-token rule both sides check, so a token the server accepts the agent accepts too."""
from __future__ import annotations

import hashlib

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096


def copy_verifier(token: str) -> str:
    """What a holder of a node's peer copies is told in place of the node's copy token: it checks a key against it
    and cannot present it, so a node that once held another's copies cannot push, fetch or drop them as it."""
    return hashlib.sha256(b"rdzv copy verifier\0" + token.encode()).hexdigest() if token else ""


def read_token_file(path: str) -> bytes:
    """The token in the file at `path`, without surrounding whitespace; ValueError saying why the
    file cannot be read or holds no token (callers prefix it with the flag or variable that named it)."""
    try:
        with open(path, "rb") as f:
            token = f.read(MAX_TOKEN_CHARS + 64).strip()
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    if problem := token_problem(token):
        raise ValueError(problem)
    return token


def token_problem(token: bytes) -> str:
    """Why `token` (already stripped of surrounding whitespace) cannot be a token ("" when it can)."""
    if len(token) > MAX_TOKEN_CHARS:
        return f"longer than {MAX_TOKEN_CHARS} bytes; is it the right file?"
    if len(token) < MIN_TOKEN_CHARS:
        return (f"the token must be at least {MIN_TOKEN_CHARS} characters (got {len(token)}); "
                "make one with: openssl rand -hex 32")
    if any(b < 0x21 or b > 0x7E for b in token):
        return "the token must be printable ASCII without spaces"
    return ""
