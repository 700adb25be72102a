"""Fencing, only on evidence: when a node cut off from the server asks its round's witnesses, and what it
concludes. No I/O. From about when this node's lease must have lapsed on the server (a silence counts only after
it), the round's witnesses are asked which round they hold and whether they hear the server (witness.py) while the
server is checked over a fresh connection (path_check.py). Workers stop and the round's failure is reported only
when a witness that hears the server holds a newer round or none (ours was replaced or ended), or no witness
answers, twice, and no endpoint either (we are cut off). Otherwise (a witness hears the server in our round, none
hears it, the server answers again, a replica does not serve yet) the round goes on, asked again every ASK_AGAIN_S.
The policy (policy.py) says when a silence began and whether workers run; the times, the state of the asking and
the wording are here, so the fencing bound (lease + ~1 s) is in one place."""
from __future__ import annotations

import signal
from dataclasses import dataclass

from node_agent.client.replies import Path
from node_agent.core.facts import SERVER_CHECK_DECIDES, Verdict
from protocol.bounds import MAX_MESSAGE
from protocol.messages import FailureReason, WorkerFailure

FENCE_MARGIN_S = 0.5
ASK_AGAIN_S = 0.5     # a witness's answer costs one local connection: the fencing bound is the lease + ~1 s
# A witness may not have noticed yet that the server is away for it too (its keepalive runs on its own
# clock): a "cut off" verdict is asked once more this much later.
CONFIRM_S = 1.0
# A silence takes a whole ASK_TIMEOUT_S and is confirmed by a second ask: the first starts this much
# before the lease lapses, so the second ends about a second after it. Before the lapse only a newer round counts.
EARLY_ASK_S = 1.0


def lapse_at(renewed_at: float | None, unreachable_since: float, lease_timeout_s: float) -> float:
    """When this node's lease must have lapsed on the server (the earliest a silence may fence); it runs
    from when the last answered request went out."""
    lapsed = (renewed_at if renewed_at is not None else unreachable_since) + lease_timeout_s
    return max(lapsed, unreachable_since) + FENCE_MARGIN_S


def first_ask_at(renewed_at: float | None, unreachable_since: float, lease_timeout_s: float) -> float:
    """When to ask the witnesses first: shortly before the lapse, or at once when the failed try comes later
    (a held poll's dead connection is noticed by keepalive up to ~4.5 s after the cut: waiting longer would put
    the fence past lease + 2 s). An early ask costs nothing: its verdict is moot once the server answers."""
    return max(lapse_at(renewed_at, unreachable_since, lease_timeout_s) - EARLY_ASK_S, unreachable_since)


def fenced(verdict: Verdict, silent_s: float, lease_timeout_s: float, rank: int) -> tuple[str, WorkerFailure]:
    """What the node says, and reports for its round, when it stops its workers as the one cut off."""
    # One verdict covers both: a newer round (ours replaced) or none (ours ended, the job below its minimum)
    seen = ("a witness that hears the server runs a newer round, or none"
            if verdict == Verdict.ROUND_REPLACED else
            "the round's other nodes still hear the server" if verdict == Verdict.SERVER_HEARD else
            "neither the round's other nodes nor any endpoint answer")
    why = (f"fenced: no answer from the server for {silent_s:.1f}s (lease {lease_timeout_s:g}s), and "
           f"{seen}: this node is cut off, and the server has replaced or ended its round")
    failure = WorkerFailure(local_rank=0, rank=rank, exitcode=-signal.SIGTERM, signal="SIGTERM",
                            reason=FailureReason.FENCED.value, message=why[:MAX_MESSAGE])
    return why, failure


@dataclass(slots=True)
class Fence:
    """The asking of the witnesses while the server is silent: when next, and what they said before."""
    lease_timeout_s: float
    renewed_at: float | None = None       # when the last answered request went out: the lease ran from then
    ask_again_at: float | None = None         # the witnesses answered: ask again then
    probing: bool = False
    cut_off: bool = False                 # the witnesses once said this node is the one cut off

    def heard(self, sent_at: float) -> None:
        """The server answered a request sent at `sent_at`: the lease runs from then, nothing to ask."""
        self.renewed_at, self.ask_again_at, self.cut_off = sent_at, None, False

    def ask_at(self, unreachable_since: float) -> float | None:
        """When to ask the witnesses (None: an ask is under way)."""
        if self.probing:
            return None
        if self.ask_again_at is not None:
            return self.ask_again_at
        return first_ask_at(self.renewed_at, unreachable_since, self.lease_timeout_s)

    def asked(self) -> None:
        self.probing = True

    def answered(self, verdict: Verdict, server: Path | None, unreachable_since: float | None, now: float) -> bool:
        """The witnesses' verdict (and the server check's): whether this node is the one cut off, its round
        replaced, so its workers must stop now. None `unreachable_since`: the server answered meanwhile."""
        self.probing = False
        if unreachable_since is None:
            return False
        evidence = verdict == Verdict.ROUND_REPLACED or (verdict == Verdict.SERVER_HEARD and self.cut_off)
        if not evidence and (server != Path.NO_SERVER or verdict not in SERVER_CHECK_DECIDES):
            # The server answers (the link sends again), a replica takes over, it runs our round, or is away.
            self.ask_again_at, self.cut_off = now + ASK_AGAIN_S, False
            return False
        lapse = lapse_at(self.renewed_at, unreachable_since, self.lease_timeout_s)
        if verdict != Verdict.ROUND_REPLACED and (evidence or self.cut_off) and now < lapse:
            # Before the lease lapsed the server has replaced nothing yet: ask again once it has.
            self.ask_again_at, self.cut_off = lapse, True
            return False
        if not evidence and not self.cut_off:
            # A witness may not know yet, a silent one only be slow (a loaded host): ask once more.
            self.ask_again_at, self.cut_off = now + (CONFIRM_S if verdict == Verdict.SERVER_HEARD else 0.0), True
            return False
        self.ask_again_at = None
        return True

    def silent_for(self, unreachable_since: float, now: float) -> float:
        return now - (self.renewed_at if self.renewed_at is not None else unreachable_since)
