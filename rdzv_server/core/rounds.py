"""Turning an ordered list of member nodes into one round's assignments; what a node sees of its round.

Group rank is the position in the list. A node's global rank offset is the sum of the local world
sizes before it, so nodes may run different numbers of workers. MASTER_ADDR/PORT are the ones the
group-rank-0 node published: its worker rank 0 hosts the store.
"""
from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable

from protocol.messages import Assignment, JobState, NodeState, NodeStatus, Witness, WorkerFailure
from protocol.quoting import one_line
from rdzv_server.core.events import RoundCause
from rdzv_server.core.records import JobRecord, NodeRecord, RoundRecord


def build_round(job: JobRecord, members: list[str], round_id: int, opened_at: float, now: float,
                reason: str) -> RoundRecord:
    nodes = [job.nodes[nid] for nid in members]
    world_size = sum(n.local_world_size for n in nodes)
    role_sizes: dict[str, int] = {}
    for n in nodes:
        role_sizes[n.role] = role_sizes.get(n.role, 0) + n.local_world_size
    reach = reachable_addresses(nodes)
    witnesses = _witnesses(nodes, reach)
    master_addr = reach[0]
    master = nodes[0]
    assignments: dict[str, Assignment] = {}
    offset = 0
    role_offsets: dict[str, int] = {}
    for group_rank, n in enumerate(nodes):
        role_offset = role_offsets.get(n.role, 0)
        assignments[n.node_id] = Assignment(
            round_id=round_id, group_rank=group_rank, group_world_size=len(nodes), rank_offset=offset,
            world_size=world_size, local_world_size=n.local_world_size, master_addr=master_addr,
            master_port=master.master_port, restart_count=job.restart_count,
            max_restarts=job.config.max_restarts, role_rank_offset=role_offset,
            role_world_size=role_sizes[n.role], witnesses=witnesses[group_rank])
        offset += n.local_world_size
        role_offsets[n.role] = role_offset + n.local_world_size
    return RoundRecord(round_id=round_id, members=list(members), assignments=assignments, opened_at=opened_at,
                       completed_at=now, reason=reason, world_size=world_size,
                       restart_count=job.restart_count)


def _witnesses(nodes: list[NodeRecord], reach: list[str]) -> list[tuple[Witness, ...]]:
    """For each member, the next two members after it in the ring that answer probes (a different pair
    for each node), in one sweep: O(N) however few members answer probes (walking the ring from each
    member was O(N^2) in a round of nodes without a probe port: 11 s at 10,000 nodes), and each
    member's Witness built once and shared by the two tuples naming it (3 us a node before)."""
    probers = [i for i, n in enumerate(nodes) if n.probe_port]
    named = [Witness(addr=reach[i], port=nodes[i].probe_port) for i in probers]
    m, out, nxt = len(probers), [], 0       # probers[nxt]: the first prober after the current rank
    ring = named + named[:WITNESSES]        # the next WITNESSES from any position, without wrapping
    for rank in range(len(nodes)):
        while nxt < m and probers[nxt] <= rank:
            nxt += 1
        if m > WITNESSES:    # the member itself comes last going round from nxt: never among the first
            out.append(tuple(ring[nxt % m:nxt % m + WITNESSES]))
        else:
            out.append(tuple(named[(nxt + k) % m] for k in range(m) if probers[(nxt + k) % m] != rank))
    return out


def reachable_addresses(nodes: list[NodeRecord]) -> list[str]:
    """The address the other members reach each node at: its own, except a loopback one on a
    multi-host round (its agent reached the server by 127.0.0.1: the other hosts would look for it
    on their own loopback and hang). Then the address its join came from stands in, or, when that
    is loopback too (it runs on the server's own host), the server's address the other hosts reached."""
    if all(_loopback(n.addr) and _loopback(n.seen_from or n.addr) for n in nodes):
        return [n.addr for n in nodes]          # one host: loopback is right
    server = next((n.server_addr for n in nodes if n.server_addr and not _loopback(n.server_addr)), "")
    return [n.addr if not _loopback(n.addr) else
            n.seen_from if n.seen_from and not _loopback(n.seen_from) else server or n.addr for n in nodes]


def master_address(nodes: list[NodeRecord]) -> tuple[str, str]:
    """(MASTER_ADDR for these members, why it is not the group-rank-0 node's own `addr`, or "")."""
    master, better = nodes[0], reachable_addresses(nodes)[0]
    if better == master.addr:
        return master.addr, ""
    return better, (f"node {master.node_id} advertises the loopback address {master.addr}, which the other hosts "
                    f"cannot reach; MASTER_ADDR is {better} instead (start its agent with --local-addr to choose)")


@functools.lru_cache(maxsize=1 << 16)
def _loopback(addr: str) -> bool:
    # Cached: every round formation asks it about every member, and parsing an address costs ~10 us
    # (at 5,000 members that was most of the 0.1-0.2 s a failure report took to answer).
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return addr == "localhost"


def candidates(job: JobRecord) -> list[str]:
    members = job.round.members if job.round is not None else []
    return [n for n in members if n in job.nodes] + job.waiting + job.spares


WITNESSES = 2      # other members each node may probe while the server is silent


def growth_cause(job: JobRecord) -> RoundCause:
    """A round formed because nodes arrived: the job's first, or a scale-up."""
    return RoundCause.SCALE_UP if job.last_round_id else RoundCause.START


def deadlines(job: JobRecord) -> Iterable[float]:
    yield from (n.lease_expires for n in job.nodes.values() if n.holding == 0)   # held: no lease runs
    yield from (job.nodes[n].excluded_until for n in job.excluded)
    if job.last_call_deadline is not None:
        yield job.last_call_deadline
    if job.state == JobState.WAITING and job.last_call_deadline is None and job.join_deadline is not None:
        yield job.join_deadline     # a pending last call forms a round: the join timeout waits for it


def count_nodes(nodes: list[str]) -> str:
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"


def node_status(job: JobRecord, node_id: str, now: float, *, accepted: bool = True, reason: str = "") -> NodeStatus:
    """Where `node_id` stands in its job; built fresh (assignments and failures in it are frozen)."""
    node = job.nodes.get(node_id)
    state = node.state if node is not None and not job.state.finished else NodeState.GONE
    status = NodeStatus(job_id=job.job_id, job_state=job.state, node_state=state,
                        round_id=job.round.round_id if job.round else -1, restart_count=job.restart_count,
                        accepted=accepted, reason=reason or job.reason,
                        lease_timeout_s=job.config.lease_timeout_s)
    if job.state.finished:
        status.root_cause = job.root_cause if job.state == JobState.FAILED else None
        if job.round is not None and node_id in job.round.assignments:
            status.assignment = job.round.assignments[node_id]
    elif state == NodeState.MEMBER and job.round is not None:
        status.assignment = job.round.assignments[node_id]
    elif state == NodeState.SPARE:
        status.spare_position = job.spares.index(node_id)
    elif state == NodeState.EXCLUDED and node is not None:
        status.excluded_for_s = max(0.0, node.excluded_until - now)
    return status


def describe(f: WorkerFailure) -> str:
    """One line for a failed worker: rank, host, how it ended, its message (line breaks escaped: the
    line becomes the job's reason, which agents print and refusals quote)."""
    how = f"signal {f.signal}" if f.signal else f"exit code {f.exitcode}"
    what = f"{f.reason}, {how}" if f.reason and f.reason != "exited" else how
    text = f"rank {f.rank} (local {f.local_rank}) on {f.host or f.node_id}: {what}"
    return f"{text}: {one_line(f.message)}" if f.message else text
