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
lost), is slow itself and swapped again. Pure.
"""
from __future__ import annotations

from rdzv_server.core import exclusions, suspects
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.records import SwapDue
from rdzv_server.core.rounds import serves_itself

SWAP_WAIT_S = 60.0


def ask(rules: JobRules, node_id: str, why: str, now: float, named: bool = False) -> None:
    """`node_id` holds the job back (`why`): swap it at the next snapshot, when a spare is ready (`named`: it was
    named slow just now: a place swapped before is said once here)."""
    job = rules.job
    if job.swap is not None or job.round is None or node_id not in job.round.members:
        return
    # The place is slow only where a node other than the one swapped out from it is slow there: the node swapped out
    # and back in its place (its spare lost) is slow itself, and is swapped again when a spare is ready.
    if (place := job.round.members.index(node_id)) in job.swapped_places and job.swapped_from.get(node_id) != place:
        if named:
            rules.record(now, EventKind.NODE_SUSPECT, f"node {node_id} is slow at group rank {place}, where a node "
                         f"was swapped for being slow before: the place itself is slow (a pipeline stage's share "
                         f"of the work?), so it is not swapped again", node_id, job.round.round_id)
        return
    if (spare := suspects.ready_spare(rules)) is None:
        return
    held = [c.local_step for m in job.round.members if m in job.nodes and (c := job.nodes[m].copies) is not None]
    # Copies off (no member notes a step): the ranks are asked to hold all the same; a job with no snapshot at all
    # swaps after SWAP_WAIT_S.
    served = serves_itself(rules.job, node_id)
    c, suspect = job.nodes[node_id].copies, job.nodes[node_id]
    memoryless = c is None or c.local_step < 0 and c.copied_step < 0 and not c.copying and not suspect.copy_port
    if (memoryless and not served) or (held and max(held) < 0):     # (--no-memory-dir notes -1s, no copy port)
        _swap(rules, node_id, why, "no snapshot to wait for", now)
        return
    job.swap = SwapDue(node_id=node_id, why=why, round_id=job.round.round_id, until=now + SWAP_WAIT_S)
    rules.out.deadline(job.swap.until)
    for member in job.round.members:
        rules.node_changed(member)
    rules.record(now, EventKind.NODE_SUSPECT, f"node {node_id} is a suspect: {why}; spare {spare} takes its place "
                 f"at the job's next snapshot (the ranks wait after it)", node_id, job.round.round_id)


def held(rules: JobRules, node_id: str, step: int, now: float) -> None:
    """A member's ranks wait after their snapshot of `step` (its note)."""
    swap = _due(rules)
    if swap is None:
        return
    if node_id == swap.node_id:
        swap.suspect_held = max(swap.suspect_held, step)
    swap.held_step = max(swap.held_step, step)
    check(rules, now)


def check(rules: JobRules, now: float) -> None:
    """Swap once the members hold and the suspect's copy of the held step is on its peer (after a poll or note)."""
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
    _swap(rules, swap.node_id, swap.why, f"at the snapshot of step {swap.held_step}", now)


def call_off(rules: JobRules, node_id: str) -> str:
    """`node_id` keeps pace again before its swap came: a node no longer slow is no suspect, so it is not swapped
    nor excluded for it, and the ranks asked to hold go on. Returns what its event adds ("": no swap was due)."""
    swap = _due(rules)
    if swap is None or swap.node_id != node_id:
        return ""
    rules.job.swap = None
    for member in rules.job.round.members if rules.job.round is not None else ():
        rules.node_changed(member)      # their ranks go on
    return ": its swap for a spare is called off"


def tick(rules: JobRules, now: float) -> None:
    swap = _due(rules)
    if swap is not None and now >= swap.until:
        served = serves_itself(rules.job, swap.node_id)
        late = "no snapshot came" if swap.held_step < 0 else f"its own snapshot of step {swap.held_step} did not " \
            f"come" if served else f"its copy of step {swap.held_step} did not reach its peer"
        _swap(rules, swap.node_id, swap.why, f"now: {late} within {SWAP_WAIT_S:g}s (the steps since the "
              f"newest snapshot every rank holds are redone)", now)


def _due(rules: JobRules) -> SwapDue | None:
    """The swap under way (None: none, or moot: another round formed, or the suspect left)."""
    job = rules.job
    swap = job.swap
    if swap is not None and (job.round is None or job.round.round_id != swap.round_id
                             or swap.node_id not in job.round.members):
        job.swap = swap = None
    return swap


def _swap(rules: JobRules, node_id: str, why: str, when: str, now: float) -> None:
    job = rules.job
    job.swap = None
    spare = suspects.ready_spare(rules)
    if spare is None:
        for member in job.round.members if job.round is not None else ():
            rules.node_changed(member)      # their ranks go on
        rules.record(now, EventKind.NODE_SUSPECT, f"node {node_id} is a suspect ({why}) but no spare is ready any "
                     f"more: not swapped; asked again when one is", node_id)
        return
    node = job.nodes[node_id]
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
