"""Which rendezvous a command line asks for, decided the way torchrun decides it:
- `standalone`: one node, an in-process coordinator, no server (`--standalone`; torchrun's default static
  backend with no endpoint, no --master-port and one node; a one-node line whose endpoint torchrun would host
  itself: none, or port 0 as TorchX writes `--rdzv-endpoint localhost:0`).
- `static`: torchrun's static rendezvous (`--node-rank R --master-addr A --master-port P`, as Slurm and MPI
  scripts write it). No server: each node computes its ranks from the values given, worker rank 0 hosts the
  workers' store at A:P, and restarts are this node's own. Several nodes at an endpoint with no node rank are
  refused: each would be node rank 0 and wait forever (torchrun hangs); such a line meant `--rdzv-backend c10d`.
- `server`: an rdzv-server at the endpoint (`--endpoint`, or `--rdzv-endpoint` with any backend but static). One
  node at an `--rdzv-endpoint` on this host (`--nnodes 1 --rdzv-backend c10d --rdzv-endpoint localhost:29400`, the
  tutorial's line) may run in-process after all: torchrun's agent hosts that rendezvous itself, so where nothing
  listens there when the agent starts (`host_if_unserved`, node_agent/main.py), it does too."""
from __future__ import annotations

import dataclasses
import ipaddress
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from node_agent.cli.values import DEFAULT_PORT, parse_endpoint, parse_server
from node_agent.settings import Mode

STATIC_MASTER_PORT = 29500      # torchrun's --master-port default


@dataclass(frozen=True)
class Form:
    mode: Mode
    scheme: str = "http"
    host: str | None = None           # the rdzv-server (server mode)
    port: int | None = None
    replicas: tuple[tuple[str, int], ...] = ()   # more replicas of the server: --endpoint a:P,b:P
    master_addr: str = "127.0.0.1"    # static mode: node rank 0, where worker rank 0 hosts the store
    master_port: int = STATIC_MASTER_PORT
    job_id: str | None = None         # an id this form imposes (standalone: a fresh one when none was given)
    one_node: bool = False            # force 1:1 nodes
    host_if_unserved: bool = False    # server: one node at an endpoint on this host (in-process if nothing listens)
    warnings: tuple[str, ...] = ()


Fail = Callable[[str, str], NoReturn]   # (dest, why)


def launch_form(*, backend: str | None, endpoint: str | None, endpoint_flag: str, standalone: bool,
                master_addr: str | None, master_port: str | None, nodes: tuple[int, int], job_id: str | None,
                tls_ca: str | None, fail: Fail, node_rank_given: bool = False) -> Form:
    """Decide the form. `endpoint_flag` is how the endpoint was given (`--endpoint` always means a server);
    `node_rank_given`: --node-rank (or $PET_NODE_RANK) is on the line."""
    max_nodes = nodes[1]
    fresh_id = job_id or str(uuid.uuid4())     # torchrun's standalone run id when none was given
    ours = endpoint is not None and endpoint_flag == "--endpoint"
    if standalone:
        warnings = [f"{endpoint_flag} is ignored with --standalone"] if endpoint is not None else []
        if max_nodes != 1:
            warnings.append(f"--standalone runs one node: --nnodes {nodes[0]}:{nodes[1]} becomes 1:1")
        return Form(Mode.STANDALONE, job_id=fresh_id, one_node=True, warnings=tuple(warnings))
    if ours or (backend or "static") != "static":
        form = _dynamic(endpoint or "", max_nodes, fresh_id, tls_ca, fail, port_0=not ours)
        hostable = not ours and max_nodes == 1 and not form.replicas and _on_this_host(form.host)
        return dataclasses.replace(form, host_if_unserved=True) if hostable else form
    if not endpoint and master_port is None and max_nodes == 1:
        return Form(Mode.STANDALONE, job_id=fresh_id, one_node=True)   # torchrun's own shortcut
    return _static(endpoint, endpoint_flag, backend, master_addr, master_port, nodes, node_rank_given, fail)


def _dynamic(endpoint: str, max_nodes: int, fresh_id: str, tls_ca: str | None, fail: Fail, port_0: bool) -> Form:
    if not endpoint.strip():
        if max_nodes == 1:          # torchrun's c10d agent would host the rendezvous itself
            return Form(Mode.STANDALONE, job_id=fresh_id, one_node=True)
        endpoint = f"localhost:{DEFAULT_PORT}"   # torch's default for an empty endpoint
    first, *more = endpoint.split(",")        # replicas of one server (on etcd): a:29400,b:29400
    scheme, host, port = parse_server(first, tls_ca, lambda why: fail("endpoint", why), allow_port_0=port_0)
    replicas = []
    for text in more:
        other, replica_host, replica_port = parse_server(text, tls_ca, lambda why: fail("endpoint", why))
        if other != scheme:
            fail("endpoint", f"every replica needs the same scheme, got {endpoint!r}")
        replicas.append((replica_host, replica_port))
    if port == 0 and not replicas:
        if max_nodes == 1:          # TorchX's single-node line: torchrun hosts it on a free port
            return Form(Mode.STANDALONE, job_id=fresh_id, one_node=True)
        fail("endpoint", f"port 0 in {endpoint!r} asks the agent to host the rendezvous itself, which serves "
                         f"one node only; for {max_nodes} nodes give an rdzv-server's HOST:PORT")
    if port == 0:
        fail("endpoint", f"port 0 names no server in a list of replicas: {endpoint!r}")
    return Form(Mode.SERVER, scheme=scheme, host=host, port=port, replicas=tuple(replicas))


def _on_this_host(host: str | None) -> bool:
    if host is None:
        return False
    try:
        addr = ipaddress.ip_address(host)
        return addr.is_loopback or addr.is_unspecified
    except ValueError:
        return host.lower() in ("localhost", socket.gethostname().lower())


def _static(endpoint: str | None, flag: str, backend: str | None, master_addr: str | None,
            master_port: str | None, nodes: tuple[int, int], node_rank_given: bool, fail: Fail) -> Form:
    warnings: list[str] = []
    if endpoint:
        host, port = parse_endpoint(endpoint, lambda why: fail("endpoint", why))
        if nodes[1] > 1 and not node_rank_given:
            nnodes = f"{nodes[0]}:{nodes[1]}" if nodes[0] != nodes[1] else str(nodes[1])
            how = "no --rdzv-backend" if backend is None else f"--rdzv-backend {backend}"
            fail("endpoint", f"with {nnodes} nodes, {how} and no --node-rank, every node is node rank 0 of a "
                             f"static launch and waits for the others forever (so does torchrun): for an "
                             f"rdzv-server at {endpoint!r} add --rdzv-backend c10d (PET_RDZV_BACKEND=c10d); for a "
                             f"static launch give each node its --node-rank (PET_NODE_RANK)")
        if backend is None and flag.startswith("--"):
            warnings.append(f"{flag} with torchrun's default --rdzv-backend static names node rank 0 of a static "
                            f"launch (as in torchrun); for an rdzv-server give --rdzv-backend c10d or --endpoint")
    else:
        host = master_addr if master_addr is not None else "127.0.0.1"
        if not host.strip():
            fail("master_addr", "must not be empty")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        port = STATIC_MASTER_PORT
        if master_port is not None:
            try:
                port = int(master_port)
            except ValueError:
                fail("master_port", f"expected a port number, got {master_port!r}")
    if not 1 <= port <= 65535:
        fail("master_port" if not endpoint else "endpoint", f"expected a port 1-65535, got {port}")
    return Form(Mode.STATIC, master_addr=host, master_port=port, warnings=tuple(warnings))
