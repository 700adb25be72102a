"""A node's workers failing before their process group, when that would make it a suspect or exclude it, is first
held (the round runs on) until another member of its round reports, or WAIT_S passes. In the first rounds the
first node to report had no other node's report beside it: a script failing everywhere at start (an ImportError,
sys.exit(17)) made it a suspect twice, or excluded it, before the others' reports took that back
(blame.readmit_alike), and the job shrank meanwhile. Held, the others' workers, not yet stopped by a next round,
fail on their own and say so within the bound; a node failing alone (a broken host: the others' workers wait in
their group) is judged as before, at most WAIT_S later, and no restart is spent meanwhile (the round stays)."""
from __future__ import annotations

from protocol.messages import WorkerFailure
from rdzv_server.core import blame, suspects
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.records import AloneHeld, NodeRecord

# The others' workers start with the first's: their own failure at start comes within a second or so (3 agents,
# warm workers: under 0.5 s); a broken host's exclusion comes this much later.
WAIT_S = 2.0


def hold(rules: JobRules, node: NodeRecord, round_id: int, failures: list[WorkerFailure], now: float) -> bool:
    """Whether `node`'s first report of the running round's failure is held: it failed before its process group,
    its count or exit code would judge it, no other node's workers failed so within the window yet, and others
    are in its round. The job's last restart is never held (nothing is judged after it)."""
    job, cfg = rules.job, rules.job.config
    first, asked = failures[0], suspects.asking(cfg, failures)
    recent = [t for t in node.failure_times if t > now - cfg.exclude_window_s]
    at_stake = (asked is not None and asked.before_group) or (
        first.before_group and bool(cfg.exclude_after) and len(recent) + 1 >= cfg.exclude_after)
    others = [n for n in rules.members() if n != node.node_id and n in job.nodes]
    if not at_stake or not others or job.restart_count + 1 > cfg.max_restarts or job.alone_held is not None \
            or blame.alike(job, node, asked or first, now):
        return False
    job.alone_held = AloneHeld(node_id=node.node_id, round_id=round_id, failures=list(failures), until=now + WAIT_S)
    rules.out.deadline(job.alone_held.until)
    rules.changed()
    return True


def due(rules: JobRules, node: NodeRecord | None, round_id: int, now: float) -> AloneHeld | None:
    """The held failure to judge now (taken off the job), if any: its bound passed (`node` None: a tick), or another
    member reported on its round. One whose round no longer runs (a loss re-formed it) is dropped."""
    job, held = rules.job, rules.job.alone_held
    if held is None:
        return None
    running = job.round is not None and job.round.round_id == held.round_id and not job.state.finished
    if running and (held.until > now if node is None else round_id != held.round_id or node.node_id == held.node_id):
        return None
    job.alone_held = None
    rules.changed()
    return held if running and held.node_id in job.nodes else None
