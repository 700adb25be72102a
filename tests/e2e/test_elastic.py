"""End-to-end elasticity: nodes lost, nodes joining, spares, exclusions, hung workers, and one agreed
round per rendezvous. Real server and agents on 127.0.0.1; gloo all-reduce workers in a loop
(scripts/elastic_loop.py) that log every step, so a test sees exactly which world each worker ran in.

Waits are on events where there is one (a worker's log line, a file) and otherwise bounded polls of
the server's JSON status; no test asserts how long anything took.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import defaultdict

import pytest

from tests.e2e.harness import (
    SCRIPTS,
    Gate,
    announced_rounds,
    job_events,
    job_view,
    pid_gone,
    read_jsonl,
    reply_unread,
    wait_until,
)

pytestmark = pytest.mark.e2e
LOOP = os.path.join(SCRIPTS, "elastic_loop.py")
CHAOS = os.path.join(SCRIPTS, "chaos_worker.py")      # plain python: records its round, idles
# Short timeouts keep node loss and round changes quick on a loaded 2-core machine.
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")
LIMIT = 90.0     # upper bound for any one wait here: a hang fails the test instead of stalling


def start_agent(cluster, out, node, *, job, nnodes, nproc=1, max_restarts=3, extra=(), env=None, script=LOOP):
    return cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", nnodes, "--nproc", str(nproc),
                         "--job-id", job, "--max-restarts", str(max_restarts), "--node-id", node, *FAST, *extra,
                         script, name=node, env={"OUT_DIR": str(out), "NODE": node, **(env or {})})


def worlds(out) -> dict[tuple, list[dict]]:
    """Worker lines grouped by the world they ran in: (master addr, master port, restart, world size)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for rec in read_jsonl(out, "steps-"):
        groups[(rec["master_addr"], rec["master_port"], rec["restart"], rec["world"])].append(rec)
    return groups


def wait_world(out, *, world, restart=None, nodes=None, exclude=(), timeout=LIMIT, what=""):
    """Wait until every rank 0..world-1 of one world has done at least one all-reduce step.

    `restart`: the restart count it must have; `nodes`: the node names whose workers must make it
    up; `exclude`: keys of earlier worlds to pass over. Returns (key, records of that world).
    """
    def ready():
        for key, recs in worlds(out).items():
            if key in exclude or key[3] != world or (restart is not None and key[2] != restart):
                continue
            stepped = {r["rank"] for r in recs if r["kind"] == "step"}
            if stepped != set(range(world)):
                continue
            if nodes is not None and {r["node"] for r in recs} != set(nodes):
                continue
            return key, recs
        return None

    def state():
        seen = {k: sorted({(r["node"], r["rank"]) for r in v}) for k, v in worlds(out).items()}
        return f"a world of size {world} {what} with every rank stepping; worker worlds so far: {seen}"
    return wait_until(ready, timeout, state)


def stop_job(out) -> None:
    (out / "stop").write_text("stop")


def assert_clean_world(recs: list[dict], world: int) -> None:
    """One world, seen the same way by every worker of it, with every rank taking part."""
    starts = [r for r in recs if r["kind"] == "start"]
    assert sorted(r["rank"] for r in starts) == list(range(world)), starts
    for r in starts:
        assert r["pg_world"] == world
        # every rank's (world size, master port, restart count, group world size), all-gathered
        assert {tuple(v) for v in r["views"]} == {(world, r["master_port"], r["restart"], r["group_world"])}, r
    assert {r["sum"] for r in recs if r["kind"] == "step"} == {float(world)}


def kinds(events, kind, node=None) -> list[dict]:
    return [e for e in events if e["kind"] == kind and (node is None or e["node_id"] == node)]


# ---------------------------------------------------------------------------------------- node loss


