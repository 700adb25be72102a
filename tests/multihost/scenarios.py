"""Fault scenarios on a namespace cluster, shared by the tests (which assert what must happen) and
benchmarks/bench_faults.py (which reports how long it took).

Every scenario starts from a job whose workers all train, injects one fault at a wall-clock time t0
and watches, every 50 ms, for what follows. Times are measured from t0:
- detection: the server's `node_lost` event for the host (the server's own timestamp);
- survivors training again: the last survivor's first full all-reduce step at the smaller world
  (the worker's own timestamp);
- fencing: the moment the cut-off host's last worker of the old round is gone (observed).
The scenarios assert nothing about time; they return what they saw.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from tests.e2e.harness import wait_until
from tests.multihost.job import MultiHostJob, parse_time

POLL_S = 0.05
SETUP_LIMIT_S = 120.0     # a job of 3 hosts trains within seconds; this only stops a hang
# Two lease renewals of one node are told apart when further apart than this (they come about every
# 2 s, a long-poll's hold; one reading of a renewal's time is late by up to one status request).
RENEWAL_JITTER_S = 0.5


class MissingBehaviour(AssertionError):
    """A behaviour that issue 12 asks for is absent. Tests that expect it are marked
    xfail(strict, raises=MissingBehaviour) until it lands; any other failure is a real one."""


@dataclass
class Observed:
    fault: str
    t0: float = 0.0
    detection_s: float | None = None
    survivors_training_s: float | None = None
    fencing_s: float | None = None
    restarted: dict[str, int] = field(default_factory=dict)     # host -> workers started after t0
    rounds: int = 0                                              # rounds completed after t0
    losses: int = 0                                              # node_lost events after t0
    healed_at: float | None = None                               # one-way loss: when it ended
    rejoined_s: float | None = None                              # ... the victim's next join after it
    full_size_s: float | None = None                             # ... every host's first step at full size
    notes: str = ""

    def summary(self) -> str:
        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"
        healed = (f", after the heal: joined {s(self.rejoined_s)} s, full size {s(self.full_size_s)} s"
                  if self.healed_at is not None else "")
        return (f"{self.fault}: detection {s(self.detection_s)} s, survivors training again "
                f"{s(self.survivors_training_s)} s, fencing {s(self.fencing_s)} s, rounds {self.rounds}, "
                f"losses {self.losses}, workers restarted {self.restarted}{healed} {self.notes}").rstrip()


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_workers(job: MultiHostJob, host: str) -> list[psutil.Process]:
    out = []
    for pid in job.worker_pids(host):
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if alive(proc):
            out.append(proc)
    return out


def start_training(job: MultiHostJob, hosts: list[str], *, nnodes: str = "2:3") -> dict[str, int]:
    """Server and one agent per host; returns each host's worker pid once all train at full size."""
    job.start_server()
    for host in hosts:
        job.start_agent(host, nnodes=nnodes)
    first = wait_until(lambda: job.training(hosts, len(hosts)), SETUP_LIMIT_S,
                       lambda: f"all of {hosts} training at world {len(hosts)}\n{job.diagnosis()}")
    return {host: rec["pid"] for host, rec in first.items()}


def _count_after(job: MultiHostJob, seen: Observed, hosts: list[str]) -> None:
    """Fill in detection, rounds, losses and restarts from the server's history and the worker logs."""
    lost = job.events_of("node_lost", since=seen.t0)
    seen.losses = len(lost)
    if lost:
        seen.detection_s = parse_time(lost[0]["time"]) - seen.t0
    seen.rounds = len(job.events_of("round_completed", since=seen.t0))
    for host in hosts:
        first_seen: dict[int, float] = {}
        for r in job.records(host):
            first_seen.setdefault(r["pid"], r["t"])
        seen.restarted[host] = sum(1 for t in first_seen.values() if t >= seen.t0)


def lose_host(job: MultiHostJob, fault: str, victim: str, survivors: list[str], *,
              fence_wait_s: float, limit_s: float = SETUP_LIMIT_S) -> Observed:
    """Cut `victim` off (fault "cut": its link; "partition": from the server only) and watch until
    the survivors train at their smaller size and the victim's workers are gone, or until
    `fence_wait_s` after the cut for the latter."""
    victims = live_workers(job, victim)
    assert victims, f"{victim} has no live worker before the fault\n{job.diagnosis()}"
    seen = Observed(fault, t0=time.time())
    if fault == "cut":
        job.net.cut(victim)
    elif fault == "partition":
        job.net.partition(victim, job.server_host)
    else:
        raise ValueError(fault)
    deadline = seen.t0 + limit_s
    while time.time() < deadline:
        now = time.time()
        if seen.fencing_s is None and not any(alive(p) for p in victims):
            seen.fencing_s = now - seen.t0
        if seen.survivors_training_s is None:
            first = job.training(survivors, len(survivors), since=seen.t0)
            if first:
                seen.survivors_training_s = max(r["t"] for r in first.values()) - seen.t0
        fence_settled = seen.fencing_s is not None or now >= seen.t0 + fence_wait_s
        if seen.survivors_training_s is not None and fence_settled:
            break
        time.sleep(POLL_S)
    _count_after(job, seen, [*survivors, victim])
    return seen


def next_renewal(job: MultiHostJob, host: str, limit_s: float = SETUP_LIMIT_S) -> float:
    """The wall time of `host`'s next lease renewal (its long-poll answered and sent again), as the
    server's view shows it, seen within about one status request."""
    last: float | None = None

    def renewed() -> float | None:
        nonlocal last
        asked = time.time()
        view = job.view()
        node = next((n for n in (view or {}).get("nodes", []) if n["node_id"] == host), None)
        if node is None:
            return None
        at = asked - node["lease_age_s"]
        if last is not None and at > last + RENEWAL_JITTER_S:
            return at
        last = at if last is None else max(last, at)
        return None
    return float(wait_until(renewed, limit_s, lambda: f"a lease renewal of {host}\n{job.diagnosis()}", interval=0.02))


