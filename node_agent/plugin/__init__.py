"""The torchrun plugin (`torchrun --rdzv-backend rdzv-server`): torch's handler call order bridged to the client
core. `entry`: the entry point (imports nothing); `handler`: torch's RendezvousHandler; `session`: the client core
on a thread of torchrun's agent; `torch_internals`: torch's private parts; `probes`: node-agent's progress probe in
torch's workers, read for which failed at start. The agent's only package importing torch."""
