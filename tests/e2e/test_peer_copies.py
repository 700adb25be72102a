"""End-to-end peer copies (issue 46): a lost node's ranks resume from a peer's copy of their snapshots, not from
disk. Real server and agents on 127.0.0.1 (each node its own failure domain), 2 gloo workers per node running
benchmarks/scripts/shard_train.py: each rank owns a shard that tells its step, snapshots it every 5 steps and logs
how it resumed (OUT_DIR/resumed.txt) and each step. Waits are bounded polls of those files and the server's views.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import time
import urllib.request

import pytest

from node_agent.workers.memory import dir_name
from tests.e2e.certs import make_ca, make_server_cert
from tests.e2e.harness import job_events, job_view, shard_resumes, wait_until

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDS = os.path.join(ROOT, "benchmarks", "scripts", "shard_train.py")
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")
LIMIT = 120.0
ENV = {"STATE_MB": "1", "STEP_S": "0.1", "SNAP_EVERY": "5", "DISK_EVERY": "0"}


def start(cluster, out, node: str, job: str, *, endpoint: str = "", extra: tuple[str, ...] = (),
          env: dict[str, str] | None = None):
    return cluster.agent("--endpoint", endpoint or cluster.endpoint(), "--nnodes", "2:3", "--nproc", "2", "--job-id",
                         job, "--max-restarts", "3", "--node-id", node, "--failure-domain", f"rack-{node}", *FAST,
                         *extra, SHARDS, name=node, env={"OUT_DIR": str(out), "NODE": node, **ENV, **(env or {})})


def memory_of(job: str, node: str) -> str:
    """A node's memory directory (node_agent/workers/memory.py): the job's and the node id's."""
    return os.path.join(f"/dev/shm/node-agent-mem-{os.getuid()}", dir_name(job, node))


def remove_memory(job: str, node: str) -> None:
    """`node`'s memory directory removed, as with its host: its workers die a moment after its agent, and one may
    still be writing a snapshot into it meanwhile."""
    gone = memory_of(job, node)
    wait_until(lambda: not shutil.rmtree(gone, ignore_errors=True) and not os.path.exists(gone), LIMIT,
               f"{gone} removed")


def lose_group_rank_1(cluster, out, job: str, agents: dict) -> tuple[str, dict[int, tuple[int, str, str]]]:
    """SIGKILL the agent of group rank 1 (its workers die with it) and remove its memory; how every rank resumed."""
    lost = next(n["node_id"] for n in job_view(cluster, job)["nodes"] if n["group_rank"] == 1)
    killed_at = time.time()
    os.kill(agents[lost].pid, signal.SIGKILL)
    agents[lost].wait(LIMIT)
    remove_memory(job, lost)                     # its host's memory is gone with it
    back = wait_until(lambda: len(shard_resumes(out, killed_at)) == 6 and shard_resumes(out, killed_at), LIMIT,
                      lambda: f"every rank resumed: {shard_resumes(out, killed_at)}\n{agents['s'].output}")
    return lost, back


def finish(out, agents: dict, lost: str) -> None:
    (out / "stop").write_text("stop")
    for n, agent in agents.items():
        if n != lost:
            assert agent.wait(LIMIT) == 0, agent.output


def steps(out) -> list[tuple[float, int, int, str]]:
    """(time, step, rank, node) of every step logged."""
    rows = []
    for path in glob.glob(os.path.join(out, "steps-*.txt")):
        node = os.path.basename(path).split("-")[1]
        with open(path) as f:
            rows += [(float(p[0]), int(p[1]), int(p[4]), node) for p in (ln.split() for ln in f) if len(p) == 5]
    return rows


SLOW = ("--replica-bandwidth", "1M")        # 2 ranks x ~1 MB a push: ~2 s, a snapshot every 0.5 s


def slow_copies_and_a_spare(cluster, out, job: str) -> tuple[dict, str]:
    """a, b and c stepping with copies slower than their snapshots, and a ready spare s; the agents, and the node of
    group rank 1."""
    cluster.start_server()
    agents = {n: start(cluster, out, n, job, extra=SLOW) for n in ("a", "b", "c")}
    wait_until(lambda: len({r for *_, r, _ in steps(out)}) == 6, LIMIT, "every rank stepping")
    agents["s"] = start(cluster, out, "s", job, extra=SLOW)
    agents["s"].wait_for_line(r"ready after", LIMIT)
    return agents, next(n["node_id"] for n in job_view(cluster, job)["nodes"] if n["group_rank"] == 1)


