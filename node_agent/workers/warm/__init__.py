"""Warm workers: a forking zygote that has already imported what workers need (zygote.py: the process
itself, standard library only, run with the worker's interpreter) and the agent's side of it (client.py:
starting it, asking it for a worker, the worker's exit as a process handle; eligible.py: which launch may
start warm).

May import what `node_agent.workers` may; never torch (only the zygote, a separate process, imports it).
"""
