"""Benchmark worker (no torch): appends "start <rank> <world> <node> <unix time>" then idles."""
import os
import time

with open(os.environ["BENCH_LOG"], "a") as f:
    f.write(f"start {os.environ['RANK']} {os.environ['WORLD_SIZE']} {os.environ.get('NODE', '?')} {time.time():.6f}\n")
time.sleep(3600)
