"""A suspect that can go on (a node named slow, with --replace-slow-nodes) is swapped for a ready spare at the
job's next snapshot, so that no step is redone:
- every member's ranks are asked to wait after their next snapshot (NodeStatus.hold_at_snapshot); ranks that did
  not see the ask yet block in the next step's collectives on those that wait, so no rank gets past it;
- once a node says its ranks wait after step S (ProgressNote.held_step), the suspect is held out as any suspect
  is (suspects.quarantine) and the spare takes its place and ranks in a round formed at once, which resumes from
  S: the spare fetches the suspect's snapshots from the suspect itself (rounds.own_source) once its own ranks
  hold S too (a slow node writes its snapshot last: fetched before, the newest there is older, and the steps
  since are redone), or, where it takes no copies, from its peer once its copy of S is there
  (CopiesNote.copied_step).
It swaps at once when there is no snapshot to wait for (no member holds one yet, or the suspect neither serves its
snapshots nor makes peer copies: the spare could not resume from it anyway), and after SWAP_WAIT_S when none came
(said: the steps since the last one are redone). Without a ready spare nothing is swapped: the node stays named
slow, and its next note asks again. A suspect that keeps pace again before the swap is no suspect: called off
(call_off). No restart of the budget is spent (as a drain). A place (group rank) swapped
once is never swapped again: a node named slow where another was is slow by its place (a pipeline stage's share of
the work, say), and swapping would loop through the spares; the node swapped out from it, back there (its spare
lost), is slow itself and swapped again.
An operator's drain of a member (operator_rules.drain) is swapped the same way where a spare is ready and the node
holds a snapshot the spare can fetch (drainable): its shards would otherwise be fetched from its peer's copy, which
may lag many steps behind (a review: 33 steps redone at 8 MB/s). The drain is in force at once (it may not rejoin);
swapped out, the node is held out until the spare's note shows the held step (or SWAP_WAIT_S passed), serving its
snapshots meanwhile, and only then goes as drained (fetched). A spare still preparing (its interpreter importing)
counts for a drain: the swap waits for it as well, within SWAP_WAIT_S (a review: a drain as the spare prepared
shrank a job of shards, and it grew again a second later, every rank from step 0). Pure.
"""
from __future__ import annotations

from protocol.messages import NodeState
from rdzv_server.core import exclusions, places, suspects
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.records import NodeRecord, SwapDue
from rdzv_server.core.rounds import serves_itself

SWAP_WAIT_S = 60.0


def drainable(rules: JobRules, node_id: str) -> bool:
    """Whether an operator's drain of `node_id` waits for a swap: a member, a spare ready, no swap under way, and a
    snapshot of its own that the spare can fetch (from its agent, or its peer's copy). Else it goes at once."""
    job = rules.job
    node = job.nodes.get(node_id)
    c = node.copies if node is not None else None
    if c is None or job.swap is not None or job.draining is not None or job.round is None or \
            node_id not in job.round.members or _drain_spare(rules) is None:
        return False
    return max(c.local_step, c.copied_step) >= 0 and (serves_itself(job, node_id) or c.copying or c.copied_step >= 0)


