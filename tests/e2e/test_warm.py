"""Warm workers end to end: a real agent, its zygote, real workers (torch where it is the point)."""
from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.e2e.harness import ROOT, SCRIPTS, pid_gone

pytestmark = pytest.mark.e2e
PROBE = os.path.join(SCRIPTS, "warm_probe.py")
FIRST = os.path.join(SCRIPTS, "warm_first_probe.py")
TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")


def test_warm_workers_die_with_a_sigkilled_agent(cluster):
    agent = cluster.agent("--standalone", "--nproc", "1", "--max-restarts", "20", "--warm-preload", "json", PROBE)
    found = agent.wait_for_line(r"warm worker pid (\d+) parent (\d+)")
    worker, zygote = int(found.group(1)), int(found.group(2))
    assert psutil.Process(zygote).ppid() == agent.pid          # the zygote is the agent's child
    agent.wait_for_line("1 of 1 workers started warm")         # said by the agent, maybe after the worker's line
    os.kill(agent.pid, signal.SIGKILL)
    assert pid_gone(zygote, 30), "the zygote outlived its agent"
    assert pid_gone(worker, 30), "a warm worker outlived its agent"


def test_the_first_round_waits_for_the_zygote_when_the_script_imports_what_it_preloads(cluster):
    agent = cluster.agent("--standalone", "--nproc", "2", "--max-restarts", "0", "--warm-preload", "json", FIRST)
    assert agent.wait() == 0, agent.output          # no restart to spare: the first round itself is warm
    assert "2 of 2 workers started warm" in agent.output


def test_a_signal_while_the_first_round_waits_for_the_zygote_ends_the_agent_at_once(cluster, tmp_path):
    """The wait for a zygote still importing runs beside the agent's loop: a SIGTERM is not held up by it."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    (tmp_path / "gated.py").write_text(f"with open({str(gate)!r}) as f:\n    f.read()\n")   # blocks: no writer
    ran = tmp_path / "ran"
    (tmp_path / "train.py").write_text(f"import gated\nopen({str(ran)!r}, 'w').close()\n")
    agent = cluster.agent("--standalone", "--nproc", "1", "--warm-preload", "gated", str(tmp_path / "train.py"))
    agent.wait_for_line("preparing: the warm interpreter imports")     # no round takes it before it is ready
    zygotes = [p for p in psutil.Process(agent.pid).children()
               if any(arg.endswith("zygote.py") for arg in p.cmdline())]
    assert len(zygotes) == 1, agent.output
    agent.popen.send_signal(signal.SIGTERM)
    assert agent.wait(30) != 0, agent.output        # not after the agent's 60 s wait for the zygote
    assert pid_gone(zygotes[0].pid, 30), "the zygote outlived its agent"
    assert not ran.exists(), "a worker ran although the agent was stopped before any started"


def test_warm_workers_off_starts_every_worker_cold(cluster, tmp_path):
    agent = cluster.agent("--standalone", "--nproc", "1", "--max-restarts", "1", "--warm-workers", "off", PROBE)
    assert agent.wait() != 0, agent.output          # never warm: it fails every attempt
    assert "started warm" not in agent.output


def test_real_ddp_training_recovers_from_a_crash_on_warm_workers(cluster):
    pytest.importorskip("torch")
    agent = cluster.agent("--standalone", "--nproc", "2", "--max-restarts", "1", TRAIN, "--crash-rank", "1")
    assert agent.wait(300) == 0, agent.output
    out = agent.output
    assert "injected crash on rank 1" in out and "training done: 20 steps on 2 workers" in out
    # both rounds forked from the zygote: the first waited for it (the script imports torch)
    assert out.count("2 of 2 workers started warm") == 2, out


def test_every_warm_worker_draws_its_own_random_numbers_as_a_cold_one_does(cluster, tmp_path):
    """A cold interpreter seeds torch's and numpy's generators from the OS: so does a warm worker (forked from one
    interpreter, every rank drew the same torch numbers, and every restart the same again)."""
    pytest.importorskip("torch")
    script = tmp_path / "seeds.py"
    script.write_text("import os, random, sys, numpy, torch\n"
                      "print('SEEDS', os.environ['RANK'], os.environ['TORCHELASTIC_RESTART_COUNT'], "
                      "torch.initial_seed(), float(torch.rand(1)), float(numpy.random.rand()), random.random(), "
                      "flush=True)\n"
                      "sys.exit(1 if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' "
                      "else 0)\n")
    agent = cluster.agent("--standalone", "--nproc", "2", "--max-restarts", "1", str(script))
    assert agent.wait(120) == 0, agent.output
    assert agent.output.count("2 of 2 workers started warm") == 2, agent.output
    drawn = [line.split()[1:] for line in agent.output.splitlines() if line.startswith("SEEDS")]
    assert sorted((rank, attempt) for rank, attempt, *_ in drawn) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    for k in range(2, 6):       # torch's seed, a torch draw, numpy's, random's: each its own on every rank and try
        assert len({d[k] for d in drawn}) == 4, drawn


def test_a_script_that_sets_omp_num_threads_before_importing_torch_gets_it_as_under_torchrun(cluster, tmp_path):
    """torch reads OMP_NUM_THREADS as it loads: a warm interpreter loaded it before the script set it, so such a
    script's workers start cold, said once, and the setting takes."""
    pytest.importorskip("torch")
    script = tmp_path / "threads.py"
    script.write_text("import os\nos.environ['OMP_NUM_THREADS'] = '2'\nimport torch\n"
                      "print('THREADS', torch.get_num_threads(), flush=True)\n")
    agent = cluster.agent("--standalone", "--nproc", "1", str(script), env={"OMP_NUM_THREADS": "1"})
    assert agent.wait(120) == 0, agent.output
    assert "THREADS 2" in agent.output, agent.output
    assert "warm workers off: the script changes OMP_NUM_THREADS in its environment before it imports torch" \
        in agent.output and "started warm" not in agent.output


def test_a_generator_a_preloaded_package_seeds_as_it_loads_stays_seeded_as_in_a_cold_worker(cluster, tmp_path):
    """A package that seeds torch when imported (preloaded: the script imports it at its top): a cold worker's
    import seeds every rank alike, and so does the zygote's; the fork does not undo it."""
    pytest.importorskip("torch")
    lib, job = tmp_path / "lib", tmp_path / "job"
    lib.mkdir()
    job.mkdir()
    (lib / "seedlib.py").write_text("import torch\ntorch.manual_seed(0)\n")
    (job / "draw.py").write_text("import os\nimport seedlib\nimport torch\n"
                                 "print('DRAWN', os.environ['RANK'], float(torch.rand(1)), flush=True)\n")
    agent = cluster.agent("--standalone", "--nproc", "2", str(job / "draw.py"),
                          env={"PYTHONPATH": f"{lib}{os.pathsep}{ROOT}"})
    assert agent.wait(120) == 0, agent.output
    assert "2 of 2 workers started warm" in agent.output, agent.output
    drawn = {line.split()[1]: line.split()[2] for line in agent.output.splitlines() if line.startswith("DRAWN")}
    assert sorted(drawn) == ["0", "1"] and drawn["0"] == drawn["1"], drawn
