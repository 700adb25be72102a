"""`node-agent` (and `python -m node_agent`): torchrun-compatible command line. Bad input gives one line,
never a traceback.

The rendezvous follows the command line (launch_form.py): an rdzv-server over HTTP, or in-process for
one node (`--standalone` and torchrun's single-node forms) and for static launches. When the agent
was started with TORCHELASTIC_ERROR_FILE (as TorchX and other schedulers start torchrun), a failure is
written there in torchrun's format.
"""
from __future__ import annotations

import asyncio
import dataclasses
import glob
import os
import shutil
import sys
import tempfile

from node_agent.agent import Agent
from node_agent.cli.command_line import OptionsError
from node_agent.cli.launch_form import Mode
from node_agent.cli.options import AgentOptions, agent_token, parse_options
from node_agent.cli.values import StdSpec
from node_agent.client.transport import Transport, local_addr_towards
from node_agent.narration import Narrator, reply_of, start_lines
from node_agent.workers.environment import worker_argv
from node_agent.workers.error_file import write_reply_file
from node_agent.workers.launch import make_run_dir
from node_agent.workers.script_check import script_problem


def _transport(opts: AgentOptions, token: str | None) -> tuple[Transport, str]:
    """The way to the rendezvous, and the address other nodes reach this one at."""
    if opts.mode is Mode.STANDALONE:
        # Like torchrun --standalone, but the rendezvous runs in this process with no HTTP at all.
        from node_agent.client.local import LocalClient
        return LocalClient(opts.job_id, opts.node_id), opts.local_addr or "127.0.0.1"
    if opts.mode is Mode.STATIC:
        from node_agent.client.static import StaticClient
        client = StaticClient(opts.job_id, opts.node_id, node_rank=opts.node_rank, nnodes=opts.job.max_nodes,
                              master_addr=opts.master_addr, master_port=opts.master_port)
        return client, opts.local_addr or local_addr_towards(opts.master_addr, opts.master_port)
    from node_agent.client.http import RdzvClient
    assert opts.endpoint_host is not None and opts.endpoint_port is not None
    addr = opts.local_addr or local_addr_towards(opts.endpoint_host, opts.endpoint_port)
    return RdzvClient(opts.endpoint_host, opts.endpoint_port, opts.job_id, opts.node_id,
                      scheme=opts.endpoint_scheme, token=token, tls_ca=opts.tls_ca,
                      replicas=opts.endpoint_replicas), addr


async def _run(opts: AgentOptions, token: str | None) -> int:
    transport, addr = _transport(opts, token)
    agent = Agent(opts, transport, addr)
    code = await agent.run()
    if code != 0 and opts.reply_file:
        write_reply_file(opts.reply_file, *reply_of(agent.exit, code))
    return code


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
        token = agent_token(opts)
    except OptionsError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        return 2
    for warning in opts.warnings:
        print(f"node-agent: warning: {warning}", file=sys.stderr)
    if not (opts.module or opts.no_python) and (problem := script_problem(opts.script, worker_argv(opts)[0])):
        print(f"node-agent: error: {problem}", file=sys.stderr)   # before joining: no round, no restart used
        return 2
    try:   # torchrun's layout: a fresh directory for this run, under --log-dir or a temporary one
        root = opts.log_dir or tempfile.mkdtemp(prefix="node-agent_")
        opts = dataclasses.replace(opts, run_dir=make_run_dir(root, opts.job_id))
    except OSError as exc:
        print(f"node-agent: error: --log-dir {opts.log_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    narrator = Narrator(opts.node_id)
    for line in start_lines(opts):
        narrator.say(line)
    try:
        return asyncio.run(_run(opts, token))
    except KeyboardInterrupt:
        return 130
    finally:
        if opts.log_dir is None:
            _tidy(opts, root, narrator)


def _tidy(opts: AgentOptions, root: str, narrator: Narrator) -> None:
    """The temporary log directory (no --log-dir) is kept when it holds something to read: redirected or
    tee'd output, or a worker's error file. Otherwise it goes."""
    assert opts.run_dir is not None
    logs = opts.redirects != StdSpec() or opts.tee != StdSpec()
    if logs or glob.glob(os.path.join(glob.escape(opts.run_dir), "attempt_*", "*", "error.json")):
        narrator.say(f"worker logs and error files are kept in {opts.run_dir}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
