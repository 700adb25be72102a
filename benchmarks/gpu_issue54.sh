#!/usr/bin/env bash
# Issue 54's GPU figures in one prepared run, for a session lent a GPU node (the device tool runs it in the
# repository root; what it writes under $OUT comes back). Prepare on the development machine first:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl msgspec xxhash          (.whl is ignored by git and carried: run(carry=[".whl"]))
# Then: bash benchmarks/gpu_issue54.sh   (about 9 minutes; give it timeout_s 590)
# It runs, each with a time limit so one hang costs only its own figures:
# 0. make bench-gpu-restart's case: crash -> stepping again, 805 MB of model + AdamW, node-agent with protect,
#    node-agent with the script's own disk checkpoint, torchrun beside them (2 runs each, interleaved);
# 1. bench_snapshot_speed --device cuda: write (held, file complete) and restore of ~805 MB, 2 GiB and 4 GiB of
#    model + AdamW state on the GPU, new process per measure, and what a crash right after a snapshot waits;
# 2. gpu_check.py: the GPU check on NVML, and NCCL DDP under node-agent with a crash: crash -> stepping again;
# 3. the restart's anatomy of that job is in node-agent's log lines (phases need a server: not in 2);
# 4. bench_nccl_topo.py: whether NCCL_TOPO_FILE (a topology dumped once) cuts the process group's start.
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
timeout 180 python3 benchmarks/bench_first_step.py --device cuda --nodes 1 --nproc 1 --width 4096 --steps 40 \
  --crash-step 25 --snapshot-every 10 --disk-every 10 --step-s 0.3 --pairs 2 --snapshot-mb 0 --timeout 60 \
  --name bench-gpu-restart --out "$OUT" \
  --launchers "node-agent (defaults),node-agent (own disk),torchrun c10d" 2>&1 | tee "$OUT/gpu-restart.txt"
timeout 180 python3 benchmarks/bench_snapshot_speed.py --device cuda --sizes 805,2048,4096 --rounds 4 --repeat 1 \
  --json "$OUT/snapshot-speed-gpu.json" 2>&1 | tee "$OUT/snapshot-speed-gpu.txt"
timeout 120 python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu-check.txt"
timeout 60 python3 benchmarks/bench_nccl_topo.py --runs 4 2>&1 | tee "$OUT/nccl-topo.txt"
echo "done: $OUT"