def test_sigkilled_agent_survivors_run_at_smaller_world_without_using_a_restart(cluster, tmp_path):
    cluster.start_server()
    agents = {n: start_agent(cluster, tmp_path, n, job="loss", nnodes="2:3") for n in ("a", "b", "c")}
    key3, recs3 = wait_world(tmp_path, world=3)
    assert key3[2] == 0
    assert_clean_world(recs3, 3)
    ranks = {n["node_id"]: n["group_rank"] for n in job_view(cluster, "loss")["nodes"]}
    assert sorted(ranks.values()) == [0, 1, 2], ranks
    victim = next(n for n, g in ranks.items() if g == 1)
    survivors = sorted(n for n in ranks if n != victim)
    victim_workers = {r["pid"] for r in recs3 if r["node"] == victim}

    os.kill(agents[victim].pid, signal.SIGKILL)
    key2, recs2 = wait_world(tmp_path, world=2, nodes=survivors, what="of the two survivors")

    assert key2[2] == 0, "losing a node must not consume the restart budget"
    assert_clean_world(recs2, 2)
    # stable group ranks: the survivors keep their relative order
    by_node = {r["node"]: r["group_rank"] for r in recs2}
    assert [n for n, _ in sorted(by_node.items(), key=lambda kv: kv[1])] == \
        sorted(survivors, key=lambda n: ranks[n])
    for pid in victim_workers:
        assert pid_gone(pid, timeout=10), f"worker {pid} of the SIGKILLed agent is still alive"
    job = job_view(cluster, "loss")
    assert job["restart_count"] == 0 and job["state"] == "running", job
    assert sorted(n["node_id"] for n in job["nodes"]) == survivors and job["group_world_size"] == 2, job
    events = job_events(cluster, "loss")
    assert kinds(events, "node_lost", victim), events
    assert not kinds(events, "worker_failed"), "the survivors' broken collectives were counted as failures"

    stop_job(tmp_path)
    for n in survivors:
        assert agents[n].wait(LIMIT) == 0, agents[n].output
    job = job_view(cluster, "loss")
    assert job["state"] == "succeeded" and job["restart_count"] == 0, job


# ---------------------------------------------------------------------------------------- scale up


def test_new_agent_joining_below_max_grows_the_world(cluster, tmp_path):
    cluster.start_server()
    agents = {n: start_agent(cluster, tmp_path, n, job="grow", nnodes="2:3") for n in ("a", "b")}
    key2, recs2 = wait_world(tmp_path, world=2)
    assert_clean_world(recs2, 2)
    first_ranks = {r["node"]: r["group_rank"] for r in recs2}

    agents["c"] = start_agent(cluster, tmp_path, "c", job="grow", nnodes="2:3")
    key3, recs3 = wait_world(tmp_path, world=3, nodes=("a", "b", "c"), what="including the newcomer")

    assert key3[2] == 0, "a node joining must not consume the restart budget"
    assert_clean_world(recs3, 3)
    ranks = {r["node"]: r["group_rank"] for r in recs3}
    assert ranks["c"] == 2 and {n: ranks[n] for n in first_ranks} == first_ranks, ranks
    job = job_view(cluster, "grow")
    assert job["group_world_size"] == 3 and job["world_size"] == 3 and job["restart_count"] == 0, job
    completed = kinds(job_events(cluster, "grow"), "round_completed")
    assert [e["data"]["nodes"] for e in completed] == [2, 3], completed

    stop_job(tmp_path)
    for a in agents.values():
        assert a.wait(LIMIT) == 0, a.output
    assert job_view(cluster, "grow")["state"] == "succeeded"


