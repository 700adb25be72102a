"""`node-agent`: torchrun-compatible command line. Bad input gives one line, never a traceback."""
from __future__ import annotations

import asyncio
import sys

from node_agent.agent import Agent
from node_agent.options import AgentOptions, OptionsError, agent_token, parse_options
from node_agent.transport import local_addr_towards


async def _run(opts: AgentOptions, token: str | None) -> int:
    if opts.standalone:
        # Like torchrun --standalone, but the rendezvous runs in this process with no HTTP at all.
        from node_agent.local_client import LocalClient
        return await Agent(opts, LocalClient(opts.job_id, opts.node_id), opts.local_addr or "127.0.0.1").run()
    from node_agent.client import RdzvClient
    assert opts.endpoint_host is not None and opts.endpoint_port is not None
    addr = opts.local_addr or local_addr_towards(opts.endpoint_host, opts.endpoint_port)
    client = RdzvClient(opts.endpoint_host, opts.endpoint_port, opts.job_id, opts.node_id,
                        scheme=opts.endpoint_scheme, token=token, tls_ca=opts.tls_ca,
                        replicas=opts.endpoint_replicas)
    return await Agent(opts, client, addr).run()


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
        token = agent_token(opts)
    except OptionsError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        return 2
    for warning in opts.warnings:
        print(f"node-agent: warning: {warning}", file=sys.stderr)
    try:
        return asyncio.run(_run(opts, token))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
