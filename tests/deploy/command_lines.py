"""Check that a command line written in a deploy file is one our programs accept: each is parsed by
the program's own parser (the trust flags included), so a deploy file cannot drift from the CLI."""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

from node_agent.cli.options import parse_options
from rdzv_server.cli import build_parser
from tests.options_view import flat


def server_args(argv: Sequence[str]) -> argparse.Namespace:
    """rdzv-server's own parser on argv (without the program name); a bad flag fails the test."""
    try:
        return build_parser().parse_args(list(argv))
    except SystemExit as exc:
        raise AssertionError(f"rdzv-server rejects {list(argv)}") from exc


def agent_options(argv: Sequence[str], environ: Mapping[str, str]) -> SimpleNamespace:
    """node-agent's own option parsing on argv (without the program name), seen flat."""
    return flat(parse_options(list(argv), environ))


def expand_k8s(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command/args from the container's env (unknown: left as is)."""
    out = []
    for arg in args:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        out.append(arg)
    return out
