"""The agent's in-memory checkpoint directories (workers/memory.py), their flags and the workers'
variables; the worker's helper (node_agent/snapshot.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import types

import pytest

from node_agent.cli.command_line import OptionsError
from node_agent.cli.options import parse_options
from node_agent.settings import default_node_id, made_from_pid
from node_agent.training import fetched, snapshot
from node_agent.workers import memory, memory_files, owners, succession
from node_agent.workers.environment import worker_env
from node_agent.workers.memory import KEEP_S, MemoryDirs, dir_name, sweep
from node_agent.workers.succession import keep_credential, left_credential, predecessor
from protocol.messages import Assignment

ONE = Assignment(round_id=1, group_rank=0, group_world_size=1, rank_offset=0, world_size=2, local_world_size=2,
                 master_addr="127.0.0.1", master_port=1, restart_count=0, max_restarts=0)


def test_one_directory_per_local_rank_the_same_every_round_removed_on_close(tmp_path) -> None:
    said: list[str] = []
    dirs = MemoryDirs("job/1", 2, 4 * 2**20, say=said.append, base=str(tmp_path))
    first = dirs.dirs(2)
    assert sorted(first) == [0, 1] and all(os.path.isdir(d) for d in first.values())
    assert dirs.dirs(2) == first and dirs.rank_limit == 2 * 2**20
    assert os.path.basename(os.path.dirname(first[0])).startswith("job_1.")   # one path component
    assert any("2.0 MiB per local rank" in line for line in said)
    dirs.close()
    assert not os.path.exists(os.path.dirname(first[0]))


def test_a_share_under_a_mib_is_said_in_bytes_not_as_zero(tmp_path) -> None:
    """A review: an agent restarted onto a nearly full /dev/shm said "0 MiB per local rank", then wrote snapshots."""
    said: list[str] = []
    dirs = MemoryDirs("job", 2, 600_000, say=said.append, base=str(tmp_path))
    dirs.dirs(2)
    assert any("300000 bytes per local rank" in line for line in said) and not any("0 MiB" in x for x in said)
    dirs.close()


def test_a_directory_whose_ranks_moved_is_emptied_and_one_whose_ranks_stayed_is_kept(tmp_path) -> None:
    said: list[str] = []
    dirs = MemoryDirs("job", 2, 4 * 2**20, say=said.append, base=str(tmp_path))
    first = dirs.dirs_for(2, 4)                       # global ranks 4-5
    for d in first.values():
        snapshot.save(b"shard", 10, where=d)
        os.makedirs(os.path.join(d, ".resume"))       # a framework's resume folder (node_agent/training/hf.py)
    assert dirs.dirs_for(2, 4) == first and all(snapshot.steps(d) == [10] for d in first.values())
    assert not said[1:]
    moved = dirs.dirs_for(2, 2)                       # closed up: now ranks 2-3, and its snapshots are 4-5's
    assert moved == first and all(snapshot.steps(d) == [] for d in moved.values())
    assert not any(os.path.exists(os.path.join(d, ".resume")) for d in moved.values())
    assert "rank(s) 4, 5" in said[-1]
    snapshot.save(b"shard", 15, where=moved[0])
    assert snapshot.steps(dirs.dirs_for(2, 2)[0]) == [15]      # its own again from then on


def test_a_directory_whose_ranks_moved_keeps_its_snapshots_where_the_ranks_are_replicas(tmp_path) -> None:
    """A review (2 gloo nodes, DDP): group rank 0's agent restarted, the survivor moved into its place and removed
    its own snapshots, the only ones left: every rank back to step 0. Under DDP (the job's digests agreed) any
    rank's snapshot is every rank's state: kept, and said."""
    said: list[str] = []
    dirs = MemoryDirs("job", 1, 4 * 2**20, say=said.append, base=str(tmp_path))
    snapshot.save(b"replica", 40, where=dirs.dirs_for(1, 1)[0])       # global rank 1
    moved = dirs.dirs_for(1, 0, alike=True)                           # it took rank 0's place
    assert snapshot.steps(moved[0]) == [40]
    assert "rank(s) 1 are kept" in said[-1]
    with open(os.path.join(moved[0], memory.RANK_FILE)) as f:
        assert f.read().strip() == "0"


def test_off_means_no_directory(tmp_path) -> None:
    dirs = MemoryDirs("j", 2, 0, say=lambda _: None, base=str(tmp_path))
    assert dirs.dirs(2) == {} and os.listdir(tmp_path) == []


def test_no_room_for_the_directory_is_a_warning_not_a_failed_job(tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    said: list[str] = []
    dirs = MemoryDirs("j", 1, None, say=said.append, base=str(tmp_path / "file"))
    assert dirs.dirs(1) == {} and not dirs.enabled
    assert said and said[-1].startswith("no in-memory checkpoint directory")


def test_the_default_limit_is_half_the_free_space(tmp_path) -> None:
    dirs = MemoryDirs("j", 1, None, say=lambda _: None, base=str(tmp_path))
    dirs.dirs(1)
    st = os.statvfs(tmp_path)
    assert dirs.rank_limit is not None and 0 < dirs.rank_limit <= st.f_blocks * st.f_frsize // 2
    dirs.close()


def test_the_sweep_removes_directories_of_dead_agents_only(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    live = MemoryDirs("live", 1, 2**20, say=lambda _: None, base=str(tmp_path))
    live_dir = os.path.dirname(live.dirs(1)[0])
    parent = os.path.dirname(live_dir)
    for name, owner in (("dead", f"{dead_pid} 1"), ("reused", f"{os.getpid()} 1"), ("broken", "x")):
        os.makedirs(os.path.join(parent, name, "0"))
        with open(os.path.join(parent, name, "owner"), "w") as f:
            f.write(owner)
    os.makedirs(os.path.join(parent, "making"))           # no owner file yet: being made
    assert sweep(parent) == 2                            # dead, and our pid with another start time
    assert sorted(os.listdir(parent)) == sorted(["broken", "making", os.path.basename(live_dir)])
    said: list[str] = []
    os.makedirs(os.path.join(parent, "dead2"))
    with open(os.path.join(parent, "dead2", "owner"), "w") as f:
        f.write(f"{dead_pid} 1")
    MemoryDirs("next", 1, 2**20, say=said.append, base=str(tmp_path)).dirs(1)
    assert "removed 1 in-memory checkpoint directory left by agents that were killed" in said


KILLED_AGENT = """
import os, sys
from node_agent.training import fetched, snapshot
from node_agent.workers.memory import MemoryDirs
job, node, base = sys.argv[1:4]
from node_agent.settings import default_node_id
node = default_node_id() if node == "HOSTNAME-PID" else node
print(node, flush=True)
memory = MemoryDirs(job, 2, 2**20, say=lambda _: None, base=base, node_id=node)
memory.succeeded = sys.argv[4:] != ["standalone"]     # an agent that reached a server: its next may take its id
dirs = memory.dirs_for(2, 2, "run-1")
from node_agent.workers.succession import keep_credential
keep_credential(memory, f"secret-of-{node}")       # its secret from the server, for its next agent to show
for d in dirs.values():
    snapshot.save(b"shard", 25, where=d)
    os.link(snapshot.path(25, d), os.path.join(d, snapshot.SENDING + "its-own-pin"))    # a send under way
os._exit(9)   # as a SIGKILL: no clean-up
"""


def killed_agent(tmp_path, job: str, node: str, standalone: bool = False) -> str:
    """An agent process of `job`'s node `node` (HOSTNAME-PID: the default, made from its pid) that saved step 25 on
    its 2 local ranks (global 2-3) and was killed; its node id. `standalone`: one that reached no server."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", KILLED_AGENT, job, node, str(tmp_path),
                           *(["standalone"] if standalone else [])], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 9, done.stderr
    return done.stdout.strip()


