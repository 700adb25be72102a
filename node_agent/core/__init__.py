"""The agent's pure supervision policy: `facts` in, `actions` out, the rules between them (`policy`),
fencing a cut-off node (`fencing`), hang detection (`hangwatch`) and the node's own checks (`node_health`).
No I/O and no clock: every call takes `now`. May import `protocol` and this package only."""