def test_the_node_taking_a_lost_nodes_place_resumes_from_its_peer_copy(cluster, tmp_path):
    cluster.start_server()
    agents = {n: start(cluster, tmp_path, n, "copies") for n in ("a", "b", "c")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) == 6, LIMIT, "every rank stepping")
    agents["s"] = start(cluster, tmp_path, "s", "copies")
    agents["s"].wait_for_line(r"ready after", LIMIT)      # a spare still preparing takes no place
    lost = next(n["node_id"] for n in job_view(cluster, "copies")["nodes"] if n["group_rank"] == 1)
    # Its ranks' copies are on a peer once the views say so (the agents' polls carry it).
    wait_until(lambda: next(n for n in job_view(cluster, "copies")["nodes"] if n["node_id"] == lost)
               .get("copies", {}).get("copied_step", -1) >= 10, LIMIT, f"node {lost}'s copies of step 10 or later")

    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'rdzv_job_copy_lag_steps{job="copies"}' in metrics and 'rdzv_job_copy_refusals{job="copies"} 0.0' in metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}/jobs/copies", timeout=10) as resp:
        assert " &middot; copy " in resp.read().decode()           # the page's snapshot column

    assert lose_group_rank_1(cluster, tmp_path, "copies", agents)[0] == lost
    back = shard_resumes(tmp_path, 0.0)
    assert {source for _, source, _ in back.values()} == {"memory"}, (back, agents["s"].output)
    assert len({step for step, _, _ in back.values()}) == 1 and min(s for s, _, _ in back.values()) >= 10, back
    assert {ok for _, _, ok in back.values()} == {"ok"}, back          # each rank loaded its own shard
    assert f"fetched node {lost}'s snapshots" in agents["s"].output, agents["s"].output
    assert [e for e in job_events(cluster, "copies") if e["kind"] == "node_lost" and e["node_id"] == lost]
    finish(tmp_path, agents, lost)


@pytest.mark.parametrize("with_certs", [True, False], ids=["certificates", "none"])
def test_where_the_server_uses_tls_copies_need_the_nodes_certificates(cluster, tmp_path, with_certs):
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    cluster.start_server("--tls-cert", cert, "--tls-key", key, "--state-dir", "none")
    cluster.ca = ca[0]
    job = f"tls-{'certs' if with_certs else 'none'}"     # a job id per case: its memory directories are its own
    extra = ("--tls-ca", ca[0], *(("--tls-cert", cert, "--tls-key", key) if with_certs else ()))
    run = {n: start(cluster, tmp_path, n, job, endpoint=f"https://{cluster.endpoint()}", extra=extra)
           for n in ("a", "b", "c")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) == 6, LIMIT, "every rank stepping")
    run["s"] = start(cluster, tmp_path, "s", job, endpoint=f"https://{cluster.endpoint()}", extra=extra)
    run["s"].wait_for_line(r"ready after", LIMIT)
    said_off = [n for n, a in run.items() if "peer copies off: the server uses TLS" in a.output]
    if with_certs:
        lost = next(n["node_id"] for n in job_view(cluster, job)["nodes"] if n["group_rank"] == 1)
        wait_until(lambda: next(n for n in job_view(cluster, job)["nodes"] if n["node_id"] == lost)
                   .get("copies", {}).get("copied_step", -1) >= 10, LIMIT, f"node {lost}'s copies on a peer")
    else:
        wait_until(lambda: max((s for _, s, _, _ in steps(tmp_path)), default=0) >= 12, LIMIT, "step 12")
    lost, back = lose_group_rank_1(cluster, tmp_path, job, run)
    if with_certs:                     # over TLS, both ways checked: as in the clear
        assert not said_off and {source for _, source, _ in back.values()} == {"memory"}, (back, run["s"].output)
        assert f"fetched node {lost}'s snapshots" in run["s"].output and {ok for *_, ok in back.values()} == {"ok"}
    else:                              # no copies in the clear: said by every node; the job goes back, as before
        assert sorted(said_off) == ["a", "b", "c", "s"] and "memory" not in {src for _, src, _ in back.values()}
        assert any("no copy of" in e["message"] for e in job_events(cluster, job) if e["kind"] == "round_completed")
    finish(tmp_path, run, lost)


