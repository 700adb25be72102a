"""A round's store port (MASTER_PORT): the group-rank-0 node's agent hosts the round's c10d store there.

node-agent gives a free port on every poll, for its next round as master; a round takes its master's latest.
Never the port of the last round, when the same node was its master: that round's store listens there until the
node's agent stops that round, and the new round's workers reaching it first would meet the old round's keys and
fail. The latest is that port when the round forms before the node polls again, or after a restore (a new
leader, a refused commit: ports are saved with rounds, not on their own). Then the round waits, with no
assignments, for the port its master's next poll gives. An agent with one store for every round (torchrun's
plugin, an older node-agent: JoinRequest.store_per_round) is never waited for.
"""
from __future__ import annotations

from rdzv_server.core.records import NodeRecord, RoundRecord
from rdzv_server.core.rounds import give_master_port, master_of


def take(r: RoundRecord, last: tuple[str, int] | None, master: NodeRecord) -> None:
    """As round `r` forms after the round whose master and port were `last` (None: none; the job may have waited
    between them): whether it waits for its master's next port."""
    r.awaits_port = master.store_per_round and last == (master.node_id, r.master_port)


def given(r: RoundRecord | None, node: NodeRecord, port: int) -> bool:
    """A poll's port; True when it completes the round that waited for it (its assignments carry it now)."""
    node.master_port = port
    if r is None or not r.awaits_port or master_of(r) != node.node_id or port == r.master_port:
        return False
    give_master_port(r, port)
    r.awaits_port = False
    return True
