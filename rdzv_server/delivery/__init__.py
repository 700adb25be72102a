"""How news leaves the server: one home for a node waiting for it.

A held long-poll (long_poll.py) is a `Subscriber` (subscriber.py). The `Hub` (hub.py) keeps them by
job, answers each the moment its view changes, ends holds on a timer grid (holds.py), caps them
(caps.py) and takes held connections as evidence that the server's link works (links.py). The
coordinator reaches it only through the `Driver` contract.

May import `protocol`, `rdzv_server.core` and `rdzv_server.serving`.
"""
