"""Kept for scripts written against it: node_agent.training.heartbeat is the module."""
from node_agent.training.heartbeat import beat as beat
from node_agent.training.heartbeat import resumed as resumed
