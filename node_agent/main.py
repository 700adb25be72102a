"""`node-agent` (and `python -m node_agent`): the composition root. The CLI (cli/) reads the command line
into settings; this builds the agent from them and runs it. Bad input gives one line, never a traceback.
The rendezvous (cli/launch_form.py) is an rdzv-server over HTTP, or in-process for one node and for static
launches. With TORCHELASTIC_ERROR_FILE set (as TorchX starts torchrun), a failure goes there, torchrun-style."""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import glob
import os
import shutil
import socket
import sys
import tempfile
import time

from node_agent.agent import Agent
from node_agent.cli.command_line import OptionsError
from node_agent.cli.options import agent_token, parse_options
from node_agent.client.ports import store_ports
from node_agent.client.transport import Transport, local_addr_towards
from node_agent.narration import Narrator, reply_of, start_lines
from node_agent.settings import AgentSettings, LinkSettings, Mode, StdSpec, WorkerSettings, default_node_id
from node_agent.workers.environment import worker_argv
from node_agent.workers.error_file import write_reply_file
from node_agent.workers.launch import make_run_dir
from node_agent.workers.memory import left_behind
from node_agent.workers.script_check import script_problem
from node_agent.workers.succession import predecessor


def _transport(link: LinkSettings, token: str | None) -> tuple[Transport, str]:
    """The way to the rendezvous, and the address other nodes reach this one at."""
    if link.mode is Mode.STANDALONE:
        # Like torchrun --standalone, but the rendezvous runs in this process with no HTTP at all.
        from node_agent.client.local import LocalClient
        return LocalClient(link.job_id, link.node_id), link.local_addr or "127.0.0.1"
    if link.mode is Mode.STATIC:
        from node_agent.client.static import StaticClient
        client = StaticClient(link.job_id, link.node_id, node_rank=link.node_rank, nnodes=link.job.max_nodes,
                              master_addr=link.master_addr, master_port=link.master_port)
        return client, link.local_addr or local_addr_towards(link.master_addr, link.master_port)
    from node_agent.client.http import RdzvClient
    assert link.endpoint_host is not None and link.endpoint_port is not None
    addr = link.local_addr or local_addr_towards(link.endpoint_host, link.endpoint_port)
    return RdzvClient(link.endpoint_host, link.endpoint_port, link.job_id, link.node_id,
                      scheme=link.endpoint_scheme, token=token, tls_ca=link.tls_ca,
                      replicas=link.endpoint_replicas), addr


async def _run(settings: AgentSettings, token: str | None) -> int:
    agent = Agent(settings, *_transport(settings.link, token))
    code = await agent.run()
    if code != 0 and settings.reply_file:
        write_reply_file(settings.reply_file, *reply_of(agent.exit, code))
    return code


def _check_store_ports() -> None:
    """$NODE_AGENT_STORE_PORTS, said at start-up where it is no range (it is read where a port is offered)."""
    try:
        store_ports()
    except ValueError as exc:
        raise OptionsError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_options(sys.argv[1:] if argv is None else argv)
        token = agent_token(settings.link)
        _check_store_ports()
    except OptionsError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        return 2
    for warning in settings.warnings:
        print(f"node-agent: warning: {warning}", file=sys.stderr)
    workers = settings.workers
    if not (workers.module or workers.no_python) and (problem := script_problem(
            workers.script, worker_argv(workers)[0], workers.nproc)):
        print(f"node-agent: error: {problem}", file=sys.stderr)   # before joining: no round, no restart used
        return 2
    if refusal := _memory_off_over_snapshots(settings):
        print(f"node-agent: error: {refusal}", file=sys.stderr)
        return 2
    try:   # torchrun's layout: a fresh directory for this run, under --log-dir or a temporary one
        root = workers.log_dir or tempfile.mkdtemp(prefix="node-agent_")
        workers = dataclasses.replace(workers, run_dir=make_run_dir(root, workers.job_id))
        settings = dataclasses.replace(settings, workers=workers)
    except OSError as exc:
        print(f"node-agent: error: {_log_dir_problem(workers.log_dir, exc)}", file=sys.stderr)
        return 2
    settings, taken = _with_predecessor(settings)
    narrator = Narrator(settings.link.node_id)
    if taken:
        narrator.say(taken)
    if settings.link.host_if_unserved and _nothing_listens(settings.link):
        narrator.say(f"nothing listens at {settings.link.endpoint} and the job has one node: the rendezvous runs in "
                     f"this agent, as torchrun's agent hosts it (start an rdzv-server there first for the server's "
                     f"job view, page and metrics)")
        settings = dataclasses.replace(settings, link=dataclasses.replace(settings.link, mode=Mode.STANDALONE))
    for line in start_lines(settings):
        narrator.say(line)
    try:
        return asyncio.run(_run(settings, token))
    except KeyboardInterrupt:
        return 130
    finally:
        _tidy(workers, root, narrator)


