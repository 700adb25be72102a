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


def _known(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def _strip_pending(argv: Sequence[str], pending: Mapping[str, int], known: set[str],
                   stop_at_script: bool) -> list[str]:
    out: list[str] = []
    i = 0
    args = list(argv)
    while i < len(args):
        tok = args[i]
        if stop_at_script and not tok.startswith("-"):
            return out + args[i:]
        flag = tok.split("=", 1)[0]
        if flag in pending and flag not in known:
            i += 1 if "=" in tok else 1 + pending[flag]
            continue
        out.append(tok)
        if stop_at_script and "=" not in tok and flag in known:
            action = build_argparser()._option_string_actions[flag]
            if action.nargs != 0:
                out.append(args[i + 1])
                i += 1
        i += 1
    return out


def server_args(argv: Sequence[str]) -> argparse.Namespace:
    """rdzv-server's own parser on argv (without the program name); a bad flag fails the test."""
    parser = build_parser()
    args = _strip_pending(argv, PENDING_SERVER, _known(parser), stop_at_script=False)
    try:
        return parser.parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"rdzv-server rejects {list(argv)}") from exc


def agent_options(argv: Sequence[str], environ: Mapping[str, str]) -> AgentOptions:
    """node-agent's own option parsing on argv (without the program name)."""
    args = _strip_pending(argv, PENDING_AGENT, _known(build_argparser()), stop_at_script=True)
    return parse_options(args, environ)


def expand_k8s(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command/args from the container's env (unknown: left as is)."""
    out = []
    for arg in args:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        out.append(arg)
    return out
