"""The torchrun plugin (`torchrun --rdzv-backend rdzv-server`): the bridge from torch's
rendezvous-handler call order to the client core.

`entry` is the entry point (imports nothing); `handler` is torch's RendezvousHandler; `session`
runs the client core on a thread of torchrun's agent; `settings`, `round_store`, `failures`;
`torch_internals` is the one place that reaches into torch's private parts. The only package of
the agent that imports torch.
"""
