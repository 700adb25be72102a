"""The rules of one job: rounds, leases, restarts, spares and exclusions, applied to its JobRecord.

A round is one agreed fact: the ordered member list with each one's group rank, rank offset, the world size, master
address and restart count. Other nodes are *waiting*, *spare* (the job is at max: promoted when a member goes) or
*excluded* (failed too often). `form_round` takes live members in their old order + waiting + spares, capped at
max_nodes, so ranks stay stable (rank 0 stays rank 0 while it lives). It runs: for the first round at max nodes,
or at min when the last call ends; on a worker failure (restart count + 1, FAILED past the budget); on a member
lost or leaving (no budget used; below min, back to waiting until join_timeout); for a newcomer below max after
the last call, or at once when it fills max.
Every method takes `now` and does no I/O; a request that cannot be obeyed raises `RendezvousError` before anything
changes; every decision records an `Event` with its reason, and its effects go to the outbox. Objects handed in
(requests, failures, configs) are frozen or copied before they are kept.
"""
from __future__ import annotations

from protocol.errors import ErrorCode
from protocol.messages import JobState, NodeState
from rdzv_server.core import awaiting, floors, gone_nodes, goodput, leases, places, standing, stops, store_port
from rdzv_server.core.addresses import master_correction
from rdzv_server.core.choice import Choice, candidates, choose, count_nodes, growth_cause
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import REMOVAL_CAUSE, EventKind, RoundCause
from rdzv_server.core.outbox import Outbox
from rdzv_server.core.payloads import LeasesExtended, Payload, RoundFormed, RoundWaiting, as_data
from rdzv_server.core.records import Event, JobRecord, NodeRecord
from rdzv_server.core.rounds import (
    PREPARE_LIMIT_S,
    build_round,
    copies_lost,
    copies_off,
    master_of,
    places_kept,
)

MAP_NODES = 64      # a round's event lists its nodes by group rank up to this many (and as many places taken)
_FINISHED_KIND = {JobState.SUCCEEDED: EventKind.JOB_SUCCEEDED, JobState.FAILED: EventKind.JOB_FAILED,
                  JobState.CLOSED: EventKind.JOB_CLOSED}


