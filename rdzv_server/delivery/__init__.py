"""How news leaves the server: one home for a node waiting for it.

A node's held long-poll is a `Subscriber` (subscriber.py); the `Hub` (hub.py) keeps every attached
subscriber by job, answers each one the moment its view changes (one pass per woken job), ends its
hold on a timer grid (holds.py), caps how many a node or an address may hold (caps.py), and tells the
core a held poll began, ended or dropped; the held connections' kernels are its evidence that the
server's own link works (links.py). `long_poll.py` is a poll's whole life. The coordinator drives the
core and hands the hub what changed through the `Driver` contract; nothing else reaches into it.

May import `protocol`, `rdzv_server.core` and `rdzv_server.serving`.
"""