def test_copies_slower_than_the_snapshots_still_cost_a_lost_node_no_more_than_its_copy(cluster, tmp_path):
    """--replica-bandwidth so low that a copy lands several snapshots late (each rank keeps 2): before, the spare
    fetched a step the others had let go, and every rank resumed from step 0. Every member now keeps its
    snapshots from the job's oldest copy on (NodeStatus.copies_floor), so all resume from the lost node's copy."""
    agents, lost = slow_copies_and_a_spare(cluster, tmp_path, "lag")

    def lagging() -> bool:      # its copy is older than what its ranks keep: the case this test is about
        c = next(n for n in job_view(cluster, "lag")["nodes"] if n["node_id"] == lost).get("copies", {})
        return c.get("copied_step", -1) >= 10 and c.get("local_step", -1) - c.get("copied_step", -1) >= 10

    wait_until(lagging, LIMIT, f"node {lost}'s copies at step 10 or later, and 10 steps behind")
    assert lose_group_rank_1(cluster, tmp_path, "lag", agents)[0] == lost
    back = shard_resumes(tmp_path, 0.0)
    assert {source for _, source, _ in back.values()} == {"memory"}, (back, agents["s"].output)
    assert len({step for step, _, _ in back.values()}) == 1 and min(s for s, _, _ in back.values()) >= 10, back
    assert {ok for _, _, ok in back.values()} == {"ok"}, back
    finish(tmp_path, agents, lost)


def test_a_member_whose_agent_restarts_with_its_copy_behind_keeps_its_place_from_a_ready_spare(cluster, tmp_path):
    """A review: with a ready spare and copies slower than the snapshots, a member's agent killed and started again
    at once (its memory kept) lost its place to the spare, which resumed every rank from the member's older copy (or
    from step 0 before its first copy landed). The member is awaited instead: every rank resumes from its own newer
    snapshot, and the spare stays spare."""
    agents, lost = slow_copies_and_a_spare(cluster, tmp_path, "behind")

    def copies() -> dict:
        return next(n for n in job_view(cluster, "behind")["nodes"] if n["node_id"] == lost).get("copies", {})

    wait_until(lambda: copies().get("local_step", -1) - copies().get("copied_step", -1) >= 10, LIMIT,
               f"node {lost}'s copies 10 steps behind its snapshots")
    copied = copies().get("copied_step", -1)
    killed_at = time.time()
    os.kill(agents[lost].pid, signal.SIGKILL)
    agents[lost].wait(LIMIT)
    agents[lost] = start(cluster, tmp_path, lost, "behind", extra=SLOW)      # its memory in place
    back = wait_until(lambda: len(shard_resumes(tmp_path, killed_at)) == 6 and shard_resumes(tmp_path, killed_at),
                      LIMIT, lambda: f"every rank resumed: {shard_resumes(tmp_path, killed_at)}")
    assert {source for _, source, _ in back.values()} == {"memory"}, back
    assert len({step for step, _, _ in back.values()}) == 1 and min(s for s, _, _ in back.values()) > copied, \
        (back, copied, job_events(cluster, "behind")[-6:])
    view = job_view(cluster, "behind")
    # The spare stays spare, unless the kill fell between a poll's answer and the next: then nobody heard the agent
    # end, its loss is a silent host's (not awaited) and the spare takes the place, from a copy newer than `copied`
    silent = any(e["kind"] == "node_lost" and "no contact" in e["message"] for e in job_events(cluster, "behind"))
    assert view["restart_count"] == 0 and (silent or [n["node_id"] for n in view["spares"]] == ["s"]), view
    finish(tmp_path, agents, "s")            # the spare ran no worker: it exits 1, as it should