def test_the_next_agent_of_the_same_job_and_node_takes_up_its_memory_within_the_same_run(tmp_path) -> None:
    killed_agent(tmp_path, "job", "node-b")
    said: list[str] = []
    dirs = MemoryDirs("job", 2, 2**20, say=said.append, base=str(tmp_path), node_id="node-b")
    kept = dirs.dirs_for(2, 2, "run-1")
    assert [snapshot.steps(d) for d in kept.values()] == [[25], [25]]
    assert any("found node node-b's memory, left by its previous agent" in line for line in said), said
    assert any("kept the memory of node node-b's previous agent" in line for line in said), said
    assert [os.stat(snapshot.path(25, d)).st_nlink for d in kept.values()] == [1, 1]     # its sends ended with it
    dirs.close()
    killed_agent(tmp_path, "job", "node-b")
    again = MemoryDirs("job", 2, 2**20, say=said.append, base=str(tmp_path), node_id="node-b")
    assert [snapshot.steps(d) for d in again.dirs_for(2, 2, "run-2").values()] == [[], []]    # another run's
    assert "it is of another run of job 'job'" in said[-1], said
    again.close()


STOPPED_AGENT = """
import os, sys
from node_agent.training import fetched, snapshot
from node_agent.workers.memory import MemoryDirs
job, node, base = sys.argv[1:4]
from node_agent.settings import default_node_id
dirs = MemoryDirs(job, 1, 2**20, say=print, base=base, node_id=default_node_id() if node == "HOSTNAME-PID" else node)
dirs.succeeded = True
snapshot.save(b"shard", 25, where=dirs.dirs_for(1, 0, "run-1")[0])
dirs.close(keep=f"the job keeps node {dirs.node_id}'s place for its next agent")     # its leave's reply (place_kept_s)
"""


