"""Who owns an agent's directories in shared memory (node_agent/workers/owners.py): a killed agent's are told from
a live one's by the lock its owner file held, an older agent's by the pid in their name."""
from __future__ import annotations

import os
import subprocess
import sys

from node_agent.workers import owners

CLAIM_AND_DIE = "import os, sys; from node_agent.workers import owners; owners.claim(sys.argv[1]); os._exit(9)"


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_a_claim_holds_while_its_agent_lives_and_passes_on_once_it_is_killed(tmp_path) -> None:
    where = tmp_path / "node"
    where.mkdir()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    assert subprocess.run([sys.executable, "-c", CLAIM_AND_DIE, str(where)], env=env, timeout=60).returncode == 9
    mine = owners.claim(str(where))
    assert mine is not None and mine.previous is not None and mine.previous != os.getpid()
    assert owners.claim(str(where)) is None and owners.owner_gone(str(where)) is None    # held: by this process
    mine.release()
    again = owners.claim(str(where))
    assert again is not None and again.previous is None          # our own pid: no predecessor of ours
    again.release()


def test_the_sweep_removes_killed_agents_directories_only(tmp_path) -> None:
    prefix = "node-agent-progress."
    killed = tmp_path / f"{prefix}1.abc"
    killed.mkdir()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", CLAIM_AND_DIE, str(killed)], env=env, timeout=60)
    (tmp_path / f"{prefix}{dead_pid()}.old").mkdir()          # an older agent's: no owner file, its pid gone
    (tmp_path / f"{prefix}{os.getpid()}.making").mkdir()       # being made by a live agent
    live = tmp_path / f"{prefix}{os.getpid()}.live"
    live.mkdir()
    held = owners.claim(str(live))
    (tmp_path / "something-else.1").mkdir()
    assert owners.sweep(str(tmp_path), prefix) == 2
    assert sorted(os.listdir(tmp_path)) == [f"{prefix}{os.getpid()}.live", f"{prefix}{os.getpid()}.making",
                                            "something-else.1"]
    assert held is not None
    held.release()


def test_a_claim_waits_out_another_agents_sweep_of_a_killed_agents_directory(tmp_path) -> None:
    """A review: a killed node's next agent started while another agent swept (owner_gone held the killed agent's
    lock for a moment): the claim failed as if a live agent owned it, and the node's snapshots were left behind."""
    where = tmp_path / "node"
    where.mkdir()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    assert subprocess.run([sys.executable, "-c", CLAIM_AND_DIE, str(where)], env=env, timeout=60).returncode == 9
    sweeping = owners.owner_gone(str(where))        # another agent's sweep looks at it
    assert sweeping is not None
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        sweeping.release()                          # its look ends (kept: written lately)

    mine = owners.claim(str(where), pause=pause)
    assert mine is not None and mine.previous is not None and mine.previous != os.getpid()
    assert len(pauses) == 1
    mine.release()


def test_a_claim_waits_for_a_sweep_a_bounded_time_only(tmp_path) -> None:
    where = tmp_path / "node"
    where.mkdir()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", CLAIM_AND_DIE, str(where)], env=env, timeout=60)
    stuck = owners.owner_gone(str(where))
    assert stuck is not None
    pauses: list[float] = []
    assert owners.claim(str(where), pause=pauses.append) is None
    assert 0 < sum(pauses) <= owners.SWEEP_WAIT_S + owners.SWEEP_PAUSE_S
    stuck.release()
