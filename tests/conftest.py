import glob
import os
import shutil
import sys
import tempfile

import hypothesis
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# One OpenMP thread per process unless set: the suite runs several multi-process torch jobs (and in-process torch)
# at once on a few cores, and a process alone on its "node" gets an OpenMP team as wide as the machine (as under
# torchrun), whose threads spin while the others want the cores: a 3-node HF Trainer test took 120 s, 30 s with
# one thread each. Tests of the launchers' own rule for it unset it (tests/e2e/harness.py child_env). Set before
# any test module imports torch, which reads it as it loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's workers bind port 0 by the thousand (gloo's listeners, clients), and the kernel may hand a round's
# store port, offered a moment before the store binds it, to one of them: an extra restart a test counts (CI had
# one). Rounds take their store ports from a range of their own (node_agent/client/ports.py), below the ephemeral
# range and apart from tests/ports.py's servers. tests/unit/test_ports.py covers the default, the kernel's pick.
os.environ.setdefault("NODE_AGENT_STORE_PORTS", "10000-19999")

# Hypothesis fails an example that runs past 200 ms as "unreliable timing": on a loaded machine a preemption or
# a worker's full GC does that, and no property here is about time.
hypothesis.settings.register_profile("suite", deadline=None)
hypothesis.settings.load_profile("suite")

# What an agent (without --log-dir) or torchrun makes in the temp dir for a run: it must not outlive it.
RUN_DIRS = ("node-agent_*", "torchelastic_*")


def leftovers(directory: str) -> list[str]:
    return sorted(os.path.basename(p) for pattern in RUN_DIRS for p in glob.glob(os.path.join(directory, pattern)))


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory):
    """The session's own temp dir (each xdist worker its own), for this process and every process it
    starts: at the end, any agent or torchrun run directory left in it fails the run. A test whose
    processes may be killed before they can clean up (SIGKILL) points their TMPDIR at its tmp_path;
    other people's processes on the machine never see this directory, nor does it see theirs."""
    tmp_path_factory.getbasetemp()       # pytest's own directories stay where they were
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    root = tempfile.mkdtemp(prefix="rdzv-tests-")
    os.environ["TMPDIR"] = root
    tempfile.tempdir = root
    try:
        yield root
    finally:
        left = leftovers(root)
        os.environ.pop("TMPDIR", None) if saved[0] is None else os.environ.update(TMPDIR=saved[0])
        tempfile.tempdir = saved[1]
        shutil.rmtree(root, ignore_errors=True)
        assert not left, (f"the tests left {len(left)} run director{'y' if len(left) == 1 else 'ies'} in the temp "
                          f"dir: {left[:20]} (an agent or torchrun that could not clean up: point its TMPDIR at the "
                          f"test's tmp_path, or find why it kept them)")