def test_a_node_still_preparing_joins_no_round_until_it_is_ready(cluster, tmp_path):
    """c's warm interpreter cannot finish its imports (a preloaded module waits on a FIFO): c waits outside the
    round as "preparing", a and b train on undisturbed in their round; once its imports end, the round grows."""
    cluster.start_server()
    agents = {n: start_agent(cluster, tmp_path, n, job="prep", nnodes="2:3") for n in ("a", "b")}
    key2, _ = wait_world(tmp_path, world=2)
    gate = Gate(str(tmp_path))
    agents["c"] = start_agent(cluster, tmp_path, "c", job="prep", nnodes="2:3", extra=gate.flags(LOOP), env=gate.env)
    agents["c"].wait_for_line("preparing: the warm interpreter imports")

    def c_preparing() -> bool:
        waiting = job_view(cluster, "prep").get("waiting", [])
        return any(n["node_id"] == "c" and n.get("preparing_for_s") is not None for n in waiting)
    wait_until(c_preparing, LIMIT, lambda: f"c preparing: {job_view(cluster, 'prep')}")
    steps = len(worlds(tmp_path)[key2])
    wait_until(lambda: len(worlds(tmp_path)[key2]) >= steps + 10, LIMIT, "a and b to step on meanwhile")
    assert [e["data"]["nodes"] for e in kinds(job_events(cluster, "prep"), "round_completed")] == [2]
    wait_until(gate.opened, LIMIT, "c's warm interpreter at its gate")     # its imports end: the round grows
    key3, recs3 = wait_world(tmp_path, world=3, nodes=("a", "b", "c"), what="with c once it was ready")
    assert key3[2] == 0 and "ready after" in agents["c"].output, agents["c"].output
    stop_job(tmp_path)
    for a in agents.values():
        assert a.wait(LIMIT) == 0, a.output


def test_workers_slow_to_stop_do_not_cost_their_node_its_lease(cluster, tmp_path):
    """A worker may use its SIGTERM grace (--stop-timeout) to save a checkpoint. Here it takes 4 s,
    longer than the 3 s lease: the agent must keep its lease while it waits, so a newcomer causes
    one round change (2 -> 3 nodes), not a cascade of nodes dropped as lost."""
    cluster.start_server()
    slow = {"TERM_DELAY": "4"}
    extra = ("--stop-timeout", "8")
    agents = {n: start_agent(cluster, tmp_path, n, job="slow", nnodes="2:3", script=CHAOS, extra=extra, env=slow)
              for n in ("a", "b")}

    def world_of(size):
        recs = [json.loads(p.read_text()) for p in tmp_path.glob("chaos-*.json")]
        return {r["node"] for r in recs if r["world"] == size}
    wait_until(lambda: world_of(2) == {"a", "b"}, LIMIT, lambda: f"a world of 2: {job_view(cluster, 'slow')}")
    agents["c"] = start_agent(cluster, tmp_path, "c", job="slow", nnodes="2:3", script=CHAOS, extra=extra, env=slow)
    # a and b spawn their world-3 workers only once their old ones have stopped (4 s, past the lease)
    wait_until(lambda: world_of(3) == {"a", "b", "c"}, LIMIT,
               lambda: f"a world of 3: {job_view(cluster, 'slow')}")
    events = job_events(cluster, "slow")
    assert not kinds(events, "node_lost"), \
        [e["message"] for e in events if e["kind"] in ("node_lost", "round_completed", "round_waiting")]
    assert [e["data"]["nodes"] for e in kinds(events, "round_completed")] == [2, 3], events

    stop_job(tmp_path)
    for a in agents.values():
        assert a.wait(LIMIT) == 0, a.output
    job = job_view(cluster, "slow")
    assert job["state"] == "succeeded" and job["world_size"] == 3 and job["restart_count"] == 0, job


# ---------------------------------------------------------------------------------------- spares


