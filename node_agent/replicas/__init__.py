"""Copies of the workers' in-memory snapshots kept on a peer agent (the "holder"), so a node that replaces
a lost one fetches the lost node's snapshots instead of reading remote storage. `wire` (the line formats,
pure), `stream` (bounded lines, payload bytes hashed as they pass, pacing), `store` (the holder's side:
`ReplicaStore.serve` answers one push or fetch), `client` (`push` and `fetch`). Rule: imports only the
standard library; never the workers, the CLI or torch, so the agent's listener and tests use it alone."""
