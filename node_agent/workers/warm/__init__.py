"""Warm workers: a forking zygote that has already imported what workers need (zygote.py, standard library
only) and the agent's side of it; also store_host.py, the round's c10d store. May import what
`node_agent.workers` may; never torch: only zygote.py and store_host.py import it, each in a process of its
own (store_host.py only when run, not when the agent imports it for its path).
"""