def server_outage(job: MultiHostJob, hosts: list[str], outage_s: float, *, measure_recovery: bool = False,
                  phase_s: float | None = None, limit_s: float = SETUP_LIMIT_S) -> Observed:
    """The server's own link goes down for `outage_s`, then comes back (with `phase_s`: that long after
    a renewal of the first host's lease, a phase of its poll cycle). Returns once the server has
    had two renewals from every member of the round since the link came back (the outage is over
    for the server: at least one of the two was a request, even if the server re-armed the leases
    itself), or once the job has moved to another round. With `measure_recovery`, in the latter
    case, only once new workers train at full size (`survivors_training_s`: from the cut to the last
    host's first step). `notes` says which outcome it was."""
    before = job.view()
    assert before is not None and before["round_id"] is not None, job.diagnosis()
    old = [p for h in hosts for p in live_workers(job, h)]
    old_pids = frozenset(p.pid for p in old)
    if phase_s is not None:
        at = next_renewal(job, hosts[0]) + phase_s
        time.sleep(max(0.0, at - time.time()))      # to the phase: the fault's schedule
    seen = Observed("server_link_down", t0=time.time())
    job.net.cut(job.server_host)
    time.sleep(outage_s)            # the fault's length, not a wait for anything
    job.net.reconnect(job.server_host)
    back = time.time()
    renewals: dict[str, list[float]] = {h: [] for h in hosts}

    def over() -> str | None:
        asked = time.time()
        view = job.view()
        if view is None or view["round_id"] != before["round_id"] or \
                sorted(n["node_id"] for n in view["nodes"]) != sorted(hosts):
            return "moved to another round"
        for node in view["nodes"]:
            # asked - age: the renewal's time, late by at most this request's own delay
            renewed = asked - node["lease_age_s"]
            times = renewals[node["node_id"]]
            if renewed > back and (not times or renewed - times[-1] > RENEWAL_JITTER_S):
                times.append(renewed)
        return "renewed" if all(len(t) >= 2 for t in renewals.values()) else None
    outcome = wait_until(over, limit_s, lambda: f"the server to hear from every member again "
                                                f"(renewals since: {renewals})\n{job.diagnosis()}")
    _count_after(job, seen, hosts)
    seen.notes = f"(link down {back - seen.t0:.1f} s; afterwards: {outcome})"
    disturbed = outcome != "renewed" or seen.losses or any(seen.restarted.values())
    if measure_recovery and (disturbed or not all(alive(p) for p in old)):
        first = wait_until(lambda: job.training(hosts, len(hosts), since=seen.t0, old_pids=old_pids), limit_s,
                           lambda: f"the job training again after the outage\n{job.diagnosis()}")
        seen.survivors_training_s = max(r["t"] for r in first.values()) - seen.t0
        _count_after(job, seen, hosts)
    return seen


def flap(job: MultiHostJob, flapper: str, healthy: list[str], *, duration_s: float, down_s: float,
         up_s: float) -> Observed:
    """Toggle `flapper`'s link (down `down_s`, up `up_s`) for `duration_s`; leave it up."""
    seen = Observed("flapping_host", t0=time.time())
    end = seen.t0 + duration_s
    cycles = 0
    try:
        while time.time() < end:
            job.net.cut(flapper)
            cycles += 1
            time.sleep(max(0.0, min(down_s, end - time.time())))      # the fault's schedule
            job.net.reconnect(flapper)
            time.sleep(max(0.0, min(up_s, end - time.time())))
    finally:
        job.net.reconnect(flapper)
    _count_after(job, seen, [*healthy, flapper])
    seen.notes = f"({cycles} cycles of {down_s:g} s down / {up_s:g} s up over {duration_s:g} s)"
    return seen


def one_way_loss(job: MultiHostJob, victim: str, hosts: list[str], *, direction: str, down_s: float,
                 limit_s: float = SETUP_LIMIT_S) -> Observed:
    """Everything `victim` sends to the server ("out") or the server sends to it ("in") is lost for
    `down_s`, then no more. Returns once every host trains at full size after the heal; `rejoined_s`
    and `full_size_s` are measured from the heal."""
    src, dst = (victim, job.server_host) if direction == "out" else (job.server_host, victim)
    seen = Observed(f"one_way_{direction}", t0=time.time())
    job.net.one_way(src, dst)
    try:
        time.sleep(down_s)          # the fault's length, not a wait for anything
    finally:
        job.net.heal_one_way(src, dst)
    healed = seen.healed_at = time.time()
    first = wait_until(lambda: job.training(hosts, len(hosts), since=healed), limit_s,
                       lambda: f"all of {hosts} training at full size after the heal\n{job.diagnosis()}")
    seen.full_size_s = max(r["t"] for r in first.values()) - healed
    # its join after it was lost: "in" loses only the server's replies, so the server may take the join (and log it)
    # a moment before the heal, its reply held back by TCP until then (0 s after the heal, then)
    lost = [parse_time(e["time"]) for e in job.events_of("node_lost", since=seen.t0) if e["node_id"] == victim]
    joins = [e for e in job.events_of("node_joined", since=lost[0] if lost else healed) if e["node_id"] == victim]
    if joins:
        seen.rejoined_s = max(0.0, parse_time(joins[0]["time"]) - healed)
    _count_after(job, seen, hosts)
    return seen