def ask(rules: JobRules, node_id: str, why: str, now: float, named: bool = False, drain: bool = False) -> None:
    """`node_id` holds the job back (`why`), or is drained (`drain`, once drainable): swap it at the next snapshot,
    when a spare is ready (`named`: it was named slow just now: a place swapped before is said once here)."""
    job = rules.job
    if job.swap is not None or job.round is None or node_id not in job.round.members:
        return
    # The place is slow only where a node other than the one swapped out from it is slow there: the node swapped out
    # and back in its place (its spare lost) is slow itself, and is swapped again when a spare is ready.
    # (A drain is the operator's word: not about the place.)
    place = job.round.members.index(node_id)
    if not drain and place in job.swapped_places and job.swapped_from.get(node_id) != place:
        if named:
            rules.record(now, EventKind.NODE_SUSPECT, f"node {node_id} is slow at group rank {place}, where a node "
                         f"was swapped for being slow before: the place itself is slow (a pipeline stage's share "
                         f"of the work?), so it is not swapped again", node_id, job.round.round_id)
        return
    if (spare := suspects.ready_spare(rules) or (_drain_spare(rules) if drain else None)) is None:
        return
    held = [c.local_step for m in job.round.members if m in job.nodes and (c := job.nodes[m].copies) is not None]
    # Copies off (no member notes a step): the ranks are asked to hold all the same; a job with no snapshot at all
    # swaps after SWAP_WAIT_S.
    served = serves_itself(rules.job, node_id)
    c, suspect = job.nodes[node_id].copies, job.nodes[node_id]
    memoryless = c is None or c.local_step < 0 and c.copied_step < 0 and not c.copying and not suspect.copy_port
    if (memoryless and not served) or (held and max(held) < 0):     # (--no-memory-dir notes -1s, no copy port)
        _swap(rules, node_id, why, "no snapshot to wait for", now, drain)
        return
    job.swap = SwapDue(node_id=node_id, why=why, round_id=job.round.round_id, until=now + SWAP_WAIT_S, drain=drain)
    rules.out.deadline(job.swap.until)
    for member in job.round.members:
        rules.node_changed(member)
    then = f"spare {spare} takes its place at the job's next snapshot (the ranks wait after it)" + \
        ("" if job.nodes[spare].ready else f", once it is ready (it prepares; at most {SWAP_WAIT_S:g}s)")
    if drain:
        rules.record(now, EventKind.NODE_DRAINED, f"node {node_id} {why}; {then}, fetching its snapshots from it; "
                     f"then it goes", node_id, job.round.round_id)
        return
    rules.record(now, EventKind.NODE_SUSPECT, f"node {node_id} is a suspect: {why}; {then}", node_id,
                 job.round.round_id)


def held(rules: JobRules, node_id: str, step: int, now: float) -> None:
    """A member's ranks wait after their snapshot of `step` (its note)."""
    swap = _due(rules)
    if swap is None:
        return
    if node_id == swap.node_id:
        swap.suspect_held = max(swap.suspect_held, step)
    swap.held_step = max(swap.held_step, step)
    check(rules, now)


def settle(rules: JobRules, now: float) -> None:
    """A drained node whose swap is due but which is no member of a running round now (a resize made it a spare, or
    the job waits for nodes) goes at once, as a drain with nothing to swap does: left, it stayed in the job, listed
    as drained, and a later round took it in again (a review: resized 3 -> 2 and back, the drained node trained)."""
    job, swap = rules.job, rules.job.swap
    if swap is None or not swap.drain or (node := job.nodes.get(swap.node_id)) is None or \
            job.round is not None and swap.node_id in job.round.members:
        return
    job.swap = None
    rules.remove(node, now, EventKind.NODE_DRAINED, f"node {swap.node_id} {swap.why} (no member of a running round "
                 f"now: it goes at once)")


def check(rules: JobRules, now: float) -> None:
    """Swap once the members hold and the suspect's copy of the held step is on its peer (after a poll or note)."""
    fetched(rules, now)
    settle(rules, now)
    swap = _due(rules)
    if swap is None or swap.held_step < 0:
        return
    node = rules.job.nodes.get(swap.node_id)
    copies = node.copies if node is not None else None
    if serves_itself(rules.job, swap.node_id):
        if max(swap.suspect_held, copies.local_step if copies is not None else -1) < swap.held_step:
            return      # the spare fetches it from the suspect, which has not written its snapshot of it yet
    elif copies is not None and copies.copied_step < swap.held_step:
        return          # its copy of the held step is still on its way to its peer
    if swap.drain and suspects.ready_spare(rules) is None and _drain_spare(rules) is not None:
        return          # the spare still prepares: the ranks wait for it (tick: at most SWAP_WAIT_S)
    _swap(rules, swap.node_id, swap.why, f"at the snapshot of step {swap.held_step}", now, swap.drain, swap.held_step)