@pytest.mark.parametrize("node", ["node-b", "HOSTNAME-PID"])
def test_a_stopped_agent_whose_place_is_kept_leaves_its_memory_to_the_next_one(tmp_path, node):
    """`systemctl restart`: the next agent of a given node id takes the memory up; one whose id was made from the
    agent's pid (the default HOSTNAME-PID) is taken by the next agent started without --node-id, with that id."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", STOPPED_AGENT, "job", node, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "place for its next agent: its snapshots stay in" in done.stdout, done.stdout
    if node == "HOSTNAME-PID":
        taken = predecessor("job", 1, str(tmp_path))
        assert taken is not None and made_from_pid(taken[0]), taken
        node = taken[0]
    said: list[str] = []
    nxt = MemoryDirs("job", 1, 2**20, say=said.append, base=str(tmp_path), node_id=node)
    assert snapshot.steps(nxt.dirs_for(1, 0, "run-1")[0]) == [25], said
    assert any(f"kept the memory of node {node}'s previous agent" in line for line in said), said
    nxt.close()


def test_a_next_agent_counts_what_its_nodes_memory_holds_as_room_of_its_own(tmp_path, monkeypatch) -> None:
    """A review: the default limit is half of the free space, and a restarted agent counted its own predecessor's
    snapshots (and the copies it held) as used by others: each restart halved what the node could keep, until no
    snapshot fit and every rank went back to step 0."""
    killed_agent(tmp_path, "job", "node-b")
    free = types.SimpleNamespace(f_bavail=1000, f_frsize=4096)
    monkeypatch.setattr(memory.os, "statvfs", lambda path: free)
    fresh = MemoryDirs("job", 2, None, say=lambda _: None, base=str(tmp_path), node_id="node-c")
    fresh.dirs(2)
    assert fresh.rank_limit == 1000 * 4096 // 2 // 2              # nothing of its own: half the free space
    fresh.close()
    nxt = MemoryDirs("job", 2, None, say=lambda _: None, base=str(tmp_path), node_id="node-b")
    nxt.dirs(2)
    held = memory_files.bytes_under(nxt.home)
    assert held > 0 and nxt.rank_limit == (1000 * 4096 + held) // 2 // 2, (held, nxt.rank_limit)
    nxt.close()


def test_a_live_agent_marks_its_nodes_memory_written_to_so_its_next_one_takes_it_up(tmp_path) -> None:
    """A review: KEEP_S counted from the last snapshot; with snapshots ten minutes apart the next agent of a killed
    one (no --node-id) found the memory too old, made a new node and swept it: every rank from step 0."""
    dirs = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path), node_id="node-b")
    dirs.dirs(1)
    old = time.time() - KEEP_S - 100
    for where, subdirs, names in os.walk(dirs.home):
        for name in subdirs + names:
            os.utime(os.path.join(where, name), (old, old))        # its last snapshot long ago
    assert memory.last_write(dirs.home) < time.time() - KEEP_S
    dirs.alive()                                                  # its agent polls the server: alive
    assert memory.last_write(dirs.home) > time.time() - KEEP_S       # new enough for its next agent to take up
    dirs.close()


def test_a_node_id_made_from_a_pid_is_this_hosts_default() -> None:
    assert made_from_pid(default_node_id()) and made_from_pid(default_node_id(1))
    assert not made_from_pid("trainer-1") and not made_from_pid(f"{default_node_id(1)}x")
    assert not made_from_pid("") and not made_from_pid(f"not-{default_node_id(1)}")


def test_an_agent_without_a_node_id_takes_its_ended_predecessors_with_its_memory(tmp_path) -> None:
    """A torchrun user's agent (no --node-id) killed and started again: the new one takes the node id and memory of
    the newest-written ended agent of its job on this host whose id was made from its pid, one agent each; never a
    live agent's, another job's, a given id's, or one older than KEEP_S."""
    base = str(tmp_path)
    older = killed_agent(tmp_path, "job", "HOSTNAME-PID")
    newer = killed_agent(tmp_path, "job", "HOSTNAME-PID")
    killed_agent(tmp_path, "other", "HOSTNAME-PID")
    killed_agent(tmp_path, "job", "given")
    alone = killed_agent(tmp_path, "job", "HOSTNAME-PID", standalone=True)   # no server: a new job id each run
    live = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=base)      # this process's own default id: alive
    live.dirs(1)
    parent = os.path.join(base, f"node-agent-mem-{os.getuid()}")
    stale = os.path.join(parent, dir_name("job", older))
    before = memory.last_write(os.path.join(parent, dir_name("job", newer))) - 1    # (not `now`: the agents after it
    for where, dirs, names in os.walk(stale):                                # may take a second to start)
        for name in dirs + names:
            os.utime(os.path.join(where, name), (before, before))     # written before the other
    assert predecessor("job", 3, base) is None                    # they ran 2 workers, this one 3
    first = predecessor("job", 2, base)
    assert first is not None and first[0] == newer, (first, newer)
    assert predecessor("job", 2, base) == (older, int(older.rpartition("-")[2]))   # claimed: the other goes to the next
    assert predecessor("job", 2, base) is None
    assert alone not in (older, newer)
    said: list[str] = []
    taken = MemoryDirs("job", 2, 2**20, say=said.append, base=base, node_id=newer)
    assert [snapshot.steps(d) for d in taken.dirs_for(2, 2, "run-1").values()] == [[25], [25]], said
    taken.close()
    claimed = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=base, node_id=older)   # owns what was claimed
    claimed.dirs(1)
    claimed.close()
    live.close()
    gone = killed_agent(tmp_path, "job", "HOSTNAME-PID")
    old = time.time() - KEEP_S - 1
    for where, dirs, names in os.walk(os.path.join(parent, dir_name("job", gone))):
        for name in dirs + names:
            os.utime(os.path.join(where, name), (old, old))
    assert predecessor("job", 2, base) is None                                     # too old to be taken


def test_memory_taken_up_keeps_only_the_ranks_whose_global_ranks_stayed(tmp_path) -> None:
    killed_agent(tmp_path, "job", "node-b")
    said: list[str] = []
    dirs = MemoryDirs("job", 1, 2**20, say=said.append, base=str(tmp_path), node_id="node-b")
    one = dirs.dirs_for(1, 4, "run-1")                # now one local rank, global rank 4: not what it saved
    assert [snapshot.steps(d) for d in one.values()] == [[]] and sorted(os.listdir(dirs.root)) == \
        ["0", "credential", "identity", "owner", "run"]
    assert any("now runs 1 local rank(s): the snapshots of local rank(s) 1 were removed" in line
               for line in said), said                # the operator reads why they went
    dirs.close()


def test_a_live_agent_of_the_same_node_keeps_its_memory_and_the_second_makes_its_own(tmp_path) -> None:
    said: list[str] = []
    first = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path), node_id="n")
    second = MemoryDirs("job", 1, 2**20, say=said.append, base=str(tmp_path), node_id="n")
    a, b = first.dirs_for(1, 0, "r")[0], second.dirs_for(1, 0, "r")[0]
    assert a != b and os.path.isdir(a) and "another live agent of node n" in " ".join(said)
    first.close()
    second.close()


def test_the_sweep_keeps_what_a_given_node_id_may_come_back_for_and_only_so_long(tmp_path) -> None:
    killed_agent(tmp_path, "job", "given")              # a node id given: its next agent takes the memory up
    killed_agent(tmp_path, "other", "given")            # another job's too
    parent = os.path.join(tmp_path, f"node-agent-mem-{os.getuid()}")
    said: list[str] = []
    mine = MemoryDirs("job", 1, 2**20, say=said.append, base=str(tmp_path), node_id="a")
    mine.dirs(1)
    assert sorted(n.split(".")[:2] for n in os.listdir(parent)) == [["job", "a"], ["job", "given"],
                                                                     ["other", "given"]]
    assert not any("removed" in line for line in said)
    old = time.time() - KEEP_S - 1                      # nothing written for longer than its next agent may take
    for where, dirs, names in os.walk(next(e.path for e in os.scandir(parent) if e.name.startswith("other."))):
        for name in dirs + names:
            os.utime(os.path.join(where, name), (old, old))
    MemoryDirs("job", 1, 2**20, say=said.append, base=str(tmp_path), node_id="z").dirs(1)
    assert sorted(n.split(".")[:2] for n in os.listdir(parent)) == [["job", "a"], ["job", "given"], ["job", "z"]]
    assert "removed 1 in-memory checkpoint directory left by agents that were killed" in said
    mine.close()


