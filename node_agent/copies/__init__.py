"""Peer copies: the workers' in-memory snapshots kept on a peer agent (the "holder"), so a node that replaces a
lost one fetches the lost node's snapshots instead of reading remote storage. "Copy" is this feature's one word
here, on the page and on the wire (`copy_port`, `copies_of`); "replica" means a server replica (the wire's
`Assignment.replicas` and the `--replicas`/`--replica-bandwidth` flags keep their names for compatibility).
- `peers`: the agent's side (PeerCopies: what it pushes, where, and what a newcomer fetches);
- `wire` (the line formats, pure), `stream` (bounded lines, payload bytes hashed as they pass, pacing),
  `store` (the holder's side: `CopyStore.serve` answers one push or fetch), `files` (the held files),
  `client` (`push`, `fetch`, `drop`), `tls`.
Rule: all but `peers` import only the standard library and the snapshot files' helpers (training/snapshot.py,
torch-free); never the workers, the CLI or torch, so the agent's listener and tests use them alone."""
