"""What fresh memory costs a restore on CPU (issue 54): 1 GiB of state copied into new memory, in this process, one
way per run: `empty` (torch.empty + copy_, as restored.py's settle does), `thp-env` (the same under
THP_MEM_ALLOC_ENABLE=1, torch's transparent huge pages: set it in the environment), `populate` (one anonymous
mapping, MAP_POPULATE), `huge` (MADV_HUGEPAGE), `huge-populate` (MADV_HUGEPAGE, then MADV_POPULATE_WRITE).

Run: for h in empty populate huge huge-populate; do .venv/bin/python benchmarks/fresh_memory.py $h; done;
     THP_MEM_ALLOC_ENABLE=1 .venv/bin/python benchmarks/fresh_memory.py thp-env
"""
import mmap
import sys
import time

import torch

how = sys.argv[1]
n = 1 << 30
src = torch.ones(n // 4, dtype=torch.float32)
src.add_(1)
t0 = time.perf_counter()
if how in ("empty", "thp-env"):
    dst = torch.empty_like(src)
elif how == "populate":
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    dst = torch.frombuffer(m, dtype=torch.float32)
elif how == "huge":
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    dst = torch.frombuffer(m, dtype=torch.float32)
elif how == "huge-populate":
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    m.madvise(23)     # MADV_POPULATE_WRITE (Linux 5.14)
    dst = torch.frombuffer(m, dtype=torch.float32)
t1 = time.perf_counter()
dst.copy_(src)
t2 = time.perf_counter()
huge = open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split("\n")[0].strip()
print(f"{how:14s} alloc {t1-t0:.3f} copy {t2-t1:.3f} total {t2-t0:.3f}s ({n/(t2-t0)/1e9:.1f} GB/s) huge {huge}")
