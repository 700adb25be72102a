"""A launcher that runs torch's launcher in its own process, as `accelerate launch` does.

Its command line is its own (accelerate's spellings: --num_processes is the job's total, --num_machines,
--machine_rank, --main_process_ip/port, --rdzv_backend, --max_restarts, --rdzv_conf, --rdzv_id); it builds
torchrun's arguments from them and calls `torch.distributed.run.run(args)`, so `sys.argv` is never a
torchrun line. A tool that calls `elastic_launch` or `run()` from Python looks like this to the plugin.
"""
import argparse
import sys

from torch.distributed.run import get_args_parser, run


def main() -> None:
    p = argparse.ArgumentParser(prog="inprocess-launcher")
    p.add_argument("--num_processes", type=int, required=True)
    p.add_argument("--num_machines", type=int, default=1)
    p.add_argument("--machine_rank", type=int, default=0)
    p.add_argument("--main_process_ip", default="127.0.0.1")
    p.add_argument("--main_process_port", type=int, default=29500)
    p.add_argument("--rdzv_backend", default="static")
    p.add_argument("--rdzv_id", default=None)
    p.add_argument("--rdzv_conf", default="")
    p.add_argument("--max_restarts", type=int, default=0)
    p.add_argument("--role", default="default")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = p.parse_args()
    torchrun = ["--nnodes", str(ns.num_machines), "--node-rank", str(ns.machine_rank),
                "--nproc-per-node", str(ns.num_processes // ns.num_machines),
                "--rdzv-backend", ns.rdzv_backend, "--rdzv-endpoint", f"{ns.main_process_ip}:{ns.main_process_port}",
                "--rdzv-conf", ns.rdzv_conf, "--max-restarts", str(ns.max_restarts), "--role", ns.role,
                "--monitor-interval", "0.1"]
    if ns.rdzv_id:
        torchrun += ["--rdzv-id", ns.rdzv_id]
    args = get_args_parser().parse_args([*torchrun, ns.script, *ns.script_args])
    run(args)


if __name__ == "__main__":
    sys.exit(main())
