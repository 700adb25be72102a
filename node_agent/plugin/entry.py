"""The `torchrun.handlers` entry point of backend `rdzv-server` (pyproject.toml).

torch loads every registered handler entry point whenever `torch.distributed.elastic.rendezvous` is
imported, by any torchrun launch whatever its backend. So this module imports nothing: the plugin
(`plugin/handler.py`, with torch, aiohttp and the protocol) loads only when a launch asks for
`--rdzv-backend rdzv-server`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def handler_creator() -> Callable[[Any], Any]:
    """torch calls the entry point with no arguments and registers what it returns as the creator
    of the backend named by the entry point."""
    return create_handler


def create_handler(params: Any) -> Any:
    from node_agent.plugin.handler import create_handler as create
    return create(params)