def _with_predecessor(settings: AgentSettings) -> tuple[AgentSettings, str]:
    """An agent started without --node-id takes the node id of an ended agent of its job on this host with its memory
    (workers/memory.predecessor): the job keeps the node's place and snapshots, as for an agent given its id. The
    line that says so ("" where none)."""
    link, workers = settings.link, settings.workers
    if link.mode is not Mode.SERVER or link.node_id != default_node_id() or workers.memory_dir_limit == 0:
        return settings, ""
    taken = predecessor(link.job_id, link.nproc)
    if taken is None:
        return settings, ""
    node_id, pid = taken
    settings = dataclasses.replace(settings, link=dataclasses.replace(link, node_id=node_id),
                                   workers=dataclasses.replace(workers, node_id=node_id))
    return settings, (f"node id {node_id}: its previous agent's on this host (pid {pid}, ended), taken with its "
                      f"memory, so job {link.job_id!r} keeps this node's place and snapshots (--node-id sets another)")


def _log_dir_problem(log_dir: str | None, exc: OSError) -> str:
    """What is wrong with the log directory, in words: mkdir's bare "File exists" for a file in the way
    reads as if the directory were fine, and without --log-dir the temporary one is what failed."""
    where = f"--log-dir {log_dir}" if log_dir else f"a temporary log directory in {tempfile.gettempdir()}"
    if exc.errno == errno.EEXIST:
        return f"{where}: is a file, not a directory"
    if exc.errno == errno.ENOTDIR:
        return f"{where}: a part of the path is a file, not a directory"
    return f"{where}: {exc.strerror or exc}"


def _memory_off_over_snapshots(settings: AgentSettings) -> str:
    """--no-memory-dir (--memory-dir-limit 0) given to the next agent of a node whose previous agent left snapshots
    of this job (an operator's reconfiguration, node by node): its ranks could not load them, and one rank without
    memory sends every rank of the job to its fallback (disk or step 0). Refused, "" where nothing is left."""
    link, workers = settings.link, settings.workers
    left = left_behind(link.job_id, link.node_id) if workers.memory_dir_limit == 0 and link.node_id else None
    if left is None:
        return ""
    home, step = left
    return (f"--no-memory-dir: node {link.node_id}'s previous agent left snapshots of job {link.job_id!r} (step "
            f"{step}) in {home}; without a memory directory every rank of the job would go back to its disk checkpoint "
            f"or step 0. Start this node as before to resume from them, or remove {home} first to drop them")


HOST_GRACE_S = 2.0     # a server started beside the agent listens within this (0.5 s on a quiet 2-core machine)


def _nothing_listens(link: LinkSettings) -> bool:
    """The endpoint refuses every connection for HOST_GRACE_S: no server there (one that answers slowly is)."""
    deadline = time.monotonic() + HOST_GRACE_S
    while True:
        try:
            socket.create_connection((link.endpoint_host or "localhost", link.endpoint_port or 0), timeout=2).close()
            return False
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.1)
        except OSError:
            return False


def _tidy(workers: WorkerSettings, root: str, narrator: Narrator) -> None:
    """Where this run's worker logs and error files are, said when it holds any: its directory's name is new for
    every run, and torchrun's failure summary names the error file. The temporary one (no --log-dir) goes when it
    holds neither."""
    assert workers.run_dir is not None
    logs = workers.redirects != StdSpec() or workers.tee != StdSpec()
    if logs or glob.glob(os.path.join(glob.escape(workers.run_dir), "attempt_*", "*", "error.json")):
        narrator.say(f"worker logs and error files are {'in' if workers.log_dir else 'kept in'} {workers.run_dir}")
    elif workers.log_dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
