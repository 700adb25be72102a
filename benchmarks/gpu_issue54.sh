#!/usr/bin/env bash
# Issue 54's GPU figures in one prepared run, for a session lent a GPU node (the device tool runs it in the
# repository root; what it writes under $OUT comes back). Prepare on the development machine first:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl msgspec xxhash          (.whl is ignored by git and carried: run(carry=[".whl"]))
# Then: PARTS="3 0 1 2" is about 8 minutes on an H200 (2026-11-28: part 3 ~40 s, part 0 ~170 s, part 1 ~200 s,
# part 2 ~60 s, and ~50 s to start the machine): one call, `PARTS=3 bash ...; PARTS="0 1 2" bash ...` with
# timeout_s 560, leaves the rest of 15 minutes for one short call after it. Part 3 comes first: it is short and
# answers the open questions (page-locking by threads, and whether it holds up the training thread).
# It runs, each with a time limit so one hang costs only its own figures (the limits are what each took on an
# H100 on 2026-11-27, with room):
# 0. make bench-gpu-restart's case: crash -> stepping again, 805 MB of model + AdamW, node-agent with protect and
#    torchrun beside it (2 runs each, interleaved; each run takes 35-55 s); its parts per run in $OUT/*.json;
# 1. bench_snapshot_speed --device cuda: write (held, file complete) and restore of ~805 MB and 2 GiB of model +
#    AdamW state on the GPU, new process per measure, and what a crash right after a snapshot waits; a profile
#    of a steady snapshot's held time and of each restore in $OUT/snapshot-profile.txt; each write restored
#    twice, through the ring of pinned slots and as before it (restore_pageable_s), each checked bit for bit;
#    each write also with every tensor copied to the host on its own, as before staging.py packed the small ones
#    (steady_held_unpacked_s: the held time at 2 GiB, 109 ms on 2026-11-27, is what the packing is for);
# 2. the same at 4 GiB (the "the 4 GiB case finishes").
# Measured on 2026-11-27 and left out since (docs/benchmarks.md, "Issue 54 on one H100"): gpu_check.py (the
# GPU check, NCCL DDP with a crash) and bench_nccl_topo.py (NCCL_TOPO_FILE: no gain).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import msgspec, xxhash" 2>/dev/null; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
    && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:-}:$PWD
nvidia-smi -L 2>&1 | tee "$OUT/gpus.txt"
PARTS=${PARTS:-0 1 2}         # 3 and 4 when asked for
part() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
part 0 && timeout 230 python3 benchmarks/bench_first_step.py --device cuda --nodes 1 --nproc 1 --width 4096 --steps 40 \
  --crash-step 25 --snapshot-every 10 --disk-every 10 --step-s 0.3 --pairs 2 --snapshot-mb 0 --timeout 60 \
  --name bench-gpu-restart --out "$OUT" \
  --launchers "node-agent (defaults),torchrun c10d" 2>&1 | tee "$OUT/gpu-restart.txt"
part 1 && timeout 250 python3 benchmarks/bench_snapshot_speed.py --device cuda --sizes 805,2048 --rounds 4 --repeat 1 \
  --pageable-too --unpacked-too --json "$OUT/snapshot-speed-gpu.json" --profile "$OUT/snapshot-profile.txt" 2>&1 | tee "$OUT/snapshot-speed-gpu.txt"
part 2 && timeout 160 python3 benchmarks/bench_snapshot_speed.py --device cuda --sizes 4096 --rounds 3 --repeat 1 \
  --json "$OUT/snapshot-speed-gpu-4g.json" 2>&1 | tee "$OUT/snapshot-speed-gpu-4g.txt"
# 3. where a restore's time goes, phase by phase (restore_phases.py), at ~805 MB;
part 3 && timeout 60 python3 benchmarks/restore_phases.py --device cuda --mb 805 --repeat 2 2>&1 | tee "$OUT/restore-phases.txt"
# 4. write, restore and a crash right after a steady snapshot, an older checkout alternated with this one:
#    OLD=<its directory> (e.g. `mkdir .bench-old && git archive <commit> node_agent protocol | tar -x -C .bench-old`,
#    carried: run(carry=[".whl", ".bench-old"])).
part 4 && [ -n "${OLD:-}" ] && timeout 240 python3 benchmarks/bench_snapshot_speed.py --device cuda --sizes 805,2048 \
  --rounds 4 --repeat 1 --roots "$OLD,." --json "$OUT/snapshot-old-new.json" 2>&1 | tee "$OUT/snapshot-old-new.txt"
echo "done: $OUT"
