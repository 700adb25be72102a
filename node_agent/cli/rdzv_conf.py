"""`--rdzv-conf key=value,...`: the keys node-agent and the torchrun plugin know, and what each becomes. One table
for both launchers, so a key means the same whichever reads it; torch's c10d keys keep their meaning where it
applies. An unknown key is an error naming it: torch's c10d backend ignores it, hiding a misspelt timeout."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar, cast

V = TypeVar("V")
# Seconds that become job settings (JobConfig fields): the same on every node of the job.
SECONDS_KEYS = {
    "join_timeout": "join_timeout_s",          # torch: how long a rendezvous may wait for MIN nodes
    "timeout": "join_timeout_s",               # torch's older spelling of join_timeout
    "last_call_timeout": "last_call_s",        # torch: wait this long for more nodes once MIN are there
    "heartbeat_timeout": "lease_timeout_s",    # torch: a node silent this long is dead
    "lease_timeout": "lease_timeout_s",        # ours, same meaning
    "exclude_window": "exclude_window_s",
    "exclude_cooldown": "exclude_cooldown_s",
}
LOCAL_SECONDS = {"close_timeout": 10.0, "read_timeout": 60.0, "server_wait": 60.0}   # this node only
INT_KEYS = ("max_restarts", "exclude_after", "local_world_size")
FILE_KEYS = ("token_file", "tls_ca")           # the server's token, the CA that signed its certificate
# The one transport: HTTP long-polls; asking for another is refused in one line.
NO_TRANSPORT_CHOICE = "long-polls are the only transport (the stream is gone): drop it"
# torch's c10d keys that have no meaning here (the server replaces the c10d store and its heartbeats).
IGNORED_KEYS = {
    "is_host": "no agent hosts the rendezvous: the rdzv-server does",
    "store_type": "the rendezvous state lives in the rdzv-server, not in a c10d store",
    "keep_alive_interval": "the long-poll renews the lease at least every lease_timeout/2",
    "keep_alive_max_attempt": "use heartbeat_timeout (or lease_timeout)",
    "use_libuv": "the agents' round store is always a TCPStore",
}
KNOWN_KEYS = sorted({*SECONDS_KEYS, *LOCAL_SECONDS, *INT_KEYS, *FILE_KEYS, *IGNORED_KEYS, "node_id"})

# What node-agent (not the plugin) makes of the keys that concern torch's own agent.
AGENT_NOTES = {
    "close_timeout": "node-agent leaves the job with one request (2 s at most) when it stops",
    "read_timeout": "node-agent runs no agent store: worker rank 0 hosts the workers' store",
    "local_world_size": "node-agent takes the worker count from --nproc-per-node",
    "rank": "torchrun sets it from --node-rank, and so does node-agent",
}


def unquoted(conf: Mapping[str, V]) -> dict[str, V]:
    """`conf` less one pair of stray quotes around the whole `--rdzv-conf` text, which a doubly quoted value leaves
    (`"--rdzv-conf='join_timeout=5'"`, as PyTorch's launcher tests write it). One pair only: keys are still checked
    strictly, so a lone quote or a second pair still names the key it spoils."""
    items = list(conf.items())
    if not items:
        return {}
    first, (last, value) = items[0][0], items[-1]
    quote = first[:1]
    if quote not in ("'", '"') or not isinstance(value, str) or not value.endswith(quote) or len(first) < 2:
        return dict(conf)
    items[-1] = (last, cast(V, value[:-1].strip()))       # (a str: V is str here)
    items[0] = (first[1:].strip(), items[0][1])          # after: the first item may be the last
    return dict(items)


def parse_conf(text: str) -> dict[str, str]:
    """torchrun's `key=value,key=value` (spaces around keys and values dropped, one pair of stray
    quotes around the whole removed: `unquoted`); ValueError on a bad item."""
    conf: dict[str, str] = {}
    for item in text.split(",") if text.strip() else []:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not key:
            raise ValueError(f"expected KEY=VALUE items separated by commas, got {text!r}")
        if not sep or not value:
            raise ValueError(f"{key} has no value")
        conf[key] = value
    conf = unquoted(conf)
    if not all(key and value for key, value in conf.items()):
        raise ValueError(f"expected KEY=VALUE items separated by commas, got {text!r}")
    return conf
