"""The client core, shared by node-agent and the torchrun plugin: how a node talks to the
rendezvous server.

`transport` (what every way of talking provides, and its two exceptions), `http` (HTTP +
MessagePack long-polls, leader redirects between replicas via `endpoints`), `path_check` (is the path back? an overdue
answer has every endpoint checked over a fresh connection), `local` and `static` (in-process, for
single-node and static launches), `retry` (the one backoff), `witness` (the listener that answers the
other members' "do you hear the server?", and the asking), and `replies` (the pure rules: what a
reply or a refusal means for a node running round R). May import `protocol`, and `rdzv_server`'s
shell for the in-process coordinator; never the workers, the CLI, the plugin or torch.
"""