@pytest.mark.parametrize(("argv", "limit"), [
    ([], None), (["--memory-dir-limit", "8G"], 8 * 2**30), (["--memory_dir_limit=512M"], 512 * 2**20),
    (["--memory-dir-limit", "1.5GiB"], 3 * 2**29), (["--memory-dir-limit", "4096"], 4096),
    (["--memory-dir-limit", "0"], 0), (["--no-memory-dir"], 0), (["--no-memory-dir", "--memory-dir-limit", "0"], 0),
])
def test_memory_dir_flags(argv: list[str], limit: int | None) -> None:
    assert parse_options(["--standalone", *argv, "train.py"], {}).workers.memory_dir_limit == limit


@pytest.mark.parametrize(("argv", "message"), [
    (["--memory-dir-limit", "8X"], "--memory-dir-limit: expected a size such as 8G, 512M or 0, got '8X'"),
    (["--memory-dir-limit", "2000T"], "--memory-dir-limit: at most"),
    (["--no-memory-dir", "--memory-dir-limit", "1G"], "--no-memory-dir conflicts with --memory-dir-limit"),
])
def test_bad_memory_dir_flags_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(OptionsError, match="^" + message.replace("(", r"\(")):
        parse_options(["--standalone", *argv, "train.py"], {})


def test_the_workers_environment_names_the_directory_and_its_limit() -> None:
    base = {"PATH": "/bin", snapshot.DIR_VAR: "/outer", snapshot.LIMIT_VAR: "1"}   # an outer agent's
    env = worker_env(base=base, assignment=ONE, local_rank=1, job_id="j", role="r", error_file=None,
                     memory_dir="/dev/shm/x/1", memory_limit=1024)
    assert env[snapshot.DIR_VAR] == "/dev/shm/x/1" and env[snapshot.LIMIT_VAR] == "1024"
    off = worker_env(base=base, assignment=ONE, local_rank=1, job_id="j", role="r", error_file=None)
    # none (--no-memory-dir): empty, so every rank still joins protect's question of who has one; the outer gone
    assert off[snapshot.DIR_VAR] == "" and snapshot.directory(off) is None and snapshot.LIMIT_VAR not in off


# ------------------------------------------------------------------------------- the worker's helper


def test_save_keeps_the_newest_and_never_leaves_a_partial_file(tmp_path) -> None:
    where = str(tmp_path)
    for step in (1, 2, 3):
        snapshot.save(b"a" * 10, step, where=where)
    assert snapshot.steps(where) == [2, 3] and snapshot.newest(where) == 3
    snapshot.save(lambda f: f.write(b"b" * 10), 4, where=where, keep=3)
    assert snapshot.steps(where) == [2, 3, 4]
    with open(snapshot.path(4, where), "rb") as f:
        assert f.read() == b"b" * 10
    (tmp_path / "step-9.tmp").write_bytes(b"half")         # a write cut short is not a snapshot
    assert snapshot.newest(where) == 4


@pytest.mark.parametrize("as_writer", [False, True])
def test_a_limit_that_holds_fewer_than_keep_keeps_the_newest(tmp_path, as_writer) -> None:
    """Refusing the new one would keep the oldest for ever: every later step refused, the job resuming from it.
    A writer's size is known once written: taken to be the newest kept snapshot's. The newest complete one stays
    beside the next until it is complete, past the limit (the memory and file system have room), so a node killed
    during the write still holds one; at rest the limit holds (a review: kept past it, a worker was OOM-killed)."""
    where = str(tmp_path)
    snapshot.save(b"a" * 600, 1, where=where, max_bytes=1000)
    data = b"b" * 600
    for step in (2, 3):
        seen: list[list[str]] = []

        def writer(f, seen: list[list[str]] = seen) -> None:
            seen.append(sorted(os.listdir(where)))
            f.write(data)
        got = snapshot.save(writer if as_writer else data, step, where=where, max_bytes=1000)
        assert got == str(tmp_path / f"step-{step}") and sorted(os.listdir(where)) == [f"step-{step}"]
        assert seen == ([[f"step-{step - 1}", f"step-{step}.tmp"]] if as_writer else []), seen
    with pytest.raises(snapshot.MemoryDirFull):                # one that does not fit alone: the last one stays
        snapshot.save(b"c" * 1001, 4, where=where, max_bytes=1000)
    assert os.listdir(where) == ["step-3"]


def test_a_save_with_no_room_beside_the_last_snapshot_says_what_that_risks_once(tmp_path, monkeypatch,
                                                                                capsys) -> None:
    """A review: `save` fell back to dropping the last snapshot first and said nothing (protect said it)."""
    where = str(tmp_path)
    monkeypatch.setattr(snapshot, "_said", set())
    monkeypatch.setattr(snapshot.headroom, "room_beside", lambda where, new, freed: False)
    for step in (1, 2, 3):
        snapshot.save(b"a" * 600, step, where=where, max_bytes=1000)
    assert os.listdir(where) == ["step-3"]
    err = capsys.readouterr().err
    assert err.count("holds 1 snapshot(s) of 600 bytes, not keep=2, and there is no room beside it") == 1, err


def test_keep_one_keeps_the_last_snapshot_until_the_next_is_complete(tmp_path, monkeypatch) -> None:
    """keep=1 is one snapshot at rest: a write that fails (or a node killed during it) leaves the last one."""
    where = str(tmp_path)
    snapshot.save(b"a" * 10, 1, where=where, keep=1)

    def failing(f) -> None:
        f.write(b"half")
        raise RuntimeError("the writer failed")
    with pytest.raises(RuntimeError):
        snapshot.save(failing, 2, where=where, keep=1)
    assert os.listdir(where) == ["step-1"]
    snapshot.save(b"b" * 10, 3, where=where, keep=1)
    assert os.listdir(where) == ["step-3"]
    monkeypatch.setattr(snapshot.headroom, "room_beside", lambda where, new, freed: False)   # no room beside
    with pytest.raises(RuntimeError):
        snapshot.save(failing, 4, where=where, keep=1)
    assert os.listdir(where) == []


