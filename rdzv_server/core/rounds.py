"""Turning an ordered list of member nodes into one round's assignments; what a node sees of its round.

Group rank is the position in the list; a node's rank offset is the sum of the local world sizes before it, so
nodes may run different numbers of workers. MASTER_ADDR/PORT are the group-rank-0 node's: its rank 0 hosts the store.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from protocol.bounds import MAX_PREPARE_S
from protocol.messages import (
    Assignment,
    CopySource,
    Witness,
)
from protocol.tokens import copy_verifier
from rdzv_server.core import awaiting, moving_copies
from rdzv_server.core.addresses import reachable_addresses
from rdzv_server.core.credentials import copy_token
from rdzv_server.core.records import JobRecord, NodeRecord, PlaceCopies, RoundRecord


def build_round(job: JobRecord, members: list[str], round_id: int, opened_at: float, now: float,
                reason: str, took: dict[str, str] | None = None) -> RoundRecord:
    """The round of `members` (by group rank): what assignments are computed from, taken from their records now.
    No assignment is built here: a failure report is answered before any is needed. `took`: newcomer -> the gone
    node whose place it takes (places_taken), told where that node's copies are (the last round's holders)."""
    nodes = [job.nodes[nid] for nid in members]
    sizes = [n.local_world_size for n in nodes]
    replicas = job.config.replicas if job.replica_key else 0
    r = RoundRecord(round_id=round_id, members=list(members), opened_at=opened_at, completed_at=now,
                    reason=reason, world_size=sum(sizes), restart_count=job.restart_count,
                    ranked=list(members), local_sizes=sizes, roles=[n.role for n in nodes],
                    addrs=reachable_addresses(nodes), witness_ports=[n.witness_port for n in nodes],
                    master_port=nodes[0].master_port, max_restarts=job.config.max_restarts,
                    domains=[n.domain or n.host for n in nodes],
                    # An older agent checks copy keys against its sources' tokens: it takes no part (it would learn
                    # them and could act for those nodes for good), as one with no copy port
                    copy_ports=[n.copy_port if n.copy_verifiers else 0 for n in nodes],
                    replicas=replicas, replica_key=job.replica_key, run=run_of(job),
                    resume_at_most=job.resume_at_most, ranks_alike=job.progress.all_alike,
                    noted_step=awaiting.noted_step(job, members))
    job.resume_at_most = -1           # told once: to the round that resumes
    pending = fetches_pending(job, members, took or {})
    # A newcomer in the place of a member lost mid-fetch takes that fetch over: the place's state is those copies
    unfinished, job.unfinished_fetches = job.unfinished_fetches, {}
    took = {new: unfinished[gone].of if gone in unfinished else gone for new, gone in (took or {}).items()}
    took.update({m: place[0] for m, place in pending.items()})
    if replicas and took:
        last = job.round

        def place(gone: str) -> PlaceCopies | None:      # the last round's, or the one a fetch was told
            told = next((p for g, p in pending.values() if g == gone), None)
            if told is not None and gone in members:     # back meanwhile: its place now is not the one fetched
                return told
            found = moving_copies.with_old_holders(job, gone, place_of(last, gone) if last is not None else
                                                   job.place_copies.get(gone))
            return found or told or next((u.place for u in unfinished.values() if u.of == gone), None)

        r.copies = copies_held(place, took, r, lambda gone: own_source(job, gone, nodes))
        told_tokens(job, r, place)
        for newcomer, (gone, *_) in r.copies.items():
            told = place(gone)
            # Told again while it holds nothing, but not past a cap (replicas diverged): a fetch told again would
            # carry none, and bring back the gone node's newest, the step the job went back from.
            if told is not None and r.resume_at_most < 0:
                job.nodes[newcomer].fetch_of, job.nodes[newcomer].fetch_place = gone, told
            else:
                job.nodes[newcomer].fetch_of, job.nodes[newcomer].fetch_place = "", None
    moving_copies.update(job, job.round, r, place_of)     # (after place(): a lost member's old holders)
    r.copies_wanted, r.copies_moving = awaiting.copies_wanted(job, members, r.copies) if replicas else (None, [])
    r.copy_epochs = copy_epochs(job, members)     # after told_tokens: a fetch is told the epoch before any new one
    return r


def copy_epochs(job: JobRecord, members: list[str]) -> dict[str, int]:
    """The members' copy token epochs for a new round: a member whose token another node was told (it took the
    member's place, and fetched with it) gets a new one, so that node cannot push or drop its copies afterwards
    (a review: a spare that once took b's place could overwrite b's copy with junk for the job's life)."""
    for m in members:
        if m in job.copies_told:
            job.copies_told.remove(m)
            job.copy_epochs[m] = job.copy_epochs.get(m, 0) + 1
    return {m: e for m in members if (e := job.copy_epochs.get(m, 0))}


def told_tokens(job: JobRecord, r: RoundRecord, place: Callable[[str], PlaceCopies | None]) -> None:
    """The gone nodes whose copies a newcomer fetches in round `r`: told with the epoch their copies came with, that
    of the place they are fetched from (a fetch told again, in any later round, while the gone node is a member anew:
    not its new token, which the fetcher could act for it with, nor one its holders' copies never came with)."""
    for newcomer, (gone, *_) in r.copies.items():
        if newcomer != gone:             # (a node back at its own place fetches its own: nobody else learns it)
            r.told_epochs[newcomer] = held.epoch if (held := place(gone)) is not None else \
                job.copy_epochs.get(gone, 0)
            if gone not in job.copies_told:
                job.copies_told.append(gone)


def fetches_pending(job: JobRecord, members: list[str], took: dict[str, str]) -> dict[str, tuple[str, PlaceCopies]]:
    """Members told in an earlier round to fetch a gone node's copies whose polls since say they hold no snapshot
    of their own (its holder was lost mid-fetch, say), with where those copies were: told again, else their ranks
    hold nothing and every rank goes back to disk with them. One whose poll shows a snapshot is done with it. One
    back at its own place with a new agent (`took` itself) that had not ended such a fetch fetches it again: its
    place's state is those copies, not any of its own (admission.py)."""
    out: dict[str, tuple[str, PlaceCopies]] = {}
    for m in members:
        node = job.nodes[m]
        if not node.fetch_of or node.fetch_place is None or took.get(m, m) != m or node.copies is None:
            continue
        if node.copies.local_step >= 0:     # done, or its own copy still landing (kept for its loss: gone_nodes)
            if not awaiting.fetch_unfinished(node):
                node.fetch_of, node.fetch_place = "", None
        else:
            out[m] = (node.fetch_of, node.fetch_place)
    return out


def run_of(job: JobRecord) -> str:
    """The job's run (Assignment.run): a finished job's id starts a new run, with a record made anew."""
    return hashlib.sha256(f"{job.job_id}\0{job.created_at!r}".encode()).hexdigest()[:16]


def master_of(r: RoundRecord) -> str:
    """Round `r`'s group-rank-0 node: its agent hosts the round's store."""
    return (r.ranked or r.members)[0]


def copy_addr(r: RoundRecord, node: str) -> str:
    """Where `node`'s agent takes peer copies in round `r`, as a member's note names its holder ("": no member)."""
    rank = _derived(r).rank.get(node)
    return f"{r.addrs[rank]}:{r.copy_ports[rank]}" if rank is not None and r.copy_ports else ""


def give_master_port(r: RoundRecord, port: int) -> None:
    """Round `r`'s store port, given after it formed (store_port.py); assignments derived before it are dropped."""
    r.master_port = port
    r.__dict__.pop("derived", None)


def place_of(r: RoundRecord, node: str) -> PlaceCopies | None:
    """Where `node`'s copies went in round `r`, and the ranks they are of (None: it was no member)."""
    derived = _derived(r)
    rank = derived.rank.get(node)
    if rank is None:
        return None
    ranked = r.ranked or r.members
    return PlaceCopies(holders=[ranked[i] for i in derived.replica_ranks(rank)], rank_offset=derived.offsets[rank],
                       local_size=r.local_sizes[rank], epoch=r.copy_epochs.get(node, 0))


def places_kept(r: RoundRecord) -> dict[str, PlaceCopies]:
    """Every member's place_of, kept while the job waits for nodes (JobRecord.place_copies): O(N), once."""
    if not r.replicas:
        return {}
    return {nid: place for nid in (r.ranked or r.members) if (place := place_of(r, nid)) is not None}


def serves_itself(job: JobRecord, node_id: str) -> bool:
    """Whether a node that lives on in the job (a suspect swapped out, excluded) serves its own snapshots to the
    node taking its place (node_agent/copies/own.py): the job makes copies and the node takes them."""
    node = job.nodes.get(node_id)
    return node is not None and bool(node.copy_port) and bool(job.replica_key) and job.config.replicas > 0


def own_source(job: JobRecord, node_id: str, members: list[NodeRecord]) -> Witness | None:
    """Where that node serves them (None: it does not). The newcomer needs no peer copy then, and gets the
    snapshot the swap waited for."""
    if not serves_itself(job, node_id):
        return None
    node = job.nodes[node_id]
    return Witness(addr=reachable_addresses([*members, node])[-1], port=node.copy_port)


def copies_held(place: Callable[[str], PlaceCopies | None], took: dict[str, str], r: RoundRecord,
                itself: Callable[[str], Witness | None] = lambda gone: None) -> dict[str, list[str]]:
    """Newcomer -> [the gone node whose place it takes, where that node's snapshots are], for each gone node whose
    ranks the newcomer takes exactly (the same global ranks: a shard is one rank's; a newcomer of another size or
    offset gets none): the gone node itself where it lives on (`itself`: its agent, kept in r.copies_from), else
    the members of round `r` holding its copies (two at most: the second asked where the first has none)."""
    out: dict[str, list[str]] = {}
    derived = _derived(r)
    members = derived.rank
    for newcomer, gone in took.items():
        held, at = place(gone), members.get(newcomer)
        if held is None or at is None or (derived.offsets[at], r.local_sizes[at]) != (held.rank_offset,
                                                                                         held.local_size):
            continue
        holders = [h for h in held.holders if h in members]
        if gone not in members and (own := itself(gone)) is not None:
            out[newcomer] = [gone, gone, *holders[:1]]    # the holder if it fails
            r.copies_from[newcomer] = own
        elif holders:       # a second holder (--replicas 2) if the first has none (a review: step 0 where it had)
            out[newcomer] = [gone, *holders[:2]]
    return out


def copies_lost(r: RoundRecord, took: dict[str, str]) -> str:
    """What a round-formed message says of the gone nodes whose copies went with them ("": none)."""
    gone = [old for new, old in took.items() if new not in r.copies and new != old] if r.replicas else []
    if not gone:
        return ""
    # (a review: a lone node's round had no peer at all, and no replica held a snapshot: step 0 followed)
    then = ("each rank resumes from the newest snapshot a replica holds (the ranks are replicas), else from disk or "
            "step 0") if r.ranks_alike else "every rank resumes from disk"   # a DDP job's moved ranks keep theirs
    return (f"; no copy of {', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''}'s snapshots is left (it had no "
            f"peer to hold them, its peer was lost too, or its ranks are not the newcomer's): {then}")


def copies_off(r: RoundRecord | None, replicas: int, launcher: str = "") -> str:
    """Why round `r` makes no peer copies at all, and what to change ("": some member's copies have a holder, or
    there is no round). A job whose copies cannot act says so, once, rather than lose a node's work silently.
    `launcher`: the job's (JobRecord.launcher); torchrun's plugin keeps no snapshots, so none are copied."""
    if r is None:
        return ""
    if not replicas:
        return "off (--replicas 0): a lost node's ranks resume from disk; --replicas 1 keeps a copy on a peer"
    if launcher == "torchrun" and not any(r.copy_ports):
        return ("off: torchrun starts this job's workers (the rdzv-server plugin), which keeps no in-memory "
                "snapshots: start the nodes with node-agent for snapshots and their peer copies")
    if not r.replicas:
        return "off: the job has no key for them (it was made by an agent without the server's credential)"
    if not any(r.copy_ports):
        return ("off: no member takes copies (their agents run with --no-memory-dir, or the server uses TLS and they "
                "have no --tls-cert and --tls-key)")
    if len(r.members) < 2:        # no peer at all: naming --failure-domain would send an operator who set it astray
        return "off: the round has one node, with no peer to hold its copies (lost now, its newest snapshot goes)"
    groups = _derived(r).domain_groups()
    if len(groups.order) < 2:
        return (f"off: every member is in one failure domain ({groups.order[0]!r}; a host is its own by default), "
                f"where a copy is lost with its node: start each host's agents with --failure-domain naming it "
                f"(or its rack)")
    return ""


def _derived(r: RoundRecord) -> _Derived:
    derived: _Derived | None = r.__dict__.get("derived")
    if derived is None:
        derived = r.__dict__["derived"] = _Derived(r)
    return derived


def assignment(r: RoundRecord, node_id: str) -> Assignment | None:
    """`node_id`'s assignment in round `r` (None: it was not formed into it); built once, then kept."""
    if r.legacy:
        return r.legacy.get(node_id)
    derived = _derived(r)
    built = derived.built.get(node_id)
    if built is None:
        rank = derived.rank.get(node_id)
        if rank is None:
            return None
        role = r.roles[rank]
        copies_of, copies_at, copies_also = derived.copies(node_id)
        built = derived.built[node_id] = Assignment(
            round_id=r.round_id, group_rank=rank, group_world_size=len(r.ranked), rank_offset=derived.offsets[rank],
            world_size=r.world_size, local_world_size=r.local_sizes[rank], master_addr=r.addrs[0],
            master_port=r.master_port, restart_count=r.restart_count, max_restarts=r.max_restarts,
            role_rank_offset=derived.role_offsets[rank], role_world_size=derived.role_sizes[role],
            witnesses=derived.witnesses(rank), replicas=derived.replica_targets(rank),
            copy_token=copy_token(r.replica_key, node_id, r.copy_epochs.get(node_id, 0)) if r.replicas else "",
            copy_sources=derived.sources(rank), copies_of=copies_of,
            copies_token=copy_token(r.replica_key, copies_of, r.told_epochs.get(node_id, r.copy_epochs.get(
                copies_of, 0))) if copies_of else "",
            copies_at=copies_at, copies_also=copies_also, run=r.run, resume_at_most=r.resume_at_most,
            ranks_alike=r.ranks_alike, noted_step=r.noted_step, copies_wanted=derived.wanted(),
            copies_moving=derived.moving(), copies_fetched=derived.fetched())
    return built


@dataclass(frozen=True)
class _Domains:
    order: list[str]                 # the failure domains, in order of first appearance
    index: dict[str, int]            # a domain -> its place in `order`
    members: dict[str, list[int]]    # a domain -> its members that take copies, by group rank
    position: dict[int, int]         # a member -> its place in its domain's list


class _Derived:
    """What the assignments of a round share, derived once from its columns (O(N))."""

    def __init__(self, r: RoundRecord) -> None:
        self.rank = {nid: i for i, nid in enumerate(r.ranked)}
        self.offsets = list(itertools.accumulate(r.local_sizes, initial=0))
        self.role_sizes: dict[str, int] = {}
        self.role_offsets: list[int] = self.offsets
        if len(set(r.roles)) > 1:            # one role (the usual case): its offsets are the ranks'
            self.role_offsets = []
            for role, size in zip(r.roles, r.local_sizes, strict=True):
                at = self.role_sizes.get(role, 0)
                self.role_offsets.append(at)
                self.role_sizes[role] = at + size
        elif r.roles:
            self.role_sizes[r.roles[0]] = r.world_size
        self.witness_ranks = [i for i, port in enumerate(r.witness_ports) if port]
        named = [Witness(addr=r.addrs[i], port=r.witness_ports[i]) for i in self.witness_ranks]   # each shared
        self.ring = named + named[:WITNESSES]      # the next WITNESSES from any position, without wrapping
        self.built: dict[str, Assignment] = {}
        self.round = r
        self._groups: _Domains | None = None
        self._sources: dict[int, list[int]] | None = None
        self._wanted: tuple[str, ...] | None = None
        self._moving: tuple[str, ...] | None = None
        self._fetched: tuple[str, ...] | None = None

    def wanted(self) -> tuple[str, ...] | None:
        """copies_wanted: one tuple all members' assignments share (read late: build_round sets it after this)."""
        if self._wanted is None and self.round.copies_wanted is not None:
            self._wanted = tuple(self.round.copies_wanted)
        return self._wanted

    def moving(self) -> tuple[str, ...]:
        """copies_moving: one tuple all members' assignments share, as copies_wanted."""
        if self._moving is None:
            self._moving = tuple(self.round.copies_moving)
        return self._moving

    def fetched(self) -> tuple[str, ...] | None:
        """copies_fetched: the gone nodes this round tells its members to fetch (RoundRecord.copies), shared."""
        if self._fetched is None and self.round.copies_wanted is not None:
            self._fetched = tuple(sorted({gone for gone, *_ in self.round.copies.values()}))
        return self._fetched

    def witnesses(self, rank: int) -> tuple[Witness, ...]:
        """The next WITNESSES members after `rank` in the ring that answer as witnesses, never itself: a different pair
        for each node, found by bisection (a walk of the ring per member is O(N^2) when few answer)."""
        witness_ranks, m = self.witness_ranks, len(self.witness_ranks)
        after = bisect.bisect_right(witness_ranks, rank) % m if m else 0      # the first witness after `rank`
        if m > WITNESSES:     # the member itself comes last going round from there: never among the first
            return tuple(self.ring[after:after + WITNESSES])
        return tuple(self.ring[(after + k) % m] for k in range(m) if witness_ranks[(after + k) % m] != rank)

    def replica_ranks(self, rank: int) -> list[int]:
        """Where `rank`'s copies go: members that take copies (JoinRequest.copy_port) in the next
        `replicas` other failure domains, in order of first appearance, each at the same position in its domain as
        `rank` in its own (modulo that domain's size). Copies spread evenly whether domains are interleaved (a
        host each: the next member) or in blocks (racks: rack A's i-th member to rack B's i-th)."""
        r = self.round
        if not r.replicas or not r.copy_ports or not r.copy_ports[rank]:
            return []
        g = self.domain_groups()
        own = g.index[r.domains[rank]]
        others = [g.order[(own + k) % len(g.order)] for k in range(1, min(r.replicas, len(g.order) - 1) + 1)]
        return [g.members[d][g.position[rank] % len(g.members[d])] for d in others]

    def domain_groups(self) -> _Domains:
        """The members that take copies, by failure domain; made once per round: O(N)."""
        if self._groups is None:
            r = self.round
            members: dict[str, list[int]] = {}
            for i, port in enumerate(r.copy_ports):
                if port:
                    members.setdefault(r.domains[i], []).append(i)
            self._groups = _Domains(order=list(members), index={d: k for k, d in enumerate(members)},
                                    members=members,
                                    position={i: k for ranks in members.values() for k, i in enumerate(ranks)})
        return self._groups

    def sources(self, rank: int) -> tuple[CopySource, ...]:
        """The members whose copies `rank` holds this round, with their tokens' verifiers (the inverse of
        replica_ranks, made once per round: O(N x replicas))."""
        r = self.round
        if not r.replicas:
            return ()
        if self._sources is None:
            self._sources = {}
            for i in range(len(r.ranked)):
                for h in self.replica_ranks(i):
                    self._sources.setdefault(h, []).append(i)
        ranked = r.ranked or r.members
        return tuple(CopySource(node_id=ranked[i], ranks=r.local_sizes[i], verifier=copy_verifier(
            copy_token(r.replica_key, ranked[i], r.copy_epochs.get(ranked[i], 0))))
            for i in self._sources.get(rank, ()))

    def replica_targets(self, rank: int) -> tuple[Witness, ...]:
        r = self.round
        return tuple(Witness(addr=r.addrs[i], port=r.copy_ports[i]) for i in self.replica_ranks(rank))

    def copies(self, node_id: str) -> tuple[str, Witness | None, Witness | None]:
        """(the gone node whose snapshots `node_id` fetches, where from, and where else: its peer copies' holder
        when the first is the node itself, or a second holder), or ("", None, None)."""
        r = self.round
        held = r.copies.get(node_id) if r.replicas else None
        if held is None:
            return "", None, None
        also = self._copy_port(held[2]) if len(held) > 2 else None
        at = r.copies_from.get(node_id) or self._copy_port(held[1])
        return (held[0], at, also) if at is not None else ("", None, None)

    def _copy_port(self, member: str) -> Witness | None:
        at = self.rank.get(member)
        return Witness(addr=self.round.addrs[at], port=self.round.copy_ports[at]) if at is not None else None


WITNESSES = 2      # other members each node may ask while the server is silent
PREPARE_LIMIT_S = MAX_PREPARE_S + 30.0   # a node preparing this long is said (its agent never said it was ready)
