"""ddp_buckets: a snapshot records the layout DDP rebuilt after its first backward, and a restored DDP is built in
it where every rank can and holds the same one; otherwise it stays in DDP's own layout and says why, once. (A real
DDP on a one-rank gloo group, in a process of its own: a process group is process-wide state. Another rank's
answer is stood in for by the collective's result; the 4-rank sums are tests/e2e/test_memory_ddp.py's.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, os, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from node_agent.training import ddp_buckets, resume
os.environ.update(RANK="0")
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)

def ddp(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))
    return DDP(model, bucket_cap_mb=0.001, **kw)      # 1 KB buckets: this model's 6 tensors in 2 of them

def steps(d, n):
    for _ in range(n):
        d(torch.ones(2, 16)).sum().backward()

def sizes(d):
    return d._get_ddp_logging_data()["bucket_sizes"]

out = {}
first = ddp()
out["before"] = ddp_buckets.recorded(first)
steps(first, 3)                                     # DDP logs its rebuilt layout in its third step
layout = out["layout"] = ddp_buckets.recorded(first)
out["rebuilt_sizes"] = first._get_ddp_logging_data()["rebuilt_bucket_sizes"]
second = ddp()
out["fresh_sizes"] = sizes(second)
out["adopted"] = ddp_buckets.adopt(second, layout)
out["adopted_sizes"] = sizes(second)
out["recorded_before_logged"] = ddp_buckets.recorded(second)     # its next snapshots hold it too
steps(second, 3)
out["after_adopted"] = ddp_buckets.recorded(second)
out["none"] = ddp_buckets.adopt(ddp(), None)
out["wrong_count"] = ddp_buckets.adopt(ddp(), [[0, 1]])
out["not_ints"] = ddp_buckets.adopt(ddp(), [["0"]])
hooked = ddp()
hooked.register_comm_hook(None, lambda _, bucket: dist.all_reduce(bucket.buffer(), async_op=True).get_future()
                          .then(lambda f: f.value()[0]))
out["comm_hook"] = ddp_buckets.adopt(hooked, layout)
out["static"] = ddp_buckets.adopt(ddp(static_graph=True), layout)
def other_rank(digest):          # the two MINs adopt makes, with another rank that offers `digest`
    calls = iter([lambda x: min(x, digest), lambda x: min(x, -digest)])
    resume.reduce_min = lambda x: next(calls)(x)

other_rank(12345)                                   # another rank holds another layout
out["other_rank"] = ddp_buckets.adopt(ddp(), layout)
other_rank(12345)                                   # this rank (0) holds none, another one does
out["rank0_none"] = ddp_buckets.adopt(ddp(), None)
other_rank(0)                                       # this rank holds one, another none
out["other_none"] = ddp_buckets.adopt(ddp(), layout)
other_rank(0)                                       # nobody holds one (find_unused_parameters, early steps)
out["nobody"] = ddp_buckets.adopt(ddp(), None)
from node_agent.training.protection import _ddp_of
out["compiled"] = _ddp_of(torch.compile(first)) is first and _ddp_of(first) is first and _ddp_of(first.module) is None
print("RESULT", json.dumps(out))
dist.destroy_process_group()
"""


def test_the_rebuilt_layout_is_recorded_adopted_where_every_rank_can_and_refused_with_one_line() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.split("RESULT", 1)[1])
    assert out["before"] is None                                          # not rebuilt before a backward
    assert out["layout"] == [[5, 4, 3, 2], [1, 0]]                        # the order the gradients became ready
    assert out["fresh_sizes"] != out["rebuilt_sizes"]                     # a new DDP: its first layout
    assert out["adopted"] is True and out["adopted_sizes"] == out["rebuilt_sizes"]
    assert out["after_adopted"] == out["layout"]                          # and DDP rebuilds into the same one
    refused = [line for line in done.stderr.splitlines() if "own bucket layout" in line]
    assert out["none"] is False                                           # nothing recorded: nothing said
    assert out["wrong_count"] is False and "not one of this model's 6 parameters" in refused[0]
    assert out["not_ints"] is False and "not one of this model's 6 parameters" in refused[1]
    assert out["comm_hook"] is False and "a comm hook is registered" in refused[2]
    assert out["static"] is False and "static_graph=True" in refused[3]
    assert out["other_rank"] is False and "the ranks' snapshots hold different layouts" in refused[4]
    assert out["rank0_none"] is False and "rank 0's snapshot holds none" in refused[5]
    assert out["other_none"] is False and "another rank's snapshot holds none, or its DDP cannot" in refused[6]
    assert out["nobody"] is False and len(refused) == 7, refused
    assert out["recorded_before_logged"] == out["layout"]
    assert out["compiled"] is True                  # protect(torch.compile(DDP(model))) finds the DDP