def call_off(rules: JobRules, node_id: str) -> str:
    """`node_id` keeps pace again before its swap came: a node no longer slow is no suspect, so it is not swapped
    nor excluded for it, and the ranks asked to hold go on. Returns what its event adds ("": no swap was due)."""
    swap = _due(rules)
    if swap is None or swap.node_id != node_id or swap.drain:      # (a drain is the operator's: it stands)
        return ""
    rules.job.swap = None
    for member in rules.job.round.members if rules.job.round is not None else ():
        rules.node_changed(member)      # their ranks go on
    return ": its swap for a spare is called off"


def lifted(rules: JobRules, node_id: str, now: float) -> None:
    """The operator lifted the drain of `node_id` before it went: its swap is called off (the ranks asked to hold go
    on), or, swapped out already, it is readmitted as any node whose exclusion ended."""
    job = rules.job
    if (swap := job.swap) is not None and swap.drain and swap.node_id == node_id:     # (due, or moot: settle's)
        job.swap = None
        for member in job.round.members if job.round is not None else ():
            rules.node_changed(member)      # their ranks go on
    if job.draining is not None and job.draining.node_id == node_id:
        job.draining = None
        if (node := job.nodes.get(node_id)) is not None and node.state == NodeState.EXCLUDED:
            node.excluded_until = now
            rules.admit(node, now)


def fetched(rules: JobRules, now: float) -> None:
    """A drained node swapped out goes as drained once the spare in its place holds the step it was swapped at (its
    note shows it, whichever source it came from), the spare is no member any more, or SWAP_WAIT_S passed: its agent
    then exits as a drained node's does. Until then it serves its snapshots to the spare, and may not rejoin."""
    job, due = rules.job, rules.job.draining
    if due is None:
        return
    node, spare = job.nodes.get(due.node_id), job.nodes.get(due.spare)
    if node is None or node.state != NodeState.EXCLUDED:        # lost meanwhile (its drain stands), or readmitted
        job.draining = None
        return
    held = spare.copies.local_step if spare is not None and spare.copies is not None else -1
    if spare is not None and job.round is not None and due.spare in job.round.members and \
            held < max(due.held_step, 0) and now < due.until:
        return
    how = f"spare {due.spare} holds step {held}" if held >= max(due.held_step, 0) else \
        f"spare {due.spare} is no member now" if spare is None or job.round is None or \
        due.spare not in job.round.members else f"spare {due.spare}'s fetch did not end within {SWAP_WAIT_S:g}s"
    rules.remove(node, now, EventKind.NODE_DRAINED, f"node {due.node_id} {due.why}: it goes now ({how})")
    job.draining = None     # (after: gone_nodes keeps no exclusion of it)


def tick(rules: JobRules, now: float) -> None:
    fetched(rules, now)
    settle(rules, now)
    swap = _due(rules)
    if swap is not None and now >= swap.until:
        served = serves_itself(rules.job, swap.node_id)
        late = "no snapshot came" if swap.held_step < 0 else f"its own snapshot of step {swap.held_step} did not " \
            f"come" if served else f"its copy of step {swap.held_step} did not reach its peer"
        _swap(rules, swap.node_id, swap.why, f"now: {late} within {SWAP_WAIT_S:g}s (the steps since the "
              f"newest snapshot every rank holds are redone)", now, swap.drain, swap.held_step)


def _drain_spare(rules: JobRules) -> str | None:
    """The spare a drain's swap waits for: a ready one, else one still preparing (it joined: it comes soon). Not one
    whose checks are due (a suspect held out) nor one said to prepare too long: neither comes soon (a review: the
    ranks held the full SWAP_WAIT_S for a spare whose checks failed)."""
    job = rules.job
    return suspects.ready_spare(rules) or next((s for s in job.spares if (n := job.nodes.get(s)) is not None
                                                and not n.checks_due and not n.preparing_said), None)


