"""Who the next round is (pure): the candidates in group-rank order, capped at max_nodes, the nodes still preparing
kept where they wait, and which gone node's place each newcomer takes. JobRules.form_round applies the choice."""
from __future__ import annotations

from dataclasses import dataclass

from rdzv_server.core.events import RoundCause
from rdzv_server.core.records import JobRecord


@dataclass(frozen=True)
class Choice:
    chosen: list[str]           # the next round's members, by group rank
    rest: list[str]             # ready nodes past max_nodes: spares
    preparing: list[str]        # waiting nodes and spares still preparing: kept where they wait, not dropped
    took: dict[str, str]        # newcomer -> the gone node whose place it takes (places_taken)


def choose(job: JobRecord) -> Choice:
    pool = candidates(job)
    chosen, pooled = pool[: job.config.max_nodes], set(pool)
    return Choice(chosen, pool[job.config.max_nodes:], [n for n in job.waiting + job.spares if n not in pooled],
                  places_taken(job, chosen))


def candidates(job: JobRecord) -> list[str]:
    """The next round's nodes in group-rank order. A member still here keeps its place; a place its member left (lost,
    left, drained, excluded) goes to the first waiting node or spare, so every survivor keeps its group rank and
    so its global ranks (a sharded snapshot stays its own), and the newcomer takes the ranks, and the shards, of
    the node it replaces. A place nobody takes is filled from the end: the last survivor moves into it and takes
    the gone node's ranks (and its copies: places_taken), so every other survivor keeps its ranks and the
    snapshots of them (where all behind it closed up, every one of them held ranks nobody had saved). While the
    job waits for nodes, the last round's places are kept (`job.places`) for the survivors waiting. Only ready
    nodes are candidates (JoinRequest.ready)."""
    if job.round is not None:          # a member keeps its place, whatever it says of its next start
        places, stay = job.round.ranked or job.round.members, set(job.round.members)
    else:
        places, stay = job.places, {n for n in job.waiting if job.nodes[n].ready}
    holders = {n for n in places if n in stay and n in job.nodes}
    # a node still preparing enters no round (it would hold up every other node): it stays where it is
    ready = [n for n in job.waiting + job.spares if n not in holders and job.nodes[n].ready]
    given = reshaped(job, places, holders, ready)
    holders -= set(given)                 # their new agents wait behind the places, as the other newcomers do
    ready += list(given)
    takers = iter([n for n in ready if n not in given.values()])
    pool: list[str | None] = [n if n in holders else given[n] if n in given else next(takers, None) for n in places]
    last = len(pool) - 1                 # one pass, gaps from the front, movers from the back (a rack lost at once)
    for gap in range(len(pool)):
        if pool[gap] is not None:
            continue
        while last > gap and pool[last] is None:
            last -= 1
        if last <= gap:
            break
        pool[gap], pool[last] = pool[last], None
    return [n for n in pool if n is not None] + list(takers)


def reshaped(job: JobRecord, places: list[str], holders: set[str], ready: list[str]) -> dict[str, str]:
    """While the job waits, the places whose node is back with another number of workers (its agent restarted with
    another --nproc-per-node, or a GPU fewer under `gpu`) in a job whose ranks hold their own state -> the ready
    waiting node or spare (of `ready`) that runs the place's old number and takes it instead: with the node in its
    place its ranks and those after it would move, no snapshot in memory would be of them and every rank would go
    back to the script's own checkpoint or step 0, where the taker resumes the place's ranks from the node's copies
    and every other rank from its own memory (a review: 3 x 2 with a ready spare of 2, one agent back with 1: every
    rank from step 0). The node then comes after the others (a spare where the round is full)."""
    sizes = job.places_sizes if job.round is None else []
    if len(sizes) != len(places) or job.progress.all_alike:     # DDP; not HSDP (replicas within a shard)
        return {}
    given: dict[str, str] = {}
    for place, size in zip(places, sizes, strict=True):
        if place not in holders or job.nodes[place].local_world_size == size:
            continue
        taker = next((n for n in ready if n not in given.values() and job.nodes[n].local_world_size == size), None)
        if taker is not None:
            given[place] = taker
    return given


def places_taken(job: JobRecord, chosen: list[str]) -> dict[str, str]:
    """Of the round about to form from `chosen`, each node at a place another held in the last round (gone since)
    -> that other node: a newcomer that takes over its ranks and its shards. A node back at its own place with a
    record made since that round (its agent restarted, or it was lost and came back) -> itself: a new incarnation,
    whose memory may be gone with its predecessor (it then fetches its own copies)."""
    if job.round is not None:
        places, since = job.round.ranked or job.round.members, job.round.completed_at
    else:
        places, since = job.places, job.places_at
    kept = set(chosen)
    return {nid: places[i] for i, nid in enumerate(chosen[:len(places)])
            if (places[i] != nid and places[i] not in kept) or (places[i] == nid and job.nodes[nid].joined_at > since)}


def growth_cause(job: JobRecord) -> RoundCause:
    """A round formed because nodes arrived: the job's first, or a scale-up."""
    return RoundCause.SCALE_UP if job.last_round_id else RoundCause.START


def count_nodes(nodes: list[str]) -> str:
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
