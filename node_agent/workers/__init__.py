"""The node's worker processes: how each starts, runs and fails, the round's group, and their in-memory
checkpoint directories. May import `protocol`, the agent's core (the facts it produces), the CLI's option
types and `node_agent.snapshot`; never the client or the plugin, and never torch (workers import it themselves).
"""