def _due(rules: JobRules) -> SwapDue | None:
    """The swap under way (None: none, or moot: another round formed, or the suspect left)."""
    job = rules.job
    swap = job.swap
    if swap is not None and swap.drain and job.round is not None and swap.round_id != job.round.round_id and \
            swap.node_id in job.round.members:
        # An operator's drain stands whatever round forms meanwhile (another node lost or drained, a restart): its
        # swap carries over to this round, else the node would run on in it for good, listed as drained. The step
        # held was the last round's; the bound (until) stands.
        swap.round_id, swap.held_step, swap.suspect_held = job.round.round_id, -1, -1
    if swap is not None and (job.round is None or job.round.round_id != swap.round_id
                             or swap.node_id not in job.round.members):
        if swap.drain and swap.node_id in job.nodes:
            return None         # no member now (a spare, excluded, waiting): it goes at once (settle)
        job.swap = swap = None
    return swap


def _swap(rules: JobRules, node_id: str, why: str, when: str, now: float, drain: bool = False,
          held_step: int = -1) -> None:
    job = rules.job
    job.swap = None
    spare = suspects.ready_spare(rules)
    node = job.nodes[node_id]
    if spare is None:
        for member in job.round.members if job.round is not None else ():
            rules.node_changed(member)      # their ranks go on
        if drain:       # drained all the same: at once, as with no spare at all
            rules.remove(node, now, EventKind.NODE_DRAINED, f"node {node_id} {why} (no spare is ready any more: "
                         f"it goes at once)")
            return
        rules.record(now, EventKind.NODE_SUSPECT, f"node {node_id} is a suspect ({why}) but no spare is ready any "
                     f"more: not swapped; asked again when one is", node_id)
        return
    if drain:
        _drained_out(rules, node, SwapDue(node_id=node_id, why=why, round_id=-1, until=now + SWAP_WAIT_S,
                                          held_step=held_step, drain=True, spare=spare), when, now)
        return
    if job.round is not None and node_id in job.round.members:
        job.swapped_places.append(place := job.round.members.index(node_id))
        job.swapped_from[node_id] = place
    suspects.suspected(rules, node, now)
    exclusions.exclude(rules, node, now, f"as a suspect ({why}): spare {spare} takes its place")
    node.slow_out = True        # it can go on: readmitted should the job be short of nodes (the spare lost)
    then = suspects.quarantine(node, now)
    rules.record(now, EventKind.NODE_SUSPECT, f"node {node_id} swapped for spare {spare} {when}{then}", node_id)
    rules.out.suspects.append(suspects.Action.REPLACED.value)
    job.forming_since = now
    rules.form_round(now, f"node {node_id} swapped for spare {spare} ({why})", RoundCause.SWAPPED)


def _drained_out(rules: JobRules, node: NodeRecord, due: SwapDue, when: str, now: float) -> None:
    """The drained node out of the round, the spare in its place, in a round formed now. Held out (excluded, no
    exclusion counted: it goes as drained, never readmitted) while it serves the spare's fetch (fetched)."""
    job = rules.job
    job.draining = due
    node.excluded_until = due.until
    places.move(job, node, NodeState.EXCLUDED)
    if job.round is not None:
        job.round.members = [m for m in job.round.members if m != node.node_id]
    rules.node_changed(node.node_id)
    rules.out.deadline(due.until)
    rules.record(now, EventKind.NODE_DRAINED, f"node {node.node_id} swapped for spare {due.spare} {when}: it goes "
                 f"once {due.spare} holds its snapshots (at most {SWAP_WAIT_S:g}s)", node.node_id)
    job.forming_since = now
    rules.form_round(now, f"node {node.node_id} {due.why}: spare {due.spare} takes its place", RoundCause.NODE_DRAINED)
