"""Kept for scripts written against it: node_agent.training.snapshot is the module."""
from node_agent.training.snapshot import *  # noqa: F403
from node_agent.training.snapshot import __all__ as __all__