def test_a_snapshot_written_past_the_limit_raises_memory_dir_full_and_keeps_the_last_one(tmp_path) -> None:
    """A writer larger than the newest kept snapshot (which room was made for) is refused as it writes: the kept
    ones stay."""
    where = str(tmp_path)
    snapshot.save(b"a" * 300, 1, where=where, max_bytes=1000)
    data = b"b" * 800

    def writer(f) -> None:   # like torch.save: finishes its file even after a refused write
        try:
            f.write(data[:300])
            f.write(data[300:])
        finally:
            f.write(b"end")
    with pytest.raises(snapshot.MemoryDirFull) as caught:
        snapshot.save(writer, 2, where=where, max_bytes=1000)
    message = str(caught.value)
    assert "snapshot of step 2 does not fit the memory directory" in message
    assert "limit 1000 bytes" in message and "300 bytes kept in 1 older snapshot" in message
    assert "700 bytes left" in message
    assert os.listdir(where) == ["step-1"]


def test_a_full_file_system_under_a_writer_that_hides_the_error_is_memory_dir_full(tmp_path, monkeypatch) -> None:
    """A review: /dev/shm full (ENOSPC) under torch.save, whose zip writer re-raises a RuntimeError of its own: the
    worker died at every save instead of training on without the snapshot. Here the file is /dev/full."""
    where = str(tmp_path)
    real_open = open
    monkeypatch.setattr(snapshot, "open", lambda path, mode="r", *args: real_open(
        "/dev/full", mode.replace("x", "w"), *args) if str(path).endswith(".tmp") else real_open(path, mode, *args),
        raising=False)     # (a new file is made "x": /dev/full is there already)

    def writer(f) -> None:       # like torch's zip writer: its own error, the file system's as its context
        try:
            f.write(b"x" * 100_000)
            f.flush()
        except OSError as exc:
            raise RuntimeError("unexpected pos 704 vs 598") from exc
    with pytest.raises(snapshot.MemoryDirFull, match="found /dev/shm full"):
        snapshot.save(writer, 3, where=where)
    assert os.listdir(where) == []


def test_the_limit_comes_from_the_agents_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(snapshot.DIR_VAR, str(tmp_path))
    monkeypatch.setenv(snapshot.LIMIT_VAR, "100")
    with pytest.raises(snapshot.MemoryDirFull, match="limit 100 bytes"):
        snapshot.save(b"x" * 101, 1)
    assert snapshot.save(b"x" * 100, 1) == str(tmp_path / "step-1")


def reduce_of(rank: int, barrier: threading.Barrier, values: list[int], op=min):
    """A stand-in for all_reduce(op) among threads, one per rank: `rank`'s x in, `op` of every rank's out."""
    def reduce(x: int) -> int:
        values[rank] = x
        barrier.wait()
        out = op(values)
        barrier.wait()
        return out
    return reduce


def reduce_min_of(rank: int, barrier: threading.Barrier, values: list[int]):
    return reduce_of(rank, barrier, values)


def reduce_sum_of(rank: int, barrier: threading.Barrier, values: list[int]):
    return reduce_of(rank, barrier, values, sum)


def ranks_agree(held: list[list[int]], refused: dict[int, set[int]] | None = None):
    """(the results, a rank's body): agreed_step on every rank at once, each in a thread, with a
    `reduce_min` that sees all ranks' values (a stand-in for all_reduce)."""
    n = len(held)
    barrier = threading.Barrier(n)
    values: list[int] = [0] * n
    results: list[int | None] = [None] * n

    def run(rank: int, where: str) -> None:
        mine = (refused or {}).get(rank, set())
        results[rank] = snapshot.agreed_step(reduce_min_of(rank, barrier, values), where,
                                             accept=lambda step: step not in mine)
    return results, run


