"""The controller's side of the client processes (`scale_fleet.py`): start them, ask them, stop them.

Nodes are dealt to the processes round-robin and, within a process, spread over loopback source
addresses (127.1.x.y), `per_address` nodes each: the server counts long-polls per address.
"""
from __future__ import annotations

import multiprocessing as mp
import resource
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.scale_fleet import NodeSpec, client_main
from protocol.messages import JobConfig

FD_MARGIN = 300      # descriptors a process needs besides its connections (files, pipes, the store)


def fd_limit() -> int:
    """The open-file limit a process here can reach (the server raises its soft limit to this)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def max_nodes_per_process() -> int:
    """Connections one process (the server, or one client) can hold: one per node."""
    return fd_limit() - FD_MARGIN


def job_config(nodes: int) -> JobConfig:
    """A fixed-size job as `node-agent --nnodes N` asks for it (agent defaults otherwise), with
    room for the failures the benchmark reports."""
    return JobConfig(min_nodes=nodes, max_nodes=nodes, max_restarts=100)


@dataclass
class Placement:
    client: int
    key: str             # "job/node": how the client process names the node


def make_specs(jobs: dict[str, int], clients: int, per_address: int,
               witness_port: int = 29600, progress: bool = False
               ) -> tuple[list[list[NodeSpec]], dict[str, list[Placement]]]:
    """Nodes of every job, dealt to `clients` processes; and where each job's nodes went."""
    per_client: list[list[NodeSpec]] = [[] for _ in range(clients)]
    where: dict[str, list[Placement]] = {}
    i = 0
    for job_id, n in jobs.items():
        config = job_config(n)
        where[job_id] = []
        for k in range(n):
            c = i % clients
            a = len(per_client[c]) // per_address + c * 1000      # this process's addresses only
            addr = f"127.1.{a // 250}.{a % 250 + 1}"
            per_client[c].append(NodeSpec(job_id, f"node-{k}", addr, config, witness_port, progress))
            where[job_id].append(Placement(c, f"{job_id}/node-{k}"))
            i += 1
    return per_client, where


def set_apart(per_client: list[list[NodeSpec]], placed: Placement) -> Placement:
    """Move one node into a client process of its own (as a real agent has its host to itself), so that
    what it times (the failure report's reply) is the server's answer, not its busy neighbours' turn."""
    specs = per_client[placed.client]
    spec = next(sp for sp in specs if f"{sp.job_id}/{sp.node_id}" == placed.key)
    specs.remove(spec)
    per_client.append([spec])
    return Placement(len(per_client) - 1, placed.key)


class Clients:
    """The client processes of one scenario. Every call sends a command and waits for the answers."""

    def __init__(self, port: int, per_client: list[list[NodeSpec]], new_session: bool = False) -> None:
        self.port = port
        ctx = mp.get_context("spawn")          # a clean interpreter: no state of the controller's
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for specs in per_client:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_main, args=(port, specs, child, new_session), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            if not conn.poll(120):
                raise RuntimeError("a client process did not start within 120 s")
            conn.recv()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def ask(self, cmd: dict[str, Any], timeout: float = 120.0) -> list[Any]:
        for conn in self.conns:
            conn.send(cmd)
        return [self._answer(conn, timeout) for conn in self.conns]

    def ask_one(self, client: int, cmd: dict[str, Any], timeout: float = 120.0) -> Any:
        self.conns[client].send(cmd)
        return self._answer(self.conns[client], timeout)

    @staticmethod
    def _answer(conn: Connection, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise RuntimeError(f"a client process did not answer within {timeout:g} s")
        return conn.recv()

    def stop(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            try:
                conn.send({"cmd": "stop"})
                if conn.poll(30):
                    conn.recv()
            except (OSError, EOFError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
