"""The agent's pure supervision policy: facts in (`facts`), actions out (`actions`), the rules
between them (`policy`, with its own `next_deadline()`), and hang detection (`hangwatch`).

No I/O and no clock: every call takes `now`. May import `protocol` and this package only.
"""
