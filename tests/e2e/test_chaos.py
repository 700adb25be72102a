"""Chaos soak: an elastic job (--nnodes 2:4, one plain-python worker per agent) under random faults.

Faults, drawn from a seeded RNG (CHAOS_SEED picks the seed; it is printed on failure):
- worker crash: OUT_DIR/crash-<pid> makes a running member's worker exit 1;
- agent SIGKILL;
- agent SIGSTOP until the server has dropped it (its lease ran out), then SIGCONT;
- a new agent (sometimes re-using the node id of one that is gone);
- a clean leave (SIGTERM).
At least two agents stay alive throughout. Between faults the test either lets the job settle
(a bounded poll of the server's status) or moves on at once, so some faults land mid-transition.
Then the faults stop, the job settles, OUT_DIR/stop ends every worker and the job must succeed.

Afterwards, from what workers recorded, what agents announced and what the server reports:
- each round is one fact: ranks 0..W-1 at most once, one world size, restart count and master;
- restart counts never go down and equal the server's count of accepted failures before the round;
- every accepted failure is one of the injected crashes (node churn never uses the budget);
- the server's round_completed world sizes match what the workers saw;
- no worker of an agent that was killed or left is still alive.

The default test runs a handful of faults; `make soak` runs the long variant (SOAK_FAULTS, default 100).
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import defaultdict

import psutil
import pytest

from tests.e2e.harness import SCRIPTS, Proc, announced_rounds, job_events, job_view, wait_until

pytestmark = pytest.mark.e2e
WORKER = os.path.join(SCRIPTS, "chaos_worker.py")
JOB = "chaos"
MIN_ALIVE = 2
MAX_ALIVE = 4
LIMIT = 60.0      # bound on any one wait: a stuck job fails the test instead of stalling it
FLAGS = ("--nnodes", f"{MIN_ALIVE}:{MAX_ALIVE}", "--nproc", "1", "--job-id", JOB, "--max-restarts", "100000",
         "--lease-timeout", "3", "--last-call", "0.5", "--stop-timeout", "2",
         # Exclusion (after failures, and of a node id lost again and again: flap damping) has tests
         # of its own; here, where node ids are re-used on purpose, it would only stall the soak.
         "--exclude-after", "0", "--exclude-lost-after", "0")


def alive(rec: dict) -> bool:
    """Whether the worker that wrote `rec` still runs (its pid, not a later process reusing it)."""
    return running(rec["pid"], rec["t"], slack=5)


def running(pid: int, started: float, slack: float = 0.01) -> bool:
    """Whether process `pid`, created at `started`, still runs (pid reuse does not count)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - started) < slack
    except psutil.NoSuchProcess:
        return False


def children(pid: int) -> list[tuple[int, float]]:
    """(pid, creation time) of every descendant of `pid` now."""
    out = []
    try:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                out.append((child.pid, child.create_time()))
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return out


