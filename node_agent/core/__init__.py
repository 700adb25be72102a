"""The agent's pure supervision policy: facts in (`facts`), actions out (`actions`), the rules
between them (`policy`, with its own `next_deadline()`), when a cut-off node asks its witnesses and
what it concludes (`fencing`), hang detection (`hangwatch`), and when the node checks itself
and what an unhealthy verdict does (`node_health`).

No I/O and no clock: every call takes `now`. May import `protocol` and this package only.
"""
