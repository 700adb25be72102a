"""The `torchrun.handlers` entry point of backend `rdzv-server` (pyproject.toml). torch loads every registered
handler whenever `torch.distributed.elastic.rendezvous` is imported, by any torchrun launch: so this module imports
nothing, and the plugin (handler.py, with torch and aiohttp) loads only for `--rdzv-backend rdzv-server`."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def handler_creator() -> Callable[[Any], Any]:
    """torch calls it with no arguments and registers what it returns as the backend's creator."""
    return create_handler


def create_handler(params: Any) -> Any:
    from node_agent.plugin.handler import create_handler as create
    return create(params)