class Chaos:
    def __init__(self, cluster, out, rng: random.Random, seed: int) -> None:
        self.cluster = cluster
        self.out = out
        self.rng = rng
        self.seed = seed
        self.alive: dict[str, Proc] = {}      # node id -> agent, for agents not killed or gone
        self.every: list[Proc] = []           # every agent ever started
        self.killed: list[Proc] = []          # SIGKILLed
        self.left: list[Proc] = []            # SIGTERMed (a clean leave)
        self.crashed: set[int] = set()        # worker pids told to crash
        self.orphans: list[tuple[int, float, str]] = []   # children of killed/left agents, when signalled
        self.settled_round: int | None = None  # the round the job had settled in, until the next fault
        self.crash_round: int | None = None   # settled round the last fault (a crash) was injected in
        self.crashed_settled: list[int] = []  # rounds where a crash was the only fault: must restart
        self.log: list[str] = []
        self.unused = {"crash", "kill", "leave", "stop", "join"}
        self._next = 0

    # -- facts --

    def say(self, text: str) -> None:
        self.log.append(text)

    def context(self) -> str:
        try:          # the server's own account of the last decisions, for whoever reads a failure
            recent = [f"{e.get('kind')}: {e.get('message')}" for e in job_events(self.cluster, JOB)[-25:]]
        except Exception as exc:  # noqa: BLE001 (a failure message must not fail itself)
            recent = [f"(events unavailable: {exc})"]
        return f"seed {self.seed}; faults: {self.log}; the server's last events: {recent}"

    def records(self) -> list[dict]:
        out = []
        for name in os.listdir(self.out):
            if name.startswith("chaos-") and name.endswith(".json"):
                with open(os.path.join(self.out, name)) as f:
                    out.append(json.load(f))
        return sorted(out, key=lambda r: r["t"])

    def mapped(self, records=None) -> tuple[dict[int, list[dict]], list[dict]]:
        """Worker records by the round their agent announced when it spawned them.

        An agent spawns one round's worker after stopping the last, so its records (in time order)
        and its announcements (in line order) run in step; a worker may die before it records.
        Returns (round id -> records, records no announcement of their agent describes).
        """
        records = self.records() if records is None else records
        by_round: dict[int, list[dict]] = defaultdict(list)
        unmatched = []
        by_agent = defaultdict(list)
        for r in records:
            by_agent[r["ppid"]].append(r)
        procs = {p.pid: p for p in self.every}
        for ppid, recs in by_agent.items():
            proc = procs.get(ppid)
            lines = announced_rounds(proc) if proc is not None else []
            i = 0
            for r in recs:
                fact = (r["group_rank"], r["world"], r["restart"], r["master_port"], r["rank"])
                j = next((k for k in range(i, len(lines))
                          if (lines[k]["group_rank"], lines[k]["world"], lines[k]["restart"],
                              lines[k]["master_port"], lines[k]["first"]) == fact), None)
                if j is None:
                    unmatched.append(r)
                    continue
                by_round[lines[j]["round"]].append(r)
                i = j + 1
        return by_round, unmatched

    def job(self):
        return job_view(self.cluster, JOB, missing_ok=True)

    def settled(self):
        """The job runs one round with every live agent placed and every member's worker up."""
        job = self.job()
        if job is None or job["state"] != "running" or job["waiting"] or job["excluded"] \
                or job["last_call_ends_in_s"] is not None:
            return None
        if {n["node_id"] for n in job["nodes"] + job["spares"]} != set(self.alive):
            return None
        by_round, _ = self.mapped()
        mine = {r["ppid"]: r for r in by_round.get(job["round_id"], [])}
        for n in job["nodes"]:
            rec = mine.get(self.alive[n["node_id"]].pid)
            if rec is None or not alive(rec):
                return None
        return job

    def wait_settled(self) -> dict:
        job = wait_until(self.settled, LIMIT, lambda: f"the job to settle: {self.job()}; {self.context()}")
        self.settled_round = job["round_id"]
        return job

    # -- faults --

    def start_agent(self, node: str | None = None) -> str:
        if node is None:
            node = f"n{self._next}"
            self._next += 1
        proc = self.cluster.agent("--endpoint", self.cluster.endpoint(), *FLAGS, "--node-id", node, WORKER,
                                  name=node, env={"OUT_DIR": str(self.out), "NODE": node})
        self.alive[node] = proc
        self.every.append(proc)
        return node

    def running_workers(self) -> list[tuple[str, dict]]:
        """(node, record) of member workers of the current round that are alive now."""
        job = self.job()
        if job is None or job["round_id"] is None:
            return []
        by_round, _ = self.mapped()
        out = []
        for rec in by_round.get(job["round_id"], []):
            node = next((n for n, p in self.alive.items() if p.pid == rec["ppid"]), None)
            if node is not None and alive(rec) and rec["pid"] not in self.crashed:
                out.append((node, rec))
        return out

    def fault(self) -> None:
        # Targets are picked from one look at the state: it may change under us, which is the point.
        workers, listed = self.running_workers(), self.listed()
        choices = []
        if workers:
            choices += ["crash"] * 3
        if len(self.alive) > MIN_ALIVE:
            choices += ["kill"] * 2 + ["leave"] + (["stop"] if listed else [])
        if len(self.alive) < MAX_ALIVE:
            choices += ["join"] * 2
        # Every kind of fault comes up early (where it can), the rest are drawn by weight.
        fresh = sorted(set(choices) & self.unused)
        kind = self.rng.choice(fresh or choices)
        self.unused.discard(kind)
        settled, self.settled_round = self.settled_round, None
        self.crash_round = None
        if kind == "crash":
            node, rec = self.rng.choice(workers)
            self.crash_round = settled
            self._crash(node, rec)
        elif kind == "stop":
            self._stop(self.rng.choice(listed))
        else:
            getattr(self, "_" + kind)()

    def _crash(self, node: str, rec: dict) -> None:
        self.crashed.add(rec["pid"])
        self.say(f"crash worker {rec['pid']} (rank {rec['rank']}) of {node}")
        (self.out / f"crash-{rec['pid']}").write_text("crash")

    def _kill(self) -> None:
        node = self.rng.choice(sorted(self.alive))
        proc = self.alive.pop(node)
        self.say(f"SIGKILL {node} (pid {proc.pid})")
        self.orphans += [(pid, t, node) for pid, t in children(proc.pid)]   # recorded or not
        os.kill(proc.pid, signal.SIGKILL)
        self.killed.append(proc)

    def _leave(self) -> None:
        node = self.rng.choice(sorted(self.alive))
        proc = self.alive.pop(node)
        self.say(f"SIGTERM {node} (pid {proc.pid})")
        self.orphans += [(pid, t, node) for pid, t in children(proc.pid)]
        proc.popen.send_signal(signal.SIGTERM)
        code = proc.wait(LIMIT)
        # Killed by the signal itself only when it came before the agent was up (nothing to clean).
        assert code == 128 + signal.SIGTERM or (code == -signal.SIGTERM and not announced_rounds(proc)), \
            f"{node} exited {code} on SIGTERM; {self.context()}\n{proc.output}"
        self.left.append(proc)

    def listed(self) -> list[str]:
        """Live agents the server knows (a stopped agent it never saw would never be dropped)."""
        job = self.job()
        if job is None:
            return []
        return sorted({n["node_id"] for n in job["nodes"] + job["spares"] + job["waiting"]} & set(self.alive))

    def _stop(self, node: str) -> None:
        proc = self.alive[node]
        self.say(f"SIGSTOP {node} (pid {proc.pid}) until its lease runs out")
        since = max((e["seq"] for e in job_events(self.cluster, JOB)), default=0)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            def dropped():
                return any(e["seq"] > since and e["kind"] == "node_lost" and e["node_id"] == node
                           for e in job_events(self.cluster, JOB))
            wait_until(dropped, LIMIT, lambda: f"the server to drop stopped {node}; {self.context()}")
        finally:
            os.kill(proc.pid, signal.SIGCONT)

    def _join(self) -> None:
        gone = sorted({p.name for p in self.killed + self.left} - set(self.alive))
        reuse = gone and self.rng.random() < 0.4
        node = self.start_agent(self.rng.choice(gone) if reuse else None)
        self.say(f"new agent {node}" + (" (re-using a gone node's id)" if reuse else ""))

    def pause(self) -> None:
        """Let the job settle, or go on at once / after a moment so the next fault lands mid-change.
        (A deliberate chaos delay, not a stand-in for synchronisation: nothing waits on it.)"""
        r = self.rng.random()
        if r < 0.5:
            if self.crash_round is not None:
                # A crash in a settled round, and no other fault: that round must end (in a restart).
                rid = self.crash_round
                wait_until(lambda: (self.job() or {}).get("round_id") != rid, LIMIT,
                           lambda: f"round {rid} to end after a crash in it: {self.job()}; {self.context()}")
                self.crashed_settled.append(rid)
            self.wait_settled()
        elif r < 0.8:
            time.sleep(self.rng.uniform(0.0, 1.5))


