"""The node's worker processes: what each starts with (`launch`, `environment`), one process
(`process`), a round's group (`group`), the group as a source of facts for the agent (`local`),
their output and error files, and what a failure report says (`failures`).

May import `protocol`, the agent's core (the facts it produces) and the CLI's option types; never
the client or the plugin, and never torch (workers import it, in their own processes).
"""