def test_a_spare_taking_the_place_of_a_member_back_with_fewer_workers_gets_its_own_newest(cluster, tmp_path):
    """A review: b's agent killed and started again with --nproc 1 while a ready spare of 2 workers waited, copies
    behind the snapshots. The spare took b's place (b waits as the spare) and was told to fetch from b's new agent,
    which refused it ("no key of node b here": it had run no round yet), so every rank resumed from b's older
    peer copy. b's new agent serves the memory it took up with its previous agent's key: every rank resumes past
    the copy."""
    agents, lost = slow_copies_and_a_spare(cluster, tmp_path, "fewer")

    def copies() -> dict:
        return next(n for n in job_view(cluster, "fewer")["nodes"] if n["node_id"] == lost).get("copies", {})

    wait_until(lambda: copies().get("local_step", -1) - copies().get("copied_step", -1) >= 10 and
               copies().get("copied_step", -1) >= 5, LIMIT, f"node {lost}'s copies 10 steps behind its snapshots")
    copied = copies().get("copied_step", -1)
    killed_at = time.time()
    os.kill(agents[lost].pid, signal.SIGKILL)
    agents[lost].wait(LIMIT)
    agents[lost] = start(cluster, tmp_path, lost, "fewer", extra=(*SLOW, "--nproc", "1"))
    back = wait_until(lambda: len(shard_resumes(tmp_path, killed_at)) == 6 and shard_resumes(tmp_path, killed_at),
                      LIMIT, lambda: f"every rank resumed: {shard_resumes(tmp_path, killed_at)}\n"
                                     f"{agents['s'].output}\n{agents[lost].output}")
    assert "no key of node" not in agents[lost].output, agents[lost].output
    assert {source for _, source, _ in back.values()} == {"memory"}, back
    assert len({step for step, _, _ in back.values()}) == 1 and min(s for s, _, _ in back.values()) > copied, \
        (back, copied, agents["s"].output)
    finish(tmp_path, agents, lost)            # b, a spare now, ran no worker


def test_a_spare_lost_before_its_own_copy_landed_leaves_the_place_the_copies_it_fetched(cluster, tmp_path):
    """A review: s took b's place, fetched b's copies from their holder and dropped them there at once; lost (its
    host gone) before its own copy of that step landed, the next spare t was told b's copies, refused ("no key of
    node b here"): every rank back to step 0. s now drops them once its own copy landed, and the server keeps the
    fetch unfinished till then: t resumes the place from b's copies."""
    cluster.start_server()
    one = ("--nproc", "1", *SLOW)
    agents = {n: start(cluster, tmp_path, n, "window", extra=one) for n in ("a", "b", "c")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) == 3, LIMIT, "every rank stepping")
    for spare in ("s", "t"):
        agents[spare] = start(cluster, tmp_path, spare, "window", extra=one)
        agents[spare].wait_for_line(r"ready after", LIMIT)
    lost = next(n["node_id"] for n in job_view(cluster, "window")["nodes"] if n["group_rank"] == 1)
    wait_until(lambda: next(n for n in job_view(cluster, "window")["nodes"] if n["node_id"] == lost)
               .get("copies", {}).get("copied_step", -1) >= 10, LIMIT, f"node {lost}'s copies of step 10 or later")
    os.kill(agents[lost].pid, signal.SIGKILL)
    agents[lost].wait(LIMIT)
    remove_memory("window", lost)
    taker = wait_until(lambda: next((n for n in ("s", "t") if f"fetched node {lost}'s" in agents[n].output), None),
                       LIMIT, f"a spare fetched node {lost}'s copies")
    killed_at = time.time()
    os.kill(agents[taker].pid, signal.SIGKILL)       # as its own first copy is on its way (1 MB at 1 MB/s)
    agents[taker].wait(LIMIT)
    remove_memory("window", taker)
    back = wait_until(lambda: len(shard_resumes(tmp_path, killed_at)) == 3 and shard_resumes(tmp_path, killed_at),
                      LIMIT, lambda: f"every rank resumed: {shard_resumes(tmp_path, killed_at)}")
    other = "t" if taker == "s" else "s"
    assert {source for _, source, _ in back.values()} == {"memory"}, (back, agents[other].output)
    assert min(s for s, _, _ in back.values()) >= 10, back
    finish(tmp_path, {n: a for n, a in agents.items() if n != taker}, lost)


