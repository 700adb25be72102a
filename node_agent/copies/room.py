"""How much a holder takes: each node whose copies it holds gets an equal share of its limit, no copy exceeds the
limit, and the file system keeps a reserve for the holder's own workers. Pure: the store (store.py) says what it
holds and what pushes under way have reserved."""
from __future__ import annotations

from collections.abc import Collection

from node_agent.copies import files
from node_agent.copies.refusal import Refusal
from node_agent.copies.wire import PushRequest
from node_agent.training.headroom import FS_RESERVE


def refusal(req: PushRequest, copies: list[files.Copy], pushing: dict[tuple[str, int], int], limit: int,
            nodes: int, free: int, total: int) -> str | None:
    """Why the push `req` does not fit (None: it does). `pushing`: (node, rank) -> bytes reserved by pushes under
    way; `nodes`: how many nodes' copies this one holds; `free`/`total`: its file system's bytes."""
    why = beyond_share(req, copies, pushing, limit, nodes)
    if why is not None:
        return why
    size, held = req.size, sum(c.size for c in copies)
    mine = sum(c.size for c in copies if (c.node, c.rank) == (req.node, req.rank))
    reserved = sum(pushing.values())
    if held + reserved + size > limit:
        return (f"{held} bytes held ({mine} of them this rank's current copy, kept until the new one is whole), "
                f"{reserved} reserved by pushes under way, {size} new; limit {limit} bytes")
    if free - reserved - size < total * FS_RESERVE:
        return (f"the holder's file system would keep less than {FS_RESERVE:.0%} of its {total} bytes free ({free} "
                f"free, {reserved} reserved, {size} new): left to its own workers (NCCL's and DataLoaders' shared "
                f"memory)")
    return None


def spares_to_go(req: PushRequest, copies: list[files.Copy], order: list[files.Copy],
                 pushing: dict[tuple[str, int], int], limit: int, nodes: int, free: int,
                 total: int) -> list[files.Copy]:
    """The fewest spares of `order` (the first to go first) whose going makes the push `req`, refused by a node's
    share or the file system's reserve, fit; none where it still would not. A review: a's push over a's share
    (its own spare counted) took every spare, a lost node's with them, which its place's fetch may want."""
    for n in range(1, len(order) + 1):
        gone = order[:n]
        rest = [c for c in copies if c not in gone]
        if refusal(req, rest, pushing, limit, nodes, free + sum(c.size for c in gone), total) is None:
            return gone
    return []


def beyond_share(req: PushRequest, copies: list[files.Copy], pushing: dict[tuple[str, int], int], limit: int,
                 nodes: int) -> str | None:
    """Why the push `req` exceeds what its node may hold here whatever else is held (None: it does not): checked
    before anything is evicted to make room for it (a review: a member's push of 2**40 bytes, refused anyway, first
    removed a lost node's copies, those its replacement was about to fetch)."""
    size = req.size
    share = limit // max(1, nodes)
    theirs = sum(c.size for c in copies if c.node == req.node) + \
        sum(n for (node, _), n in pushing.items() if node == req.node)
    if nodes > 1 and theirs + size > share:
        return (f"node {req.node}'s share full: {theirs} bytes held or coming of its copies, {size} new; its share "
                f"is {share} bytes (the limit of {limit} bytes over the {nodes} nodes whose copies this one holds)")
    if size > limit:
        return f"the copy's {size} bytes exceed the limit of {limit} bytes"
    return None


def superseded(req: PushRequest, copies: list[files.Copy]) -> list[files.Copy]:
    """The pushing rank's copies this push supersedes that no node taking its place could use meanwhile: older than
    the push, and not the node's common step (a restore needs one step on every rank: files.settle keeps it). A
    review (a small /dev/shm) saw a rank's newest kept beside the old common step while another rank's push was
    refused, and every later push refused at the limit: the copies frozen hundreds of steps behind for good."""
    mine = [c for c in copies if c.node == req.node]
    ranks: dict[int, set[int]] = {}
    for c in mine:
        ranks.setdefault(c.rank, set()).add(c.step)
    common = max(set.intersection(*ranks.values()), default=None) if ranks else None
    return [c for c in mine if c.rank == req.rank and c.step < req.step and c.step != common]


def evictions(copies: list[files.Copy], over: int, pusher: str, last: dict[str, float], now: float,
              evict_after: float, moving: Collection[str]) -> list[tuple[str, str]]:
    """The nodes whose copies go to make room for `pusher`'s push, `over` bytes past the limit, each with why. First
    those not renewed for `evict_after` seconds (`last`: each node's newest copy's time): gone from the job, their
    place taken long since, the longest silent first. Then, if still over, those of `moving` (live members whose
    copies go to another holder now, none a source of this one: kept as the second place a loss fetches from),
    the least recently renewed first, and only where they free enough: none is dropped for a push that still does
    not fit. A review: with room for fewer than three copies, a moving one held back the holder's own source's pushes
    until it went unrenewed for `evict_after`, and that source's copies went ten minutes stale."""
    size: dict[str, int] = {}
    for c in copies:
        size[c.node] = size.get(c.node, 0) + c.size
    out: list[tuple[str, str]] = []
    for node, at in sorted(last.items(), key=lambda item: item[1]):
        if over <= 0 or now - at < evict_after:
            break
        if node != pusher:
            over -= size.get(node, 0)
            out.append((node, f"not renewed for {now - at:.0f}s"))
    gone = {node for node, _ in out}
    rest = sorted((n for n in moving if n in size and n != pusher and n not in gone), key=lambda n: last.get(n, 0.0))
    if 0 < over <= sum(size[n] for n in rest):
        for node in rest:
            if over <= 0:
                break
            over -= size[node]
            out.append((node, "of a member whose copies go to another holder now (kept here while room allowed)"))
    return out


def check_incarnation(req: PushRequest, copies: list[files.Copy], ranks: int, now: int) -> None:
    """A push of one of its node's ranks, not of a round older than the node's newest held, nor past this
    node's own round, and past the step held of its own round."""
    if ranks and req.rank >= ranks:
        raise Refusal("rank", f"rank {req.rank} is not one of node {req.node}'s {ranks} local ranks")
    if req.round > now:
        raise Refusal("round", f"round {req.round} is past this node's round ({now}): tried again later")
    theirs = [c for c in copies if c.node == req.node]
    newest = max((c.round for c in theirs), default=-1)
    if req.round < newest:
        raise Refusal("stale", f"stale round {req.round} (holding copies of round {newest})")
    same = [c.step for c in theirs if c.rank == req.rank and c.round == req.round]
    if same and req.step <= max(same):
        raise Refusal("stale", f"stale step {req.step} (holding {max(same)} of round {req.round})")
