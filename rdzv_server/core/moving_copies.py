"""A live member's copies when a round pairs it with another holder (JobRecord.copies_moving).

A round names each member's holders anew (rounds.Derived.replica_ranks): a spare of another failure domain, a node
that joins or leaves turns the pairing. The old holder no longer has the member among its sources, and its new
holder has no copy until the member's first push there lands (seconds to minutes with --replica-bandwidth). Until
then the old holder's copy is the member's only one off its host: it is kept there (Assignment.copies_wanted) and a
loss of the member fetches it from there, after the new holder (a review: the old holder dropped it as the round
began, the member was lost before its new copy landed, and every rank of a job of shards went back to step 0).
"""
from __future__ import annotations

from collections.abc import Callable

from rdzv_server.core.records import JobRecord, PlaceCopies, RoundRecord

PlaceOf = Callable[[RoundRecord, str], PlaceCopies | None]


def with_old_holders(job: JobRecord, gone: str, place: PlaceCopies | None) -> PlaceCopies | None:
    """`gone`'s place with the holders its copy may still be only at appended after its first holder (the fetch's
    second source, rounds.copies_held: the new holder first, which has the newer copy once it landed)."""
    moved = job.copies_moving.get(gone)
    if place is None or moved is None or (moved.rank_offset, moved.local_size) != (place.rank_offset,
                                                                                  place.local_size):
        return place
    old = [h for h in moved.holders if h not in place.holders]
    return PlaceCopies(holders=[*place.holders[:1], *old, *place.holders[1:]], rank_offset=place.rank_offset,
                       local_size=place.local_size, epoch=place.epoch)


def landed(job: JobRecord, r: RoundRecord, node_id: str, holders: list[str]) -> bool:
    """Whether the node's newest copy, as its note says, is at one of `holders` that is a member of round `r` (its
    agent pushed to their address and copy port; a holder gone since took the copy with it)."""
    c = job.nodes[node_id].copies if node_id in job.nodes else None
    if c is None or c.copied_step < 0 or not c.holder:
        return False
    ranked = r.ranked or r.members
    at = {f"{r.addrs[i]}:{r.copy_ports[i]}" for i, m in enumerate(ranked) if m in holders}
    return c.holder in at


def update(job: JobRecord, last: RoundRecord | None, r: RoundRecord, place_of: PlaceOf) -> None:
    """job.copies_moving for round `r`: each member whose copy has not yet landed at its holders of the last round
    (`last`, or the places the job kept while it waited) keeps the place it had (an earlier move's, or the last
    round's own where `r` turns its holders). O(members)."""
    members = set(r.members)
    moving: dict[str, PlaceCopies] = {}
    for m in (r.ranked or r.members) if r.replicas else ():
        if (was := place_of(last, m) if last is not None else job.place_copies.get(m)) is None:
            continue
        now = place_of(r, m)
        there = landed(job, r, m, was.holders)
        if (kept := job.copies_moving.get(m)) is not None and not there:
            src = kept            # its copy is still only where an earlier move left it
        elif now is not None and not set(now.holders) >= set(was.holders) and there and \
                not set(now.holders) & set(was.holders) & members:
            src = was             # `r` turns all its holders: its copy is at the last round's
        else:
            # Landed where it goes, holders unchanged, or no copy anywhere to keep; or (--replicas 2) a holder of the
            # last round stays one: it has the newest copy, and a fetch asks two holders at most (copies_at, _also),
            # so an old holder's older copy would be asked in its stead (a review: resumed older than it could)
            continue
        if old := [h for h in src.holders if h in members and (now is None or h not in now.holders)]:
            moving[m] = PlaceCopies(holders=old, rank_offset=src.rank_offset, local_size=src.local_size,
                                    epoch=src.epoch)
    job.copies_moving = moving
