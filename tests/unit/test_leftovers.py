"""The multiprocessing directories a stopped group's processes held (node_agent/workers/leftovers.py),
read from the real /proc of real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from node_agent.workers import leftovers

LISTENER = ("import multiprocessing.connection as c, sys, time\n"
            "l = c.Listener(family='AF_UNIX')\n"
            "print(l.address, flush=True)\n"
            "time.sleep(60)\n")


def test_the_directories_a_group_holds_a_socket_in_and_only_those(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    ours = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    try:
        assert ours.stdout is not None and other.stdout is not None
        address, other_address = ours.stdout.readline().strip(), other.stdout.readline().strip()
        held = os.path.dirname(address)
        assert os.path.basename(held).startswith("pymp-") and os.path.dirname(held) == str(tmp_path)
        assert leftovers.held_temp_dirs({ours.pid}) == {held}
        assert leftovers.held_temp_dirs({ours.pid, other.pid}) == {held, os.path.dirname(other_address)}
        assert leftovers.held_temp_dirs({os.getpgrp()}) == set()        # not ours: nothing
        assert leftovers.held_temp_dirs(set()) == set()

        os.killpg(ours.pid, signal.SIGKILL)          # a killed process removes nothing ...
        ours.wait(10)
        assert os.path.isdir(held)
        leftovers.remove({held})                      # ... the agent does
        assert not os.path.exists(held) and os.path.isdir(os.path.dirname(other_address))
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait(10)


def test_a_proc_tree_without_such_sockets_is_read_once_and_gives_nothing(tmp_path):
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "unix").write_text("Num RefCount Protocol Flags Type St Inode Path\n"
                                           "0: 00000002 00000000 00010000 0001 01 1234 /run/other.sock\n")
    assert leftovers.held_temp_dirs({1}, proc=str(tmp_path)) == set()
    assert leftovers.held_temp_dirs({1}, proc=str(tmp_path / "missing")) == set()