def test_spare_is_promoted_when_a_member_dies(cluster, tmp_path):
    # The master's agent is killed after the server answered its held poll and before it polled again (CI saw it):
    # no held poll's connection closes, and its peer's broken collective is reported at once. (Killed while its
    # poll is held: test_sigkilled_agent_survivors_run_at_smaller_world_without_using_a_restart.)
    cluster.start_server()
    agents = {n: start_agent(cluster, tmp_path, n, job="spare", nnodes="2:2") for n in ("a", "b")}
    key1, recs1 = wait_world(tmp_path, world=2)
    assert_clean_world(recs1, 2)

    agents["c"] = start_agent(cluster, tmp_path, "c", job="spare", nnodes="2:2")
    agents["c"].wait_for_line(r"waiting as spare #1", LIMIT)     # the agent's own announcement
    job = job_view(cluster, "spare")
    assert [(s["node_id"], s["spare_position"], s["state"]) for s in job["spares"]] == [("c", 0, "spare")], job
    assert sorted(n["node_id"] for n in job["nodes"]) == ["a", "b"] and job["world_size"] == 2, job
    assert not [r for r in read_jsonl(tmp_path, "steps-") if r["node"] == "c"], "a spare ran workers"

    master = next(n["node_id"] for n in job["nodes"] if n["group_rank"] == 0)
    other = "b" if master == "a" else "a"
    master_workers = {r["pid"] for r in recs1 if r["node"] == master}
    os.kill(agents[master].pid, signal.SIGSTOP)     # its held poll answered (the hold's end: half a lease), unread
    with contextlib.suppress(AssertionError):       # (stopped with no poll in flight: between polls already)
        wait_until(lambda: reply_unread(agents[master].pid, cluster.port), 10, "the stopped agent's poll answered")
    os.kill(agents[master].pid, signal.SIGKILL)
    key2, recs2 = wait_world(tmp_path, world=2, nodes=(other, "c"), what="with the promoted spare")

    assert key2[2] == 0, "losing a node must not consume the restart budget"
    assert_clean_world(recs2, 2)
    ranks = {r["node"]: r["group_rank"] for r in recs2}
    assert ranks == {other: 1, "c": 0}, ranks     # the spare takes the lost node's place: the survivor keeps its own
    for pid in master_workers:
        assert pid_gone(pid, timeout=10)
    job = job_view(cluster, "spare")
    assert job["spares"] == [] and sorted(n["node_id"] for n in job["nodes"]) == sorted([other, "c"]), job
    assert job["restart_count"] == 0
    events = job_events(cluster, "spare")
    assert kinds(events, "node_spare", "c") and kinds(events, "node_lost", master), events

    stop_job(tmp_path)
    for n in (other, "c"):
        assert agents[n].wait(LIMIT) == 0, agents[n].output
    assert job_view(cluster, "spare")["state"] == "succeeded"


# ---------------------------------------------------------------------------------------- exclusion


def test_node_failing_repeatedly_is_excluded_then_readmitted_after_cooldown(cluster, tmp_path):
    # The agent flags --exclude-after/--exclude-cooldown set the job's exclusion rule (server
    # defaults: 3 failures, 60 s cooldown). Node c's worker fails at start while its fail file exists.
    cluster.start_server()
    fail_file = tmp_path / "fail-c"
    fail_file.write_text("fail")
    excl = ("--exclude-after", "2", "--exclude-cooldown", "20")    # a and b step at world 2 within it, loaded
    agents = {n: start_agent(cluster, tmp_path, n, job="excl", nnodes="2:3", max_restarts=10, extra=excl,
                             env={"FAIL_FILE": str(fail_file)} if n == "c" else None)
              for n in ("a", "b", "c")}

    agents["c"].wait_for_line(r"node is excluded for", LIMIT)    # the agent's own announcement
    fail_file.unlink()          # c's worker works from now on: after its cooldown it must come back
    job = job_view(cluster, "excl")
    assert [e["node_id"] for e in job["excluded"]] == ["c"], job
    left = job["excluded"][0]["excluded_for_s"]
    assert 0 < left <= 20, job
    assert job["restart_count"] == 2, job
    assert "c" not in {n["node_id"] for n in job["nodes"]}, job
    events = job_events(cluster, "excl")
    failed = kinds(events, "worker_failed")
    assert len(failed) == 2 and {e["node_id"] for e in failed} == {"c"}, failed
    assert kinds(events, "node_excluded", "c"), events

    # meanwhile the job goes on without c
    key2, recs2 = wait_world(tmp_path, world=2, nodes=("a", "b"), what="without the excluded node")
    assert_clean_world(recs2, 2)
    # after the cooldown c is readmitted and the world grows back to three
    key3, recs3 = wait_world(tmp_path, world=3, nodes=("a", "b", "c"), what="with c readmitted")
    assert_clean_world(recs3, 3)
    events = job_events(cluster, "excl")
    assert kinds(events, "node_readmitted", "c"), events
    assert job_view(cluster, "excl")["excluded"] == []

    stop_job(tmp_path)
    for a in agents.values():
        assert a.wait(LIMIT) == 0, a.output
    job = job_view(cluster, "excl")
    assert job["state"] == "succeeded" and job["restart_count"] == 2, job