@pytest.mark.parametrize(("held", "agreed", "refused"), [
    ([[5, 10], [5, 10]], 10, {}), ([[5, 10], [5]], 5, {}), ([[10], [5]], None, {}), ([[5, 10], []], None, {}),
    ([[], []], None, {}),
    # a rank that refuses a step (a checksum, a shape) sends every rank to the next older one, or to none
    ([[5, 10], [5, 10]], 5, {1: {10}}), ([[5, 10], [5, 10]], None, {0: {5}, 1: {10}}),
    ([[3, 5, 10], [3, 5, 10]], 3, {0: {10}, 1: {5}}),
])
def test_all_ranks_agree_on_the_newest_step_every_rank_holds(tmp_path, held, agreed, refused) -> None:
    results, run = ranks_agree(held, refused)
    threads = []
    for rank, steps in enumerate(held):
        where = tmp_path / str(rank)
        where.mkdir()
        for step in steps:
            snapshot.save(b"s", step, where=str(where), keep=3)
        threads.append(threading.Thread(target=run, args=(rank, str(where))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [agreed] * len(held)
    # The steps past the one resumed from are a run the job abandoned: gone (every step, going back to disk).
    kept = [snapshot.steps(str(tmp_path / str(rank))) for rank in range(len(held))]
    assert kept == [[s for s in steps if agreed is not None and s <= agreed] for steps in held]


def test_agreed_step_removes_the_half_files_of_a_writer_that_died(tmp_path) -> None:
    snapshot.save(b"s", 5, where=str(tmp_path))
    (tmp_path / "step-10.tmp").write_bytes(b"half")
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    assert snapshot.agreed_step(lambda x: x, str(tmp_path)) == 5
    assert sorted(os.listdir(tmp_path)) == ["notes.tmp", "step-5"]


def test_the_agreed_step_is_told_to_the_workers_progress_probe(tmp_path, monkeypatch) -> None:
    told: list[int] = []
    monkeypatch.setitem(sys.modules, "node_agent_probe", types.SimpleNamespace(resumed=told.append))
    snapshot.save(b"s", 7, where=str(tmp_path))
    assert snapshot.agreed_step(lambda x: x, str(tmp_path)) == 7 and told == [7]
    assert snapshot.agreed_step(lambda x: -1, str(tmp_path)) is None and told == [7]   # no restore: nothing said


def test_agreed_step_waits_while_the_agent_fetches_this_ranks_copy(tmp_path, monkeypatch) -> None:
    mark = tmp_path / snapshot.FETCHING
    mark.write_text("")
    waits: list[float] = []

    def fetch_lands(seconds: float) -> None:     # the agent, while the worker waits: the copy in, the mark gone
        waits.append(seconds)
        snapshot.save(b"fetched", 25, where=str(tmp_path))
        mark.unlink()
    monkeypatch.setattr(snapshot.time, "sleep", fetch_lands)
    assert snapshot.agreed_step(lambda x: x, str(tmp_path)) == 25 and len(waits) == 1


def test_a_mark_left_behind_delays_agreed_step_only_so_long(tmp_path, monkeypatch) -> None:
    (tmp_path / snapshot.FETCHING).write_text("")
    monkeypatch.setattr(snapshot, "COPY_WAIT_S", 0.0)
    assert snapshot.agreed_step(lambda x: x, str(tmp_path)) is None


def test_forget_after_removes_only_the_newer_snapshots_of_every_rank(tmp_path) -> None:
    dirs = {}
    for local in (0, 1):
        where = tmp_path / str(local)
        where.mkdir()
        for step in (5, 10, 15):
            (where / f"step-{step}").write_bytes(b"x")
        dirs[local] = str(where)
    assert memory.forget_after(10, dirs) == [15]
    assert [sorted(os.listdir(d)) for d in dirs.values()] == [["step-10", "step-5"]] * 2
    assert memory.forget_after(10, dirs) == []


def replicas_agree(tmp_path, held: list[list[int]], refused: dict[int, set[int]] | None = None,
                   fetched: frozenset[int] = frozenset()):
    """(every rank's agreed step, their directories): agreed_step with `lend` on every rank at once, a thread each; a
    rank lacking the step is lent a holder's file (copied between the directories, as resume.lend_file sends it).
    `fetched`: the ranks whose newest snapshot the agent fetched from a peer's copy (marked as copies/client does)."""
    n = len(held)
    barrier = threading.Barrier(n)
    values: list[int] = [0] * n
    has: list[bool] = [False] * n
    results: list[int | None] = [None] * n
    dirs = [tmp_path / str(rank) for rank in range(n)]

    def run(rank: int) -> None:
        def lend(step: int, held_it: bool) -> bool:
            has[rank] = held_it
            barrier.wait()
            if not held_it:
                lender = dirs[has.index(True)]
                snapshot.save((lender / f"step-{step}").read_bytes(), step, where=str(dirs[rank]), keep=3)
            barrier.wait()
            return True
        results[rank] = snapshot.agreed_step(reduce_min_of(rank, barrier, values), str(dirs[rank]),
                                             accept=lambda step: step not in (refused or {}).get(rank, set()),
                                             lend=lend, reduce_sum=reduce_sum_of(rank, barrier, values))

    for rank, steps in enumerate(held):
        dirs[rank].mkdir()
        for step in steps:
            snapshot.save(b"s%d" % step, step, where=str(dirs[rank]), keep=3)
        if rank in fetched:
            snapshot.mark_fetched(str(dirs[rank]), steps[-1])
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results, dirs


@pytest.mark.parametrize(("held", "agreed"), [
    ([[5, 10], [5, 10], []], 10),      # a node that joined a growing job holds nothing: lent the others' newest
    ([[10], [5], [5]], 5),             # rank 0 alone ahead (one snapshot each, keep=1): lent 5, as the most hold
    ([[10], [10], [5]], 10),           # most ahead: rank 2 is lent their 10
    # a node back in an elastic job after the others trained on (or one whose writes failed): lent their newest
    # step all hold, not taking every rank back to its own
    ([[195, 200], [190, 195], [70, 75], [70, 75]], 195),
    ([[195, 200], [195, 200], [75]], 200),
    # the node taking a lost one's place with its lagging copy (5), which the others keep (KEEP_FROM): lent 55, not
    # every rank back to the copy's step (a review found DDP jobs resuming from it)
    ([[5, 50, 55], [5, 50, 55], [5]], 55),
    # one node's newer step, the others' older (a node that diverged at 150 and was held out, back): not followed
    ([[130, 140], [130, 140], [150]], 140),
    ([[], [], []], None),              # nobody holds anything: nothing to lend
])
def test_replicas_lend_the_step_they_agree_on_to_the_ranks_that_lack_it(tmp_path, held, agreed) -> None:
    """DDP: every rank's state a replica of every other's, so a rank that holds nothing or not the step is lent a
    holder's file and resumes with them."""
    results, dirs = replicas_agree(tmp_path, held)
    assert results == [agreed] * len(held)
    if agreed is not None:
        assert all((d / f"step-{agreed}").read_bytes() == b"s%d" % agreed for d in dirs)
        assert all(max(snapshot.steps(str(d))) == agreed for d in dirs)     # nothing newer than the step kept


@pytest.mark.parametrize(("held", "fetched", "agreed"), [
    ([[30, 55, 60], [30]], {1}, 60),           # a tie: the copy is behind the replica's own snapshots
    ([[30, 55, 60], [30, 55, 60], [30], [30]], {2, 3}, 60),
    ([[30, 55, 60], [30]], set(), 30),         # its own memory stopped at 30: a tie keeps the older step, as before
    ([[30], [30]], {1}, 30),                   # nobody newer: the copy's step is every rank's
])
def test_a_rank_resuming_a_fetched_copy_is_lent_the_replicas_newer_step(tmp_path, held, fetched, agreed) -> None:
    """A review: a 2-node DDP job whose node restarted with its memory wiped fetched its copy of step 30, lagging
    (copies slower than snapshots), while the other node held 60 (and 30, kept for the copy): a tie, and every rank
    went back 31 steps to the copy's step."""
    results, _ = replicas_agree(tmp_path, held, fetched=frozenset(fetched))
    assert results == [agreed] * len(held)


def test_a_snapshot_written_over_a_fetched_copy_is_the_ranks_own(tmp_path) -> None:
    where = str(tmp_path)
    snapshot.save(b"copy", 30, where=where)
    snapshot.mark_fetched(where, 30)
    assert fetched.is_copy(where, 30) and not fetched.is_copy(where, 25)
    snapshot.remove(os.path.join(where, "step-30"))
    snapshot.save(b"its own, longer", 30, where=where)
    assert not fetched.is_copy(where, 30)


@pytest.mark.parametrize(("held", "refused", "agreed"), [
    ([[100], [200]], {1: {200}}, 100),         # the newer step refused: the older one is every rank's again
    ([[100], [50, 200]], {1: {200}}, 100),
])
def test_a_rank_behind_a_refused_step_is_a_candidate_again(tmp_path, held, refused, agreed) -> None:
    """A review found that a rank marked behind stayed behind once the newer step was refused: its good snapshot went
    with every other (back to disk)."""
    results, _ = replicas_agree(tmp_path, held, refused)
    assert results == [agreed] * len(held)


def test_a_next_agent_shows_its_ended_predecessors_secret_never_a_live_agents(tmp_path) -> None:
    """The secret the server gave a node's agent, kept in the node's memory: its next agent reads it once that agent
    has ended (JoinRequest.predecessor), never while it lives (two agents given one node id)."""
    base = str(tmp_path)
    killed_agent(tmp_path, "job", "node-b")
    nxt = MemoryDirs("job", 2, 2**20, say=lambda _: None, base=base, node_id="node-b")
    assert left_credential(nxt) == "secret-of-node-b"
    nxt.dirs(2)                                    # now it owns the directory: live
    keep_credential(nxt, "its-own-secret")
    third = MemoryDirs("job", 2, 2**20, say=lambda _: None, base=base, node_id="node-b")
    assert left_credential(third) == ""
    nxt.close()
    assert left_credential(MemoryDirs("job", 1, 2**20, say=lambda _: None, base=base, node_id="node-c")) == ""


STOPPING_AGENT = """
import os, sys
from node_agent.training import fetched, snapshot
from node_agent.workers.memory import MemoryDirs
job, node, base = sys.argv[1:4]
dirs = MemoryDirs(job, 1, 2**20, say=lambda _: None, base=base, node_id=node)
snapshot.save(b"shard", 25, where=dirs.dirs_for(1, 0, "run-1")[0])
print("owned", flush=True)
sys.stdin.read()                 # its workers stopping: until the test lets it end
dirs.close(keep="stopped")
"""


def stopping_agent(tmp_path) -> subprocess.Popen[str]:
    """Node b's agent owning its memory (step 25 saved) until its stdin closes, as one stopping its workers."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.Popen([sys.executable, "-c", STOPPING_AGENT, "job", "node-b", str(tmp_path)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


async def test_a_next_agent_waits_for_its_stopping_predecessor_to_end_and_keeps_the_snapshots(tmp_path) -> None:
    """A review started the next agent while its predecessor, SIGTERMed, still stopped its workers: it made a
    directory of its own and fetched the node's copies, a snapshot behind. It waits for the predecessor to end."""
    import asyncio

    from node_agent.workers.succession import predecessor_gone
    old = stopping_agent(tmp_path)
    try:
        assert old.stdout.readline().strip() == "owned"
        waiting = asyncio.Event()
        said: list[str] = []

        def say(line: str) -> None:
            said.append(line)
            waiting.set()
        nxt = MemoryDirs("job", 1, 2**20, say=say, base=str(tmp_path), node_id="node-b")
        task = asyncio.ensure_future(predecessor_gone(nxt, 60.0))
        await asyncio.wait_for(waiting.wait(), 30)
        assert f"node node-b's previous agent (pid {old.pid}) still owns its memory" in said[0] and not task.done()
        old.stdin.close()                               # it ends (a zombie until reaped: ended all the same)
        await asyncio.wait_for(task, 30)
        assert snapshot.steps(nxt.dirs_for(1, 0, "run-1")[0]) == [25], said
        assert not any("another live agent" in line for line in said), said
        nxt.close()
    finally:
        old.kill()
        old.wait()


def test_a_snapshot_grown_past_the_limit_keeps_the_last_complete_one(tmp_path) -> None:
    """A review: the state grew (an optimizer's state made lazily) past the limit; the writer's refusal came after
    the last complete snapshot was dropped to try again, and the rank held none."""
    where = str(tmp_path)
    for step in (1, 2):
        snapshot.save(b"a" * 25_000, step, where=where, max_bytes=32_000)
    with pytest.raises(snapshot.MemoryDirFull):
        snapshot.save(lambda f: f.write(b"c" * 40_000), 3, where=where, max_bytes=32_000)
    assert os.listdir(where) == ["step-2"]
    with pytest.raises(snapshot.MemoryDirFull):          # bytes: known too large before anything goes
        snapshot.save(b"c" * 40_000, 3, where=where, max_bytes=32_000)
    assert os.listdir(where) == ["step-2"]


FILE_SIZE_LIMITED = """
import resource, sys
from node_agent.training import fetched, snapshot
where, kind = sys.argv[1], sys.argv[2]
snapshot.save(b"a" * 1000, 1, where=where)

def torch_like(f):                  # torch's zip writer turns the file's error into its own
    try:
        f.write(b"b" * 40_000)
        f.flush()
    except OSError as exc:
        raise RuntimeError("unexpected pos") from exc

resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:                                # (Python ignores SIGXFSZ: the writes fail with EFBIG)
    snapshot.save(b"b" * 40_000 if kind == "bytes" else torch_like, 2, where=where)
except snapshot.MemoryDirFull:
    print("MemoryDirFull")
"""


@pytest.mark.parametrize("writer_kind", ["bytes", "torch-like"])
def test_a_file_size_limit_is_memory_dir_full_and_keeps_the_last_snapshot(tmp_path, writer_kind) -> None:
    """A review: `ulimit -f` (EFBIG; EDQUOT likewise) raised OSError, or torch.save's RuntimeError, past a script's
    documented `except MemoryDirFull`: the worker died at the save. (In a process of its own: the limit is the
    whole process's.)"""
    done = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, str(tmp_path), writer_kind],
                          env=dict(os.environ, PYTHONPATH=os.getcwd()), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "MemoryDirFull", done.stderr
    assert os.listdir(tmp_path) == ["step-1"]


def test_a_limit_below_what_is_kept_is_said_as_such_not_as_negative_bytes(tmp_path) -> None:
    """A review: an agent restarted with a smaller --memory-dir-limit said "needs more than the -1576018 bytes
    left"."""
    where = str(tmp_path)
    for step in (1, 2):
        snapshot.save(b"a" * 1200, step, where=where)
    with pytest.raises(snapshot.MemoryDirFull) as caught:
        snapshot.save(b"b" * 1500, 3, where=where, max_bytes=1000)
    said = str(caught.value)
    assert "-" not in said.split("limit")[1] and "1200 bytes kept" in said and "finds it taken by those" in said
    assert snapshot.steps(where) == [1, 2]


def test_a_directory_of_its_own_takes_the_nodes_name_once_the_live_agent_before_it_has_ended(tmp_path) -> None:
    """A review: an agent whose predecessor outlived the wait (SIGSTOPped) kept a directory of its own for good;
    the agent after it swept it as a killed agent's and fetched the copies, a snapshot behind. Between rounds it
    now takes the node's own name once no live agent holds that."""
    said: list[str] = []
    first = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path), node_id="n")
    second = MemoryDirs("job", 1, 2**20, say=said.append, base=str(tmp_path), node_id="n")
    first.dirs_for(1, 0, "r")
    snapshot.save(b"x" * 10, 7, where=second.dirs_for(1, 0, "r")[0])
    succession.settle(second)                       # the first still lives: nothing moves
    assert second.root != second.home and os.path.isdir(first.home)
    first.close()                                   # it ends, as a replaced agent does
    succession.settle(second)
    assert second.root == second.home and snapshot.steps(second.dirs_for(1, 0, "r")[0]) == [7]
    with open(os.path.join(second.home, "identity")) as f:
        assert f.read().split("\n")[:2] == ["job", "n"]        # the sweep and the next agent know it as node n's
    assert owners.live_owner(second.home) == os.getpid() and "memory moved to" in said[-1], said
    second.close()
    assert not os.path.exists(second.home)


