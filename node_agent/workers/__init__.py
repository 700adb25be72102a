"""The node's worker processes: what each starts with (`launch`, `environment`), one process
(`process`), a round's group (`group`), the group as a source of facts for the agent (`local`),
their output and error files, what a failure report says (`failures`), and the in-memory checkpoint
directories that outlive them (`memory`).

May import `protocol`, the agent's core (the facts it produces), the CLI's option types and the workers'
snapshot helper (`node_agent.snapshot`, for its variable names); never
the client or the plugin, and never torch (workers import it, in their own processes).
"""