def test_a_gone_nodes_copies_nobody_can_fetch_leave_their_holder_at_once(cluster, tmp_path):
    """A soak review: a 2-node job whose second node came back under a new id each time (its newcomer fetching
    nothing) left every gone id's copies on the survivor until its limit refused the live member's pushes. b lost and
    a round formed without it, a new node q joins: the round names no copy of b as wanted, and a drops them."""
    cluster.start_server()
    one = ("--nproc", "1", "--nnodes", "1:2")
    # a joins first: group rank 0 (b joining first made a take b's place, and fetch its copies, as the job shrank)
    agents = {"a": start(cluster, tmp_path, "a", "unwanted", extra=one)}
    agents["a"].wait_for_line(r"waiting for the next round", LIMIT)
    agents["b"] = start(cluster, tmp_path, "b", "unwanted", extra=one)
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) == 2, LIMIT, "every rank stepping")
    wait_until(lambda: next((n for n in job_view(cluster, "unwanted")["nodes"] if n["node_id"] == "b"), {})
               .get("copies", {}).get("copied_step", -1) >= 5, LIMIT, "node b's copies of step 5 or later on a")
    held = os.path.join(memory_of("unwanted", "a"), "replicas", "b")
    assert os.path.isdir(held)

    def alone() -> int:
        return sum("group rank 0/1," in line for line in agents["a"].lines)

    before = alone()                # (round 1 may have been a's alone, before b came)
    os.kill(agents["b"].pid, signal.SIGKILL)
    agents["b"].wait(LIMIT)
    # A round without b, nobody in its place: one more "group rank 0/1" since b went. Matching round 1's started q
    # while the job still waited for b, and q, ready first on a loaded host, took b's place and fetched its copies,
    # which a then rightly kept.
    wait_until(lambda: alone() > before, LIMIT, lambda: f"a round without b:\n{agents['a'].output}")
    agents["q"] = start(cluster, tmp_path, "q", "unwanted", extra=one)     # a new node, under a new id
    agents["a"].wait_for_line(r"dropped those of node\(s\) b: no longer held here", LIMIT)
    assert not os.path.exists(held)
    wait_until(lambda: os.path.isdir(os.path.join(memory_of("unwanted", "a"), "replicas", "q")), LIMIT,
               "node q's copies on a")
    finish(tmp_path, agents, "b")


def holders(cluster, job: str, racks: dict[str, str]) -> dict[str, str]:
    """Each member's copy holder in the job's round (--replicas 1), as rounds.Derived.replica_ranks pairs them: the
    member at its position in the next rack, by the racks' first appearance in group rank order."""
    ranked = [n["node_id"] for n in sorted(job_view(cluster, job)["nodes"], key=lambda n: n.get("group_rank") or 0)
              if n.get("group_rank") is not None and n["group_rank"] >= 0]
    order: dict[str, list[str]] = {}
    for m in ranked:
        order.setdefault(racks[m], []).append(m)
    domains = list(order)
    out = {}
    for m in ranked:
        rack = order[domains[(domains.index(racks[m]) + 1) % len(domains)]]
        out[m] = rack[order[racks[m]].index(m) % len(rack)]
    return out


def _pairing_turned(cluster, tmp_path, job: str, env: dict[str, str], *extra: str):
    """Racks A A B B and a spare of rack C (a copy goes to the other rack), every node's copies at step 10 or later;
    then group rank 1 SIGKILLed, its memory removed, and the spare's fetch of it done, so the pairing turned. The
    agents, how to start one again, the node lost, and each node's holder before and after."""
    racks = {"a": "A", "b": "A", "c": "B", "d": "B", "s": "C"}

    def one(node: str):
        return start(cluster, tmp_path, node, job, env=env, extra=("--nproc", "1", "--nnodes", "4:4", *SLOW, *extra,
                                                                   "--failure-domain", racks[node]))

    agents = {n: one(n) for n in ("a", "b", "c", "d")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) == 4, LIMIT, "every rank stepping")
    agents["s"] = one("s")
    agents["s"].wait_for_line(r"ready after", LIMIT)
    wait_until(lambda: min(n.get("copies", {}).get("copied_step", -1) for n in job_view(cluster, job)["nodes"])
               >= 10, LIMIT, "every node's copies of step 10 or later")
    before = holders(cluster, job, racks)
    lost = next(n["node_id"] for n in job_view(cluster, job)["nodes"] if n["group_rank"] == 1)
    os.kill(agents[lost].pid, signal.SIGKILL)
    agents[lost].wait(LIMIT)
    remove_memory(job, lost)
    agents["s"].wait_for_line(f"fetched node {lost}'s", LIMIT)
    return agents, one, lost, before, holders(cluster, job, racks)


