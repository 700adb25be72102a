"""Warm workers: a forking zygote that has already imported what workers need (zygote.py: the process
itself, standard library only, run with the worker's interpreter) and the agent's side of it (client.py:
starting it, asking it for a worker, the worker's exit as a process handle; eligible.py: which launch may
start warm). The programs the agent's child interpreters run live here too: zygote.py, and store_host.py
(the round's c10d store on the group-rank-0 node, forked from the zygote when it is ready).

May import what `node_agent.workers` may; never torch: only those two programs, each in its own process,
import it (store_host.py only when run, never when the agent imports it for its path).
"""