# ---------------------------------------------------------------------------------------- consistency


def test_every_round_is_one_agreed_fact_for_all_its_workers(cluster, tmp_path):
    """Three rounds (first; after a worker failure; after a node leaves), nodes of 1, 2 and 1
    workers: every worker of a round saw the same world size, master and restart count, ranks
    cover 0..W-1 once, and agents, workers and the server tell the same story."""
    cluster.start_server()
    env = {"FAIL_RANK": "1", "FAIL_STEP": "2"}     # rank 1 fails once, at restart count 0
    # a long last call: the first round has all three even where their imports end seconds apart (a loaded
    # machine), else its rank 1 fails at world 3 and no world of 4 at restart 0 ever exists
    agents = {n: start_agent(cluster, tmp_path, n, job="agree", nnodes="2:3", nproc=p, env=env,
                             extra=("--last-call", "15")) for n, p in (("a", 1), ("b", 2), ("c", 1))}
    k0, _ = wait_world(tmp_path, world=4, restart=0)
    k1, _ = wait_world(tmp_path, world=4, restart=1, what="after the planned failure")
    leaver = next(n["node_id"] for n in job_view(cluster, "agree")["nodes"] if n["group_rank"] == 2)
    agents[leaver].popen.send_signal(signal.SIGTERM)
    assert agents[leaver].wait(LIMIT) == 128 + signal.SIGTERM, agents[leaver].output
    world3 = 4 - (2 if leaver == "b" else 1)
    k2, _ = wait_world(tmp_path, world=world3, restart=1, what="after one node left")
    stop_job(tmp_path)
    for n, a in agents.items():
        if n != leaver:
            assert a.wait(LIMIT) == 0, a.output

    # the workers: each world they ran in is consistent
    seen = worlds(tmp_path)
    for key in (k0, k1, k2):
        assert_clean_world(seen[key], key[3])
    for key, recs in seen.items():
        ranks = [r["rank"] for r in recs if r["kind"] == "start"]
        assert len(ranks) == len(set(ranks)) and set(ranks) <= set(range(key[3])), (key, ranks)
        assert len({r["group_world"] for r in recs}) == 1, (key, recs)

    # the agents: every node announcing round R announced the same world, master and restart count
    announced: dict[int, list[dict]] = defaultdict(list)
    for a in agents.values():
        for line in announced_rounds(a):
            announced[line["round"]].append(line)
    for rid, lines in announced.items():
        assert len({(ln["world"], ln["master_addr"], ln["master_port"], ln["restart"], ln["group_world"])
                    for ln in lines}) == 1, (rid, lines)
        assert sorted(ln["group_rank"] for ln in lines) == list(range(len(lines))), (rid, lines)
        covered = sorted(r for ln in lines for r in range(ln["first"], ln["last"] + 1))
        assert covered == list(range(lines[0]["world"])), (rid, lines)
    by_fact = {(ls[0]["master_addr"], ls[0]["master_port"], ls[0]["restart"], ls[0]["world"]): rid
               for rid, ls in announced.items()}
    for key in seen:
        assert key in by_fact, f"workers ran in a world no agent announced: {key}"

    # the server: its rounds match the announcements, and restart counts follow accepted failures
    events = job_events(cluster, "agree")
    completed = {e["round_id"]: e for e in kinds(events, "round_completed")}
    for rid, lines in announced.items():
        assert completed[rid]["data"]["world_size"] == lines[0]["world"], (rid, completed[rid], lines)
        failures_before = {(e["node_id"], e["round_id"]) for e in kinds(events, "worker_failed")
                           if e["seq"] < completed[rid]["seq"]}
        assert lines[0]["restart"] == len(failures_before), (rid, lines, failures_before)
    restarts = [announced[rid][0]["restart"] for rid in sorted(announced)]
    assert restarts == sorted(restarts)
    assert [by_fact[k] for k in (k0, k1, k2)] == sorted(by_fact[k] for k in (k0, k1, k2))
    job = job_view(cluster, "agree")
    assert job["state"] == "succeeded" and job["restart_count"] == 1, job

