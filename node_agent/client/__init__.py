"""The client core, shared by node-agent and the torchrun plugin: how a node talks to the rendezvous server.
`transport` (the interface), `http` (HTTP + MessagePack; replicas: `endpoints`), `path_check` (an overdue
answer checks every endpoint over a fresh connection), `local`/`static` (in-process), `retry` (the backoff),
`witness` (members vouching while the server is silent), `replies` (what a reply or refusal means). May
import `protocol`, and `rdzv_server` for the in-process coordinator; never the workers, CLI, plugin or torch."""