@pytest.mark.parametrize("off", [("--no-memory-dir",), ("--memory-dir-limit", "0")])
def test_memory_switched_off_over_the_snapshots_a_nodes_previous_agent_left_is_refused(tmp_path, monkeypatch,
                                                                                      capsys, off) -> None:
    """A review (an operator reconfiguring node by node): node b's agent stopped (its place and memory kept) and
    started again with --no-memory-dir. Its ranks had no memory directory, and one rank without one sends every rank
    of the job to its fallback: all 6 ranks from step 0, though b's snapshots lay in its directory and on a peer,
    said by no line of the agent's. The change is refused in one line naming the flag; nothing else is touched."""
    from node_agent.main import main
    monkeypatch.setattr(memory, "SHM", str(tmp_path))
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    home = os.path.join(memory.parent_dir(None), dir_name("reconf", "b"))
    for rank, steps in ((0, (15, 20)), (1, (20,))):
        os.makedirs(os.path.join(home, str(rank)))
        for step in steps:
            open(os.path.join(home, str(rank), f"step-{step}"), "wb").close()
    argv = ["--standalone", "--rdzv-id", "reconf", "--node-id", "b", "--nproc", "1", *off, str(script)]
    assert main(argv) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "--no-memory-dir" in said[0] and "(step 20)" in said[0] and home in said[0], said
    assert sorted(os.listdir(os.path.join(home, "0"))) == ["step-15", "step-20"]     # left as it was
    assert memory.left_behind("reconf", "c") is None and memory.left_behind("other", "b") is None
    shutil.rmtree(home)
    assert main(argv) == 0         # nothing left behind: switched off as asked



