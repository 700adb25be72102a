"""What a stalled rank is doing, from /proc looks and faulthandler dumps (node_agent/core/stalls.py), and the
agent's side of the records: garbage in a record is ignored with one warning."""
from __future__ import annotations

import os
import struct

import pytest

from node_agent.core.stalls import Frame, ProcSample, call_of, classify, main_stack, parse_dump
from node_agent.core.steps import ProbeRecord, RoundSteps, next_report_at, report_period
from node_agent.training import probe
from node_agent.workers.probes import BadRecord, ProbeFiles, RecordReader
from node_agent.workers.step_watch import StepWatch
from protocol.notes import PACE_MAX_WINDOW_S, PACE_MIN_STEPS
from protocol.stalls import RankState

DUMP = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 623 in backward
  File "/job/train.py", line 28 in <module>
"""
WAITING = [Frame("/venv/lib/python3.11/site-packages/torch/_tensor.py", 623, "backward"),
           Frame("/job/train.py", 28, "<module>")]
SLEEPING = [Frame("/job/train.py", 16, "<module>")]
IN_TORCH = [Frame("/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward"),
            Frame("/job/train.py", 40, "evaluate")]
# Idle in its own Lightning step (a sleep, a blocking call to a service): Lightning calls it inside DDP's forward
IN_STEP = [Frame("/job/train.py", 23, "validation_step"),
           Frame("/venv/lib/python3.11/site-packages/lightning/pytorch/strategies/strategy.py", 634, "wrapped_forward"),
           Frame("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 1789, "_call_impl"),
           Frame("/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", 1715, "_run_ddp_forward"),
           Frame("/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", 1890, "forward"),
           Frame("/venv/lib/python3.11/site-packages/lightning/pytorch/loops/evaluation_loop.py", 420, "_step")]
IN_DDP_FORWARD = [Frame("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 2800, "broadcast"),
                  Frame("/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", 1600, "_pre_forward"),
                  Frame("/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", 1890, "forward"),
                  Frame("/job/train.py", 30, "<module>")]
IN_THREADING = [Frame("/usr/lib/python3.11/threading.py", 327, "wait"),
                Frame("/venv/lib/python3.11/site-packages/torch/distributed/elastic/x.py", 10, "wait_all"),
                Frame("/job/train.py", 31, "<module>")]
LOADING = [Frame("/usr/lib/python3.11/queue.py", 180, "get"),
           Frame("/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", 1133, "_try_get_data"),
           Frame("/job/train.py", 22, "<module>")]


def look(state: str = "S", cpu_s: float = 0.0, io_bytes: int = 0, run_delay_s: float = 0.0) -> ProcSample:
    return ProcSample(state=state, cpu_s=cpu_s, run_delay_s=run_delay_s, io_bytes=io_bytes)


def test_the_dump_is_read_thread_by_thread_and_the_main_one_picked() -> None:
    threads = parse_dump(DUMP + "  <no Python frame>\ngarbage line\n")
    assert list(threads) == [0x7f0000000001, 0x7f0000000002]
    main = main_stack(DUMP, 0x7f0000000002)
    assert main is not None and [f.function for f in main] == ["_engine_run_backward", "backward", "<module>"]
    assert main_stack(DUMP, 12345) == threads[0x7f0000000001]        # the main thread missing: the first
    assert main_stack("not a dump", 1) is None


@pytest.mark.parametrize(("before", "after", "stacks", "state"), [
    (look(), None, [], RankState.EXITED),
    (look(), look("Z"), [], RankState.EXITED),
    (look(), look("T"), [], RankState.STOPPED),
    (None, look("T"), [], RankState.STOPPED),
    (look(cpu_s=2.0), look("t", cpu_s=2.0), [], RankState.STOPPED),
    # stopped now, but it ran since the last look: throttled by SIGSTOP/SIGCONT (cpulimit), not stopped for good
    (look(cpu_s=2.0), look("T", cpu_s=2.1), [], RankState.WORKING),
    (look(cpu_s=2.0), look("T", cpu_s=2.05), [], RankState.UNKNOWN),
    (look(cpu_s=0), look("R", cpu_s=1.0), [SLEEPING, SLEEPING], RankState.SPINNING),
    (look(cpu_s=0), look("R", cpu_s=1.0), [SLEEPING, [Frame("/job/train.py", 30, "evaluate"), *SLEEPING]],
     RankState.WORKING),                                                          # its code moves on
    (look(cpu_s=0, io_bytes=0), look("R", cpu_s=1.0, io_bytes=50 << 20), [SLEEPING, SLEEPING], RankState.WORKING),
    (look(cpu_s=0), look("R", cpu_s=1.0), [IN_TORCH, IN_TORCH], RankState.WORKING),   # an eval loop
    (look(), look(cpu_s=0.01), [WAITING, WAITING], RankState.WAITING),
    (look(), look(cpu_s=0.01), [SLEEPING, SLEEPING], RankState.QUIET),
    (look(), look(cpu_s=0.01), [IN_STEP, IN_STEP], RankState.QUIET),       # torch's frames are only its callers
    (look(), look(cpu_s=0.01), [IN_DDP_FORWARD, IN_DDP_FORWARD], RankState.WAITING),
    (look(), look(cpu_s=0.01), [IN_THREADING, IN_THREADING], RankState.WAITING),   # torch's wait in Python's code
    (look(), look("D", cpu_s=0.01), [SLEEPING], RankState.WORKING),                  # in uninterruptible I/O
    (look(), look(cpu_s=0.01, io_bytes=4 << 20), [SLEEPING], RankState.WORKING),     # moving data slowly
    (look(), look(cpu_s=0.01), [LOADING], RankState.WORKING),                        # waiting for its DataLoader
    (look(), look(cpu_s=0.01), [], RankState.UNKNOWN),
    (look(), look("R", cpu_s=1.0), [], RankState.WORKING),
])
def test_each_state_from_what_the_agent_sees(before, after, stacks, state) -> None:
    assert classify(before, after, 1.0, stacks)[0] == state


TORCH = "/venv/lib/python3.11/site-packages/torch"
BARRIER = [Frame(f"{TORCH}/distributed/distributed_c10d.py", 4881, "barrier"),
           Frame(f"{TORCH}/distributed/c10d_logger.py", 81, "wrapper"), Frame("/job/train.py", 50, "main")]
RECV = [Frame(f"{TORCH}/distributed/distributed_c10d.py", 2600, "recv"),
        Frame(f"{TORCH}/distributed/c10d_logger.py", 81, "wrapper"), Frame("/job/train.py", 52, "main")]
CUDA_WAIT = [Frame(f"{TORCH}/cuda/__init__.py", 1040, "synchronize"), Frame("/job/train.py", 60, "evaluate")]


def test_a_waiting_rank_names_the_call_it_waits_in_past_torchs_wrappers() -> None:
    assert [call_of(s) for s in (BARRIER, RECV, WAITING, CUDA_WAIT, SLEEPING)] == \
        ["barrier", "recv", "backward", "cuda synchronize", ""]


@pytest.mark.parametrize(("stack", "gpu_busy", "state"), [
    (CUDA_WAIT, 95, RankState.WORKING),       # its GPU computes: an evaluation on the GPU, not a wait on the others
    (CUDA_WAIT, 3, RankState.WAITING),        # its GPU idle: it waits on something that will not come
    (CUDA_WAIT, None, RankState.WAITING),     # no GPU reading: as before
    (BARRIER, 95, RankState.WAITING),         # in torch.distributed it waits on the others whatever its GPU does
])
def test_a_cuda_wait_on_a_busy_gpu_is_computing(stack, gpu_busy, state) -> None:
    assert classify(look(), look(cpu_s=0.01), 1.0, [stack, stack], gpu_busy)[0] == state


def test_a_rank_between_phases_is_neither_a_culprit_nor_waiting() -> None:
    checkpoint_then_compute = [[Frame("/job/train.py", 69, "checkpoint")], [Frame("/job/train.py", 45, "compute")]]
    assert classify(look(), look(cpu_s=0.01), 1.0, checkpoint_then_compute)[0] == RankState.WORKING
    assert classify(look(), look(cpu_s=0.01), 1.0, [SLEEPING, WAITING])[0] == RankState.WORKING   # entering
    assert classify(look(), look(cpu_s=0.01), 1.0, [SLEEPING, SLEEPING])[0] == RankState.QUIET
    assert classify(look(), look(cpu_s=0.01), 1.0, [WAITING, WAITING])[0] == RankState.WAITING


def test_a_loop_spins_whichever_of_its_lines_each_dump_caught() -> None:
    loop = [[Frame("/job/train.py", line, "<module>")] for line in (101, 102, 101)]
    assert classify(look(), look("R", cpu_s=1.0), 1.0, loop)[0] == RankState.SPINNING
    moved_on = [[Frame("/job/train.py", 101, "<module>")], [Frame("/job/train.py", 45, "compute"),
                                                             Frame("/job/train.py", 110, "<module>")]]
    assert classify(look(), look("R", cpu_s=1.0), 1.0, moved_on)[0] == RankState.WORKING


def test_a_loop_that_waits_for_a_cpu_on_a_crowded_node_still_spins() -> None:
    spin = [[Frame("/job/train.py", 98, "<module>")]] * 2
    state, cpu = classify(look(), look("R", cpu_s=0.35, run_delay_s=0.5), 1.0, spin)
    assert (state, cpu) == (RankState.SPINNING, 0.35)


def record(steps: int, last: float) -> ProbeRecord:
    return ProbeRecord(steps=steps, first_at=100.0, last_at=last, pid=1, flags=0, main_thread=1)


def test_a_rank_is_stalled_past_the_floor_or_three_median_steps_once_it_stepped() -> None:
    r = RoundSteps(7)
    r.observe(0, record(0, 0.0), look(), 0.0)              # not stepped yet: never stalled
    r.observe(1, record(1, 100.0), look(), 0.0)
    for i in range(2, 12):
        r.observe(1, record(i, 100.0 + 2.0 * (i - 1)), look(), float(i))
    assert r.step_s() == 2.0 and r.threshold_s() == 6.0
    assert r.stalled(120.0 + 5.9) == [] and r.stalled(120.0 + 6.0) == [1]
    r.exited(1, 0)
    assert r.stalled(200.0) == []                          # a rank that ended is not stalled
    assert RoundSteps(1).threshold_s() == 5.0           # the floor


def test_a_pause_between_looks_is_no_step_time() -> None:
    """Looks every 0.5 s; 20 steps of 20 ms, a 60 s evaluation, then 20 steps of 20 ms all seen by the first look
    after it: the median step stays 20 ms and the threshold its floor (taking the look's whole span, 3 s a step,
    tripled the threshold to 9 s, and a stall of the next evaluation was shown a report later)."""
    r = RoundSteps(1)
    r.observe(0, record(1, 100.0), look(), 0.0, 100.0)
    r.observe(0, record(20, 100.38), look(), 0.5, 100.5)
    for i in range(1, 121):                               # the evaluation: no step
        r.observe(0, record(20, 100.38), look(), 0.5 + i * 0.5, 100.5 + i * 0.5)
    r.observe(0, record(40, 160.9), look(), 61.0, 161.0)   # resumed at 160.5, after the look at 160.5
    assert r.step_s() == pytest.approx(0.02, rel=0.05) and r.threshold_s() == 5.0


def test_the_note_sums_up_the_round_and_the_window(tmp_path) -> None:
    r = RoundSteps(3)
    r.observe(0, record(1, 100.0), ProcSample("R", 0.0, 0.0, 0), 10.0)
    r.observe(0, record(5, 104.0), ProcSample("R", 1.5, 0.5, 0), 14.0)
    note = r.note(14.0)
    assert (note.round_id, note.probes, note.steps, note.first_step_at, note.last_step_at) == (3, 1, 5, 100.0, 104.0)
    assert (note.step_s, note.window_s, note.window_steps, note.demand) == (1.0, 4.0, 5, 0.5)
    r.observe(0, record(7, 106.0), ProcSample("R", 2.5, 0.5, 0), 16.0)
    open_window = r.note(16.0)                             # 2 steps: too few to say anything of pace
    assert (open_window.steps, open_window.window_s, open_window.window_steps, open_window.demand) == (7, 0.0, 0, 0.0)
    r.observe(0, record(10, 109.0), ProcSample("R", 3.5, 1.5, 0), 19.0)
    closed = r.note(19.0)                                  # the window since the last closed one: 5 steps in 5 s
    assert (closed.window_s, closed.window_steps, closed.demand) == (5.0, PACE_MIN_STEPS, 0.6)
    assert r.note(14.0 + 5.0 + PACE_MAX_WINDOW_S).window_s == PACE_MAX_WINDOW_S   # stopped: closed after a while


def write_garbage(path: str, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(data)


@pytest.mark.parametrize("garbage", [
    b"\xff" * 64,                                                                  # not our magic
    struct.pack("<IIQQdd", probe.MAGIC, probe.VERSION, 0, 3, float("nan"), 1.0),  # a time that is not one
    struct.pack("<IIQQdd", probe.MAGIC, probe.VERSION, 0, 3, 5.0, 4.0),           # last before first
])
def test_garbage_in_a_record_is_ignored_with_one_warning(tmp_path, garbage) -> None:
    files = ProbeFiles.in_dir(str(tmp_path), 0)
    files.create()
    write_garbage(files.record, garbage)
    with pytest.raises(BadRecord):
        RecordReader(files.record).read(None, 1e9)
    warnings: list[str] = []
    watch = StepWatch(1, {0: (4, files)}, detect=True, pid_of=lambda lr: os.getpid(), exit_of=lambda lr: None,
                          warn=warnings.append)
    for _ in range(3):
        watch.look()
    assert len(warnings) == 1 and warnings[0].startswith("rank 4 (local 0): its progress record is not one")
    assert watch.note().steps == 0 and watch.round.stalled(1e9) == []
    watch.close()


def test_a_record_written_by_another_process_is_not_the_workers(tmp_path) -> None:
    files = ProbeFiles.in_dir(str(tmp_path), 0)
    files.create()
    write_garbage(files.record, probe.RECORD.pack(probe.MAGIC, probe.VERSION, 2, 3, 10.0, 11.0, 999999, 0, 1, -1))
    reader = RecordReader(files.record)
    with pytest.raises(BadRecord, match="pid 999999"):
        reader.read(os.getpid(), 1e9)
    assert reader.read(None, 1e9) == ProbeRecord(steps=3, first_at=10.0, last_at=11.0, pid=999999, flags=0,
                                                 main_thread=1, resumed_step=-1)
    reader.close()


def test_stall_reports_are_sent_again_on_wall_clock_ticks_every_node_shares() -> None:
    assert [report_period(t) for t in (0.5, 5.0, 5.2, 12.0, 40.0)] == [5.0, 5.0, 10.0, 20.0, 40.0]
    assert next_report_at(1003.0, 5.0) == 1010.0       # at least half a period away: not 1005
    assert next_report_at(1001.0, 5.0) == 1005.0
    # two nodes of one job, first reports 1.7 s apart, thresholds 5 and 5.2 s: their next reports share a tick
    a, b = next_report_at(1001.2, 5.0), next_report_at(1002.9, 5.2)
    assert (a, b) == (1005.0, 1010.0) and next_report_at(a, 5.0) == b


def paced(steps: int, pace: tuple[int, float, float], measured: bool = True) -> ProbeRecord:
    return ProbeRecord(steps=steps, first_at=100.0, last_at=100.0 + steps, pid=1, flags=0, main_thread=1,
                       pace=pace, waits_measured=measured)


def test_the_note_says_the_share_of_its_counted_steps_the_ranks_waited() -> None:
    r = RoundSteps(3)
    r.observe(0, paced(1, (0, 0.0, 0.0)), look(), 10.0)
    r.observe(1, paced(1, (0, 0.0, 0.0)), look(), 10.0)
    r.observe(0, paced(6, (5, 5.0, 1.0)), look(), 15.0)    # 1 s of 5 waited
    r.observe(1, paced(6, (5, 5.0, 2.0)), look(), 15.0)    # 2 s of 5
    assert r.note(15.0).waited == 0.3                      # (1 + 2) / (5 + 5)
    r.observe(0, paced(12, (6, 6.0, 1.0)), look(), 21.0)   # 6 steps, one counted (the rest left out: no pace)
    r.observe(1, paced(12, (6, 6.0, 2.0)), look(), 21.0)
    assert r.note(21.0).waited == -1.0                     # too few counted
    unmeasured = RoundSteps(4)                             # no wait ever timed (a beat() loop): not measured
    unmeasured.observe(0, paced(1, (0, 0.0, 0.0), measured=False), look(), 10.0)
    unmeasured.observe(0, paced(9, (8, 8.0, 0.0), measured=False), look(), 18.0)
    assert unmeasured.note(18.0).waited == -1.0


@pytest.mark.parametrize("pace", [(3, 1.0, 2.0), (3, float("nan"), 0.0), (0, 5.0, 0.0)],
                         ids=["waited-longer-than-it-took", "not-a-time", "time-without-steps"])
def test_a_pace_that_is_not_one_is_no_pace(tmp_path, pace) -> None:
    files = ProbeFiles.in_dir(str(tmp_path), 0)
    files.create()
    write_garbage(files.record, probe.RECORD.pack(probe.MAGIC, probe.VERSION, 2, 3, 10.0, 11.0, 7, probe.SYNCED, 1, -1))
    with open(files.record, "r+b") as f:
        f.seek(probe.PACE_AT)
        f.write(probe.PACE.pack(*pace))
    reader = RecordReader(files.record)
    record = reader.read(None, 1e9)
    reader.close()
    assert record is not None and record.steps == 3 and record.waits_measured and record.pace == (0, 0.0, 0.0)


def test_the_snapshot_a_rank_holds_after_is_read_and_is_news_for_a_note(tmp_path) -> None:
    files = ProbeFiles.in_dir(str(tmp_path), 0)
    files.create()
    write_garbage(files.record, probe.RECORD.pack(probe.MAGIC, probe.VERSION, 2, 3, 10.0, 11.0, 7, 0, 1, -1))
    reader = RecordReader(files.record)
    assert reader.read(None, 1e9).held_step == -1            # a fresh record holds nothing
    with open(files.record, "r+b") as f:
        f.seek(probe.HELD_AT)
        f.write(probe.HELD.pack(15))
    record = reader.read(None, 1e9)
    reader.close()
    r = RoundSteps(3)
    r.observe(0, record, look(), 10.0)
    assert record.held_step == 15 and r.held_step() == 15 and r.note(10.0).held_step == 15


def test_a_rank_whose_collectives_run_on_its_gpu_is_read_so_and_its_node_says_so(tmp_path) -> None:
    files = ProbeFiles.in_dir(str(tmp_path), 0)
    files.create()
    flags = probe.SYNCED | probe.ON_DEVICE
    write_garbage(files.record, probe.RECORD.pack(probe.MAGIC, probe.VERSION, 2, 3, 10.0, 11.0, 7, flags, 1, -1))
    reader = RecordReader(files.record)
    record = reader.read(None, 1e9)
    reader.close()
    assert record is not None and record.on_device and record.waits_measured
    r = RoundSteps(3)
    r.observe(0, paced(1, (0, 0.0, 0.0)), look(), 10.0)
    assert not r.note(10.0).on_device                      # gloo: on the host
    r.observe(1, record, look(), 10.0)
    assert r.note(10.0).on_device                          # one rank on the GPU: the node's wait is not all seen


def test_a_rank_that_resumed_is_news_for_the_server_at_once(tmp_path) -> None:
    """The note an agent sends as its workers start names the newest snapshot in memory, which the workers'
    agreement may remove (the job went back: a damaged snapshot). The held floor worked out from it is then above
    what a slower rank holds, and the ranks ahead drop its step; its resume is news at once, as a digest is."""
    files = ProbeFiles.in_dir(str(tmp_path), 0)
    files.create()
    write_garbage(files.record, probe.RECORD.pack(probe.MAGIC, probe.VERSION, 0, 0, 0.0, 0.0, os.getpid(), 0, 1, -1))
    watch = StepWatch(1, {0: (4, files)}, detect=False, pid_of=lambda lr: os.getpid(), exit_of=lambda lr: None,
                      warn=lambda _: None)
    watch.look()
    assert not watch.news_due()
    write_garbage(files.record, probe.RECORD.pack(probe.MAGIC, probe.VERSION, 0, 0, 0.0, 0.0, os.getpid(), 0, 1, 50))
    watch.look()
    assert watch.news_due() and not watch.news_due()
    watch.close()


@pytest.mark.parametrize("steps_meanwhile", [False, True])
def test_a_stall_that_ends_while_it_is_watched_is_not_reported(tmp_path, monkeypatch, steps_meanwhile) -> None:
    """Ranks that step again while the agent takes their stacks were seen at the stall's end (one caught entering
    the collective its peers wait in): a report of that moment showed "rank 0 alone for 0s at ... all_reduce"."""
    import asyncio

    import node_agent.workers.step_watch as step_watch
    from node_agent.core.facts import RanksStalled
    files = ProbeFiles.in_dir(str(tmp_path), 0)
    files.create()

    def record(steps: int, last_at: float) -> bytes:
        return probe.RECORD.pack(probe.MAGIC, probe.VERSION, 0, steps, 100.0, last_at, os.getpid(), 0, 1, -1)

    async def stacks(targets: dict) -> dict:
        if steps_meanwhile:
            write_garbage(files.record, record(6, 1000.0))      # the rank steps between two looks
        return {}
    monkeypatch.setattr(step_watch, "take_stacks", stacks)
    monkeypatch.setattr(step_watch, "EXAMINE_GAP_S", 0.0)
    write_garbage(files.record, record(5, 900.0))               # last stepped 100 s ago
    watch = StepWatch(1, {0: (4, files)}, detect=True, pid_of=lambda lr: os.getpid(), exit_of=lambda lr: None,
                      warn=lambda _: None, wall=lambda: 1000.0)
    facts: list = []
    asyncio.run(watch.tick(facts.append))
    reports = [f for f in facts if isinstance(f, RanksStalled)]
    assert len(reports) == (0 if steps_meanwhile else 1)
    watch.close()