def run_chaos(cluster, tmp_path, faults: int, seed: int) -> None:
    try:
        _run_chaos(cluster, tmp_path, faults, seed)
    except BaseException:
        # Keep the whole story for a post-mortem: the server's events and every agent's output.
        debug = tmp_path / "post-mortem"
        debug.mkdir(exist_ok=True)
        for i, proc in enumerate(cluster.procs):
            (debug / f"{i:02d}-{proc.name}-{proc.pid}.log").write_text(proc.output)
        try:
            (debug / "events.json").write_text(json.dumps(job_events(cluster, JOB), indent=1))
        except Exception:
            pass
        print(f"chaos post-mortem in {debug}")
        raise


def _run_chaos(cluster, tmp_path, faults: int, seed: int) -> None:
    cluster.start_server()
    chaos = Chaos(cluster, tmp_path, random.Random(seed), seed)
    for _ in range(3):
        chaos.start_agent()
    chaos.wait_settled()
    for _ in range(faults):
        chaos.fault()
        chaos.pause()
    chaos.say("faults stop")
    final = chaos.wait_settled()
    # Before the stop file (which would end orphans too): no worker of a killed or departed agent
    # lives on, whether it recorded or not.
    gone_agents = {p.pid: p for p in chaos.killed + chaos.left}
    orphans = [r for r in chaos.records() if r["ppid"] in gone_agents]
    wait_until(lambda: not any(alive(r) for r in orphans), 10,
               lambda: f"workers of killed/departed agents to be gone: "
                       f"{[r for r in orphans if alive(r)]}; {chaos.context()}")
    wait_until(lambda: not any(running(pid, t) for pid, t, _ in chaos.orphans), 10,
               lambda: f"children of killed/departed agents to be gone: "
                       f"{[o for o in chaos.orphans if running(o[0], o[1])]}; {chaos.context()}")
    (tmp_path / "stop").write_text("stop")
    for node, proc in chaos.alive.items():
        code = proc.wait(LIMIT)
        assert code == 0, f"{node} exited {code}; {chaos.context()}\n{proc.output}"
    ctx = chaos.context()
    job = job_view(cluster, JOB)
    assert job["state"] == "succeeded", (job, ctx)

    records = chaos.records()
    by_round, unmatched = chaos.mapped(records)
    assert not unmatched, f"workers ran a world no announcement of their agent describes: {unmatched}; {ctx}"

    # Each round is one fact for its workers.
    for rid, recs in by_round.items():
        w = recs[0]["world"]
        assert len({(r["world"], r["restart"], r["master_addr"], r["master_port"], r["group_world"])
                    for r in recs}) == 1, (rid, recs, ctx)
        ranks = [r["rank"] for r in recs]
        assert len(ranks) == len(set(ranks)) and set(ranks) <= set(range(w)), (rid, recs, ctx)
        groups = [r["group_rank"] for r in recs]
        assert len(groups) == len(set(groups)), (rid, recs, ctx)
    last = by_round[final["round_id"]]
    assert sorted(r["rank"] for r in last) == list(range(final["world_size"])), (final, last, ctx)

    # Every agent that announced round R announced the same world for it.
    announced: dict[int, list[dict]] = defaultdict(list)
    for proc in chaos.every:
        for line in announced_rounds(proc):
            announced[line["round"]].append(line)
    for rid, lines in announced.items():
        assert len({(ln["world"], ln["master_addr"], ln["master_port"], ln["restart"], ln["group_world"])
                    for ln in lines}) == 1, (rid, lines, ctx)
        assert len({ln["group_rank"] for ln in lines}) == len(lines), (rid, lines, ctx)
    restarts = [announced[rid][0]["restart"] for rid in sorted(announced)]
    assert restarts == sorted(restarts), f"restart count went down across rounds: {restarts}; {ctx}"

    # The server's history agrees with the workers and agents.
    events = job_events(cluster, JOB)
    complete = events[0]["seq"] == 1                   # the server keeps the last 1000 events
    completed = {e["round_id"]: e for e in events if e["kind"] == "round_completed"}
    failed = [e for e in events if e["kind"] == "worker_failed"]
    for rid, recs in by_round.items():
        if rid in completed:
            data = completed[rid]["data"]
            assert (data["world_size"], data["nodes"]) == (recs[0]["world"], recs[0]["group_world"]), \
                (rid, data, recs, ctx)
    for rid, lines in announced.items():
        if rid in completed:
            assert completed[rid]["data"]["world_size"] == lines[0]["world"], (rid, lines, ctx)
    accepted_before = {rid: len({(e["node_id"], e["round_id"]) for e in failed if e["seq"] < ev["seq"]})
                       for rid, ev in completed.items()}
    visible = sorted(rid for rid in announced if rid in completed)
    for rid in visible:
        if complete:
            assert announced[rid][0]["restart"] == accepted_before[rid], (rid, announced[rid], ctx)
        else:   # the oldest events were dropped: compare increments only
            first = visible[0]
            assert announced[rid][0]["restart"] - announced[first][0]["restart"] == \
                accepted_before[rid] - accepted_before[first], (rid, ctx)
    if complete:
        assert job["restart_count"] == len({(e["node_id"], e["round_id"]) for e in failed}), (job, ctx)

    # Stable group ranks: from one round to the next, members that stayed keep their group ranks, but for one
    # moving forward into a place whose holder is gone (a newcomer takes such a place first, else the last member
    # does; so rank 0 stays rank 0 while it lives).
    ranks_in = {rid: {ln["node"]: ln["group_rank"] for ln in lines} for rid, lines in announced.items()}
    pairs = 0
    for rid in sorted(ranks_in):
        nxt = rid + 1
        if nxt not in ranks_in or rid not in completed or nxt not in completed:
            continue
        removed = {e["node_id"] for e in events if e["kind"] in ("node_lost", "node_left")
                   and completed[rid]["seq"] < e["seq"] < completed[nxt]["seq"]}
        before, after = ranks_in[rid], ranks_in[nxt]
        stayed = [n for n in sorted(before, key=before.get) if n in after and n not in removed]
        pairs += len(stayed) > 1
        held = {before[n] for n in stayed}     # (a gone node may have died before it said its rank)
        assert all(after[n] == before[n] or (after[n] < before[n] and after[n] not in held) for n in stayed), \
            (rid, before, after, removed, ctx)
        assert all(after[n] <= before[n] for n in stayed), (rid, before, after, removed, ctx)
    # Only injected crashes consume the budget: node loss, joins and leaves never do.
    pids_by_round_rank = {(rid, r["rank"]): r["pid"] for rid, recs in by_round.items() for r in recs}
    for e in failed:
        pid = pids_by_round_rank.get((e["round_id"], e["data"]["rank"]))
        assert pid in chaos.crashed and e["data"]["exitcode"] == 1, \
            f"a failure that was not an injected crash used the restart budget: {e}; {ctx}"
    assert job["restart_count"] <= len(chaos.crashed), (job, ctx)
    # A crash in a settled round, with no other fault until the next round, is never lost.
    if complete:
        failed_rounds = {e["round_id"] for e in failed}
        for rid in chaos.crashed_settled:
            assert rid in failed_rounds, f"the crash injected in settled round {rid} was not counted; {ctx}"

    # And now that the job is over, no worker at all is left.
    wait_until(lambda: not any(alive(r) for r in records), 10,
               lambda: f"every worker to be gone: {[r for r in records if alive(r)]}; {ctx}")
    for proc in chaos.killed:
        assert proc.wait(10) == -signal.SIGKILL
    kinds = defaultdict(int)
    for entry in chaos.log:
        kinds[entry.split()[0]] += 1
    print(f"chaos seed {seed}: {dict(kinds)}; {len(announced)} rounds, {len(records)} workers, "
          f"{job['restart_count']} restarts of {len(chaos.crashed)} crashes injected "
          f"({len(chaos.crashed_settled)} in a settled round, checked); rank order checked over {pairs} "
          f"round changes")


def test_chaos_job_survives_random_faults_and_succeeds(cluster, tmp_path):
    seed = int(os.environ.get("CHAOS_SEED", "1729"))
    run_chaos(cluster, tmp_path, faults=6, seed=seed)


@pytest.mark.soak
def test_chaos_soak(cluster, tmp_path):
    seed = int(os.environ.get("CHAOS_SEED", str(time.time_ns() % 2**32)))
    run_chaos(cluster, tmp_path, faults=int(os.environ.get("SOAK_FAULTS", "100")), seed=seed)