class JobRules:
    """One job's rules over its record; cheap to make for each call."""

    __slots__ = ("job", "out")     # a misspelt `self.x = ...` is a type error, not a new attribute

    def __init__(self, job: JobRecord, out: Outbox) -> None:
        self.job = job
        self.out = out

    # ---- connections (the requests' rules: requests.py) ---------------------------------------

    def poll_ended(self, node_id: str, now: float, heard_at: float | None = None) -> None:
        """The server answered a held long-poll of the node; `heard_at`: the last sign of life on its connection."""
        node = self.job.nodes.get(node_id)
        if node is not None:
            leases.release(self.job, node, now, self.out, heard_at)

    def connection_dropped(self, node_id: str, now: float, heard: bool = False) -> None:
        """A node's long-poll connection closed under it: give it a short grace to come back."""
        node = self.job.nodes.get(node_id)
        if node is not None and not self.job.state.finished:
            leases.drop(self.job, node, now, self.out, heard)

    # ---- time ----------------------------------------------------------------------------

    def restored(self, now: float, away_s: float, how: str) -> None:
        """After the server came back on a saved state: nobody is blamed for the time it was away (leases.restored)."""
        grace = leases.restored(self.job, now, away_s, self.out)
        floors.restored(self.job, now, away_s)
        self.record(now, EventKind.SERVER_RESTARTED, f"server restarted {how}; away about {away_s:.1f}s; "
                    f"{len(self.job.nodes)} node leases renewed for {grace:g}s",
                    data=LeasesExtended(away_s=round(away_s, 3)))

    def tick(self, now: float, hearing: leases.Hearing) -> int:
        """Apply every passed deadline, leases judged by what the server heard; returns how many were extended."""
        job = self.job
        lag_s, quiet_s, doubt_s = hearing.lag_s, hearing.quiet_s, hearing.doubt_s
        leases.grace_after_silence(job, hearing.silence, now, self.out, hearing.wave)
        gone, deferred = leases.lapsed(job, now, lag_s, doubt_s)
        # judged again once the server has caught up or heard someone
        leases.hold_back(job, deferred, now, lag_s, doubt_s, self.out)
        extended = 0
        if gone and quiet_s is not None:        # the quiet rule, for all but closings heard before it
            held = [n for n in gone if not leases.closing_heard(n, now - quiet_s)]
            gone = [n for n in gone if leases.closing_heard(n, now - quiet_s)]
            if held:
                leases.extend(held, now, job.config.lease_timeout_s, self.out)
                extended = len(held)
                if hearing.say_quiet:
                    self.record(now, EventKind.LEASES_EXTENDED, f"server heard from no agent for {quiet_s:.1f}s (its "
                                f"own link or process was cut off or stalled, not {extended} node(s)): leases extended")
        if gone:
            self.lose_all(gone, now)
        for nid in list(job.excluded):
            node = job.nodes[nid]
            if node.excluded_until <= now and nid not in job.drained:   # drained: it goes (swaps.fetched)
                self.record(now, EventKind.NODE_READMITTED, f"node {nid} finished its exclusion cooldown", nid)
                self.admit(node, now)
            elif (node.held_off or node.slow_out) and job.state == JobState.WAITING and not awaiting.wait_runs(job):
                # flap damping, or a slow node's swap, only stops a job short of nodes (not one awaiting members)
                what = "exclusion as a flapping host" if node.held_off else "exclusion as a slow node swapped out"
                node.excluded_until, node.held_off, node.slow_out = now, False, False
                self.record(now, EventKind.NODE_READMITTED, f"node {nid}'s {what} ends: the job waits for nodes", nid)
                self.admit(node, now)
        self._preparing_too_long(now)
        if job.last_call_deadline is not None and job.last_call_deadline <= now:
            job.last_call_deadline = None
            if job.awaited and (taker := awaiting.taker_preparing(job, now)):
                self.out.deadline(awaiting.wait_for_taker(job, taker, now))
            elif job.awaited:           # the wait's end, or every one still awaited is back (another given up)
                self.form_round(now, f"{awaiting.names(job)} back" if awaiting.all_back(job) else
                                f"{awaiting.not_back(job)}: going on with " +
                                count_nodes(candidates(job)[:job.config.max_nodes]),
                                RoundCause.NODE_LOST)
            elif not leases.hold_last_call(job, now, self.out):     # (a newcomer's connection closed: its grace)
                self.form_round(now, "last call ended with " + count_nodes(candidates(job)), growth_cause(job))
        if job.state == JobState.WAITING and job.last_call_deadline is None and \
                job.join_deadline is not None and job.join_deadline <= now:
            unhealthy = sum(1 for e in job.events if e.kind == EventKind.NODE_UNHEALTHY)
            slow = f" ({job.waiting_preparing} more joined, still preparing)" if job.waiting_preparing else ""
            self.finish(now, JobState.FAILED, f"only {self.ready_waiting()} of min {job.config.min_nodes} nodes "
                        f"joined and ready within join_timeout {job.config.join_timeout_s:g}s{slow}" + (
                            f" (no healthy set of {job.config.min_nodes} nodes: {unhealthy} left unhealthy)"
                            if unhealthy else "") + standing.last_failed(job))
        return extended

    # ---- the mechanics of rounds (operator rules use these too) -----------------------------

    def admit(self, node: NodeRecord, now: float) -> None:
        """Place a newly joined (or readmitted) node: waiting for the next round, or spare once the members, the
        ready waiting nodes and the members awaited while their wait runs fill max_nodes. A job short of nodes runs
        no wait: a newcomer waits for the round, to start it (a review: benched, it never got the place)."""
        job, cfg = self.job, self.job.config
        held = awaiting.reserved(job) if awaiting.wait_runs(job) else 0
        if node.node_id in job.awaited or len(self.members()) + self.ready_waiting() + held < cfg.max_nodes:
            places.move(job, node, NodeState.WAITING)
            if awaiting.came_back(job, node, now):     # more time while its workers prepare
                self.out.deadline(job.last_call_deadline or now)
            if job.forming_since is None:
                job.forming_since = now
                self.record(now, EventKind.ROUND_OPENED, f"round {job.last_round_id + 1} opened by {node.node_id}: "
                            f"collecting nodes ({cfg.min_nodes}:{cfg.max_nodes})", node.node_id)
            self.grow(now)
        else:
            places.move(job, node, NodeState.SPARE)
            self.record(now, EventKind.NODE_BENCHED, f"node {node.node_id} is spare #{len(job.spares)} "
                        f"(job at max_nodes {cfg.max_nodes})", node.node_id)

    def grow(self, now: float) -> None:
        """Form the next round as the ready nodes allow: at once when they fill max_nodes, else once the last call
        after min_nodes ends. A node still preparing counts for neither: no round waits on it."""
        job, cfg = self.job, self.job.config
        ready = self.ready_waiting()
        if not ready:
            return                  # nobody to add: the running round (if any) stays as it is
        total = len(self.members()) + ready
        if job.awaited and awaiting.all_back(job):
            self.form_round(now, f"{awaiting.names(job)} back", RoundCause.NODE_LOST)
        elif total >= cfg.max_nodes and not job.awaited:    # (else newcomers wait as spares: awaiting.py)
            self.form_round(now, f"max_nodes {cfg.max_nodes} reached", growth_cause(job))
        elif total >= cfg.min_nodes and job.last_call_deadline is None:
            if cfg.last_call_s <= 0 and not job.awaited:
                self.form_round(now, f"{total} nodes (last call 0s)", growth_cause(job))
            else:           # (members restarting still away: their wait resumes, within its bound)
                job.last_call_deadline = awaiting.resume(job, now, count_nodes(candidates(job))) if job.awaited \
                    else now + cfg.last_call_s
                self.out.deadline(job.last_call_deadline)

    def ready_waiting(self) -> int:
        """The waiting nodes that can start at once (counted as they come and go: no scan of a long list)."""
        return len(self.job.waiting) - self.job.waiting_preparing

    def readiness(self, node: NodeRecord, ready: bool, now: float) -> None:
        """What the node's agent says of its workers: a waiting node that becomes ready may complete a round."""
        if node.ready == ready:
            return
        places.set_ready(self.job, node, ready)
        node.preparing_since = 0.0 if ready else now
        self.node_changed(node.node_id)
        if node.state == NodeState.WAITING and awaiting.came_back(self.job, node, now):
            self.out.deadline(max(self.job.last_call_deadline or now, now))
        if not ready:
            node.preparing_said = False
            self.out.deadline(now + PREPARE_LIMIT_S)
            return
        if node.preparing_said:
            node.preparing_said = False
            self.record(now, EventKind.NODE_READY, f"node {node.node_id} is ready: its workers can start at once",
                        node.node_id)
        if awaiting.taker_ready(self.job, node, now):
            self.out.deadline(now)
        elif node.state == NodeState.WAITING and not self.job.state.finished:
            self.grow(now)

    def _preparing_too_long(self, now: float) -> None:
        for node in self.job.nodes.values():
            if not node.ready and not node.preparing_said and node.preparing_since + PREPARE_LIMIT_S <= now:
                node.preparing_said = True
                self.node_changed(node.node_id)
                self.record(now, EventKind.NODE_PREPARING, f"node {node.node_id} has been preparing for "
                            f"{now - node.preparing_since:.0f}s (its warm interpreter still imports, or its agent "
                            f"never said it was ready): left out of every round until it is", node.node_id)

    def form_round(self, now: float, why: str, cause: RoundCause, failed_at: float | None = None,
                   restarting: list[NodeRecord] | None = None, stopping_s: float = 0.0) -> None:
        """Form the next round from live members + waiting + spares, or go back to waiting. `failed_at`: when the
        failure or loss that caused it happened (worker exit, or the lost node's last contact). `restarting`: lost
        members whose agents may be restarting: awaited rather than gone on without (awaiting.py), from when their
        workers are stopped (`stopping_s` from now)."""
        job, cfg = self.job, self.job.config
        choice = choose(job)
        chosen, rest, preparing, took = choice.chosen, choice.rest, choice.preparing, choice.took
        job.last_call_deadline = None
        was_awaited = bool(job.awaited)       # (members restarting were awaited: their ranks hold their own state)
        job.awaited, job.stops_counted, job.stops = [], [], {}
        job.successes = []
        self.wake()
        held = awaiting.worth_awaiting(job, restarting or [], now)
        if len(chosen) < cfg.min_nodes or held:
            self._wait_for_nodes(now, why, cause, choice, held, stopping_s, restarting or [])
            return
        opened = job.forming_since if job.forming_since is not None else now
        promoted = len(set(chosen) & set(job.spares))
        job.last_round_id += 1
        last = (master_of(job.round), job.round.master_port) if job.round else \
            (job.places[0], job.places_port) if job.places else None          # the last round's store
        fetching = {n for n in chosen if job.nodes[n].fetch_of}
        before = list(job.round.ranked or job.round.members) if job.round else list(job.places)  # as formed: swaps
        layout = (job.round.ranked, job.round.local_sizes) if job.round else (job.places, job.places_sizes)
        job.round = build_round(job, chosen, job.last_round_id, opened, now, why, took)
        for nid in fetching | set(job.round.copies):      # their fetch_of set or cleared: saved
            self.node_changed(nid)
        store_port.take(job.round, last, job.nodes[chosen[0]])
        corrected = master_correction(job.round, job.nodes[chosen[0]])
        if corrected:
            self.record(now, EventKind.MASTER_ADDR_CORRECTED, corrected, chosen[0], job.last_round_id)
        job.state = JobState.RUNNING
        room = cfg.max_nodes - len(chosen)          # a node preparing waits for a place that is free ...
        places.seat(job, chosen, preparing[:room], rest + preparing[room:])   # ... else for a member to go, as a spare
        job.places, job.places_sizes, job.place_copies, job.left_steps = [], [], {}, {}
        job.forming_since = now if job.waiting else None
        job.join_deadline = None
        job.reason = why
        goodput.round_formed(job.progress, job.round.round_id, cause.value)
        data = RoundFormed(nodes=len(chosen), world_size=job.round.world_size, reason=why, cause=cause.value,
                           formation_s=round(now - opened, 6), promoted=promoted,
                           since_failure_s=round(max(0.0, now - failed_at), 6) if failed_at else None,
                           took=dict(list(took.items())[:MAP_NODES]), ranks=chosen if len(chosen) <= MAP_NODES else [])
        taken = "".join(f"; {new} takes {old}'s place (group rank {chosen.index(new)})" if new != old else
                         f"; {new} is back at its place (group rank {chosen.index(new)}) with a new agent"
                         for new, old in list(took.items())[:3]) + copies_lost(job.round, took) + \
            awaiting.resized(job, before, chosen, was_awaited) + awaiting.ranks_moved(job, *layout, was_awaited)
        if (off := copies_off(job.round, cfg.replicas, job.launcher)) != job.copies_off:     # said once
            job.copies_off = off
            taken += f"; peer copies {off}" if off else ""
        floors.refresh(job, now)      # (after copies_off: a round in one domain keeps no more for copies)
        self.record(now, EventKind.ROUND_COMPLETED, f"round {job.round.round_id}: {len(chosen)} "
                    f"node{'s' * (len(chosen) != 1)}, world size {job.round.world_size} ({why}){taken}",
                    round_id=job.round.round_id, data=data)

    def _wait_for_nodes(self, now: float, why: str, cause: RoundCause, choice: Choice, held: list[str],
                        stopping_s: float = 0.0, lost: list[NodeRecord] | None = None) -> None:
        """No round: below min_nodes, or while `held` (members restarting) are awaited until the last call's end.
        The survivors keep their places for the round that comes."""
        job, cfg = self.job, self.job.config
        # a newcomer that would have taken an awaited node's place stays spare meanwhile: it gets it if that node
        # is not back in time
        standby = [new for new, gone in choice.took.items() if gone in held and new not in self.members()]
        if held:       # below min too: when enough are back, the others' wait resumes (grow)
            job.awaited, job.awaited_since = held, now + stopping_s
            stops.counted(job, held, lost or [], now, stopping_s)
        if held and len(choice.chosen) >= cfg.min_nodes:
            job.last_call_deadline = job.awaited_since + awaiting.window_s(cfg)
            self.out.deadline(job.last_call_deadline)
            waits = f"{awaiting.waiting(job, now)} before going on with {count_nodes(choice.chosen)}"
            if reasons := awaiting.held_back({new: choice.took[new] for new in standby}, lost or []):
                waits += f"; {reasons}"
        else:
            waits = f"{count_nodes(choice.chosen)} < min {cfg.min_nodes}: waiting for nodes"
        if job.round is not None:
            goodput.round_ended(job.progress, cause.value)
        if job.round is not None or job.state != JobState.WAITING:
            self.record(now, EventKind.ROUND_ABANDONED, f"{why}; {waits}", data=RoundWaiting(cause=cause.value))
        if job.round is not None:        # the survivors keep their places for the round that comes
            job.places, job.places_port = list(job.round.ranked or job.round.members), job.round.master_port
            job.places_at = job.round.completed_at
            job.places_sizes = list(job.round.local_sizes) if job.round.ranked else []
            job.place_copies = places_kept(job.round)
        job.round = None
        job.state = JobState.WAITING
        waiting = [n for n in choice.chosen if n not in standby]
        places.seat(job, (), waiting + choice.preparing, standby + choice.rest)
        if any(job.nodes[n].held_off for n in job.excluded):
            self.out.deadline(now)        # the next tick lets a flapping host's hold-off end
        if job.join_deadline is None:
            job.join_deadline = now + cfg.join_timeout_s
            self.out.deadline(job.join_deadline)
        job.reason = f"{why}; {waits}" if job.last_call_deadline is not None else f"{why}; waiting for nodes"

    def lose_all(self, nodes: list[NodeRecord], now: float) -> None:
        """Nodes lost together leave together: one round forms without any of them."""
        members = set(self.members())
        lost = []
        for node in nodes:
            leases.note_loss(self.job, node.node_id, now, restarted=node.dropped and node.drop_heard)
            message = f"node {node.node_id} lost: {leases.why_lapsed(self.job, node, now)}"
            restarting = awaiting.restarting(self.job, node)
            self.remove(node, now, EventKind.NODE_LOST, message, form=False, restarting=restarting)
            if node.node_id in members:
                lost.append((node, message, restarting))
        if lost:
            self.job.forming_since = now
            names = ", ".join(n.node_id for n, *_ in lost[:10]) + (" ..." if len(lost) > 10 else "")
            why = lost[0][1] if len(lost) == 1 else f"{len(lost)} nodes lost: {names}"
            self.form_round(now, why, RoundCause.NODE_LOST, failed_at=min(n.last_seen for n, *_ in lost),
                            restarting=[n for n, _, restarting in lost if restarting])

    def remove(self, node: NodeRecord, now: float, kind: EventKind, message: str,
               failed_at: float | None = None, form: bool = True, data: Payload | None = None,
               restarting: bool = False, stopping_s: float = 0.0) -> None:
        """Take a node out of the job (lost, left or drained); a member's going re-forms the round
        (unless `form` is False: the caller forms it once for several). `restarting`: its agent may be restarting
        (its host closed its connection, a new instance of it joins, or it was stopped: its workers stop within
        `stopping_s`) and it held state of its own: its place is kept for it (awaiting.py)."""
        job = self.job
        was_member = node.node_id in self.members()
        gone_nodes.note_gone(job, node, now, was_member)     # what its next agent takes up
        del job.nodes[node.node_id]
        places.leave(job, node)
        self.node_changed(node.node_id)
        if node.node_id in job.successes:
            job.successes.remove(node.node_id)
        self.wake()
        self.record(now, kind, message, node.node_id, data=data)
        if was_member:
            if form:
                job.forming_since = now
                self.form_round(now, message, REMOVAL_CAUSE[kind], failed_at,
                                restarting=[node] if restarting else None, stopping_s=stopping_s)
            return
        if job.round is None and job.awaited:       # the job waits for members restarting: this one too?
            if not awaiting.lost_again(job, node, now, restarting, stopping_s):
                job.last_call_deadline = now        # nobody left to wait for: the next tick forms the round
            else:                   # what the job still waits for, and how long, as it says
                job.reason = f"{message}; {awaiting.waiting(job, now)}"
            self.out.deadline(job.last_call_deadline or now)
        if job.last_call_deadline is not None:
            # Below min, or with no newcomer left while a round runs, the window has nothing to form.
            if len(self.members()) + self.ready_waiting() < job.config.min_nodes:
                if job.awaited:       # nobody to go on with: the job waits for nodes, as it says (still awaiting
                    job.reason = f"{message}; waiting for nodes"      # its members restarting: grow)
                job.last_call_deadline = None
                if job.join_deadline is not None:      # hidden while the window was open: due again
                    self.out.deadline(job.join_deadline)
            elif job.round is not None and not self.ready_waiting():      # nobody ready left to add
                job.last_call_deadline = None
                job.forming_since = now if job.waiting else None

    def finish(self, now: float, state: JobState, why: str) -> None:
        job = self.job
        job.state, job.reason, job.finished_at = state, why, now
        job.last_call_deadline = job.join_deadline = None
        self.out.finished.append(job.job_id)
        self.wake()
        self.record(now, _FINISHED_KIND[state], f"job {state.value}: {why}")

    def members(self) -> list[str]:
        return list(self.job.round.members) if self.job.round is not None else []

    def node(self, node_id: str) -> NodeRecord:
        node = self.job.nodes.get(node_id)
        if node is None:
            raise RendezvousError(ErrorCode.UNKNOWN_NODE,
                                  f"node {node_id!r} is not part of job {self.job.job_id!r}: join again")
        return node

    # ---- effects -------------------------------------------------------------------------

    def record(self, now: float, kind: EventKind, message: str, node_id: str = "", round_id: int = -1,
               data: Payload | None = None) -> None:
        event = Event(t=now, seq=0, kind=kind, message=message, node_id=node_id, round_id=round_id,
                      data=as_data(data))
        self.job.record(event)
        self.out.events.append((self.job, event))
        self.changed()

    def wake(self) -> None:
        """Some node's view of the job may have changed: answer its held long-poll."""
        self.job.epoch += 1
        self.out.woken.add(self.job.job_id)
        self.changed()

    def changed(self) -> None:
        """The job's saved state changed: the store must write it before a reply depends on it."""
        self.out.changed[self.job.job_id] = self.job

    def node_changed(self, node_id: str) -> None:
        """A node's saved record changed, or it was removed (snapshots.py: rows that scale with the change)."""
        self.out.nodes.setdefault(self.job.job_id, set()).add(node_id)
        self.changed()
