"""What runs inside a training process, in the user's script: in-memory snapshots in one call (`protect`), and
the same for Lightning (`node_agent.training.lightning`) and transformers' Trainer (`node_agent.training.hf`).
Imports torch: the agent never imports this package (node_agent.snapshot is its torch-free half)."""
from node_agent.training.protect import protect

__all__ = ["protect"]