def test_the_secret_of_a_next_agent_that_ended_while_it_waited_is_the_one_its_successor_shows(tmp_path) -> None:
    """Two restarts in quick succession: the agent that waited for its predecessor (succession.predecessor_gone) and
    ended meanwhile held the node's record last; the agent after it shows its secret, not the older one, and never
    that of a waiting agent still alive."""
    killed_agent(tmp_path, "job", "node-b")         # kept "secret-of-node-b"
    home = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path), node_id="node-b").home
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    waiting = subprocess.Popen([sys.executable, "-c", "import sys; from node_agent.workers import succession; "
                                "succession._keep_waiting(sys.argv[1], 'secret-of-the-waiting-one'); print('kept', "
                                "flush=True); sys.stdin.read()", home], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert waiting.stdout is not None and waiting.stdout.readline().strip() == "kept"
        nxt = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path), node_id="node-b")
        assert left_credential(nxt) == "secret-of-node-b"             # the waiting one lives: not its
    finally:
        waiting.kill()
        waiting.wait(60)
    assert left_credential(nxt) == "secret-of-the-waiting-one"        # it ended: it held the record last
    nxt.dirs(1)
    keep_credential(nxt, "secret-of-the-next")                        # its own, once it runs: the newest
    assert not os.path.exists(os.path.join(home, succession.WAITING))
    nxt.close()


def test_a_waiting_secret_left_under_this_agents_pid_by_another_process_is_shown(tmp_path) -> None:
    """A container restarted (the agent pid 1 in its own pid namespace each time, the node's directory on a volume
    that outlives it): the agent killed as it waited left WAITING under the same pid as its successor's, another
    start time. That is an ended agent's secret, shown; only this process's own (pid and start time) is not."""
    killed_agent(tmp_path, "job", "node-b")         # kept "secret-of-node-b"
    nxt = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path), node_id="node-b")
    path = os.path.join(nxt.home, succession.WAITING)
    with open(path, "w") as f:
        f.write(f"{os.getpid()} 1\nsecret-of-the-killed-waiting-one")     # this pid, started at another time
    assert left_credential(nxt) == "secret-of-the-killed-waiting-one"
    with open(path, "w") as f:
        f.write(f"{os.getpid()} {owners.start_time(os.getpid())}\nsecret-of-this-agent")    # its own: never
    assert left_credential(nxt) == "secret-of-node-b"