def test_a_live_members_copy_stays_at_its_old_holder_till_its_new_holder_has_one(cluster, tmp_path):
    """A review: 4 nodes, racks A A B B (a copy goes to the other rack), and a spare of a third rack C. The spare took
    group rank 1's place and the pairing turned: a member's copies went to the spare from now on, and their old
    holder dropped them as the round began ("gone", though the member lived) while its first copy to the spare was
    still on its way (8 MB at 1 MB/s). That member lost then, with its memory, resumed from step 0. Its old holder
    now keeps its copies till the new one has its own, and its loss fetches them from there.
    The last snapshot is of step 10 (SNAP_LAST): both losses' copies are of it. Snapshots on, a loaded host's
    pushes landed a snapshot apart (the lost node's copy of step 75, the moved one's of 70) and two nodes lost
    with copies of different steps share none: step 0, whatever the old holder kept."""
    cluster.start_server()
    agents, one, lost, before, after = _pairing_turned(cluster, tmp_path, "turn", {"STATE_MB": "8", "SNAP_LAST": "10"})
    # A member whose copies go to another holder now, their old holder alive (the racks make one)
    turned = next(m for m, h in after.items() if m != "s" and before.get(m) not in (h, lost, None))
    killed_at = time.time()
    os.kill(agents[turned].pid, signal.SIGKILL)
    agents[turned].wait(LIMIT)
    remove_memory("turn", turned)
    agents[turned] = one(turned)
    back = wait_until(lambda: len(shard_resumes(tmp_path, killed_at)) == 4 and shard_resumes(tmp_path, killed_at),
                      LIMIT, lambda: f"every rank resumed: {shard_resumes(tmp_path, killed_at)}")
    assert {source for _, source, _ in back.values()} == {"memory"}, \
        (back, agents[turned].output, {n: a.output[-3000:] for n, a in agents.items() if n != turned})
    assert min(s for s, _, _ in back.values()) >= 10, back
    assert f"fetched node {turned}'s snapshots" in agents[turned].output, agents[turned].output   # from its old holder
    finish(tmp_path, agents, lost)


def test_a_moving_members_copy_makes_room_for_its_old_holders_own_source_at_a_small_limit(cluster, tmp_path):
    """A review: racks A A B B and a spare of rack C, --memory-dir-limit for two copies, not three. The spare took
    group rank 1's place and the pairing turned; an old holder kept a moved member's copy (the second place its loss
    fetches from) beside its new source's first copy, and refused every later push of that source ("memory limit
    full") until the moved copy went unrenewed for 10 minutes: the source's copies stayed at their first step there.
    The moved copy now makes room for the source's pushes."""
    cluster.start_server()

    def copies(node: str) -> dict:
        return next(n.get("copies") or {} for n in job_view(cluster, "small")["nodes"] if n["node_id"] == node)

    agents, _, lost, before, after = _pairing_turned(cluster, tmp_path, "small", {"STATE_MB": "4"},
                                                     "--memory-dir-limit", "10M")
    # A member whose copies go to another holder now, their old holder alive, and that holder's source now
    moved, old, source = next((m, before[m], src) for m, h in after.items() for src, at in after.items()
                              if m != "s" and before.get(m) not in (h, lost, None) and at == before[m])
    agents[old].wait_for_line(f"removed node {moved}'s copies, of a member whose copies go to another holder now",
                              LIMIT)
    first = wait_until(lambda: copies(source).get("copied_step", -1), LIMIT, f"node {source}'s copies")
    wait_until(lambda: copies(source).get("copied_step", -1) >= first + 10, LIMIT,
               lambda: f"node {source}'s copies at {old} past step {first + 10}: {copies(source)}\n"
                       f"{agents[old].output[-3000:]}")
    finish(tmp_path, agents, lost)


def test_a_moving_members_only_copy_stays_at_its_old_holder_till_its_new_one_landed(cluster, tmp_path):
    """A review (of the test above's rule): the old holder dropped a moved member's copy for its source's push as the
    round began, before the member's first push to its new holder landed; the member was lost then, with its memory,
    its next agent found no copy at either holder ("no copy held", "wrong key"), and every rank went back to step 0
    (89 steps trained again). The old copy makes room only once the server heard the new one landed."""
    cluster.start_server()
    agents, one, lost, before, after = _pairing_turned(cluster, tmp_path, "moving", {"STATE_MB": "4"},
                                                       "--memory-dir-limit", "10M")
    moved, old = next((m, before[m]) for m, h in after.items() for src, at in after.items()
                      if m != "s" and before.get(m) not in (h, lost, None) and at == before[m])
    agents[old].wait_for_line(f"removed node {moved}'s copies, of a member whose copies go to another holder now",
                              LIMIT)
    os.kill(agents[moved].pid, signal.SIGKILL)      # lost the moment its old copy went: its new one is there
    agents[moved].wait(LIMIT)
    remove_memory("moving", moved)
    agents[moved] = one(moved)
    agents[moved].wait_for_line(f"fetched node {moved}'s", LIMIT)
    finish(tmp_path, agents, lost)
