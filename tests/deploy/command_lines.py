"""Check that a command line written in a deploy file is one our programs accept.

The deploy files already pass the trust flags (tokens, TLS) that the server and agent are about to
gain. Until a program knows such a flag it is taken off before parsing (and must then be one of the
PENDING ones); once the program knows it, it is parsed like every other flag, so these checks get
stricter by themselves when the trust work lands.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from node_agent.options import AgentOptions, build_argparser, parse_options
from rdzv_server.cli import build_parser

# flag -> how many values it takes
PENDING_SERVER = {"--token-file": 1, "--admin-token-file": 1, "--public-status": 0, "--tls-cert": 1, "--tls-key": 1}
PENDING_AGENT = {"--token-file": 1, "--tls-ca": 1}


def _strip_pending(argv: Sequence[str], pending: Mapping[str, int], parser: argparse.ArgumentParser,
                   options_end_at_first_word: bool) -> list[str]:
    """argv without the pending flags the parser does not know yet (and their values).

    With `options_end_at_first_word` (node-agent), the first word that is not an option or an
    option's value is the training script: it and everything after it are kept untouched.
    """
    known = parser._option_string_actions
    args, out, i = list(argv), [], 0
    while i < len(args):
        tok = args[i]
        flag = tok.split("=", 1)[0]
        if options_end_at_first_word and not tok.startswith("-"):
            return out + args[i:]
        if flag in pending and flag not in known:
            i += 1 if "=" in tok else 1 + pending[flag]
            continue
        takes_value = flag in known and known[flag].nargs != 0 and "=" not in tok
        out += args[i:i + 2] if takes_value else [tok]
        i += 2 if takes_value else 1
    return out


def server_args(argv: Sequence[str]) -> argparse.Namespace:
    """rdzv-server's own parser on argv (without the program name); a bad flag fails the test."""
    parser = build_parser()
    try:
        return parser.parse_args(_strip_pending(argv, PENDING_SERVER, parser, False))
    except SystemExit as exc:
        raise AssertionError(f"rdzv-server rejects {list(argv)}") from exc


def agent_options(argv: Sequence[str], environ: Mapping[str, str]) -> AgentOptions:
    """node-agent's own option parsing on argv (without the program name)."""
    return parse_options(_strip_pending(argv, PENDING_AGENT, build_argparser(), True), environ)


def expand_k8s(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command/args from the container's env (unknown: left as is)."""
    out = []
    for arg in args:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        out.append(arg)
    return out
