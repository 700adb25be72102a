"""`node-agent`: torchrun-compatible command line. Bad input gives one line, never a traceback."""
from __future__ import annotations

import asyncio
import sys
from typing import Optional

from node_agent.agent import Agent, AgentError
from node_agent.options import AgentOptions, OptionsError, parse_options


async def _run(opts: AgentOptions) -> int:
    if not opts.standalone:
        return await Agent(opts, opts.endpoint_host, opts.endpoint_port).run()
    # --standalone: an in-process server on a free loopback port, like torchrun --standalone.
    from node_agent.standalone import embedded_server
    async with embedded_server() as port:
        return await Agent(opts, "127.0.0.1", port).run()


def main(argv: Optional[list[str]] = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except OptionsError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        return 2
    for warning in opts.warnings:
        print(f"node-agent: warning: {warning}", file=sys.stderr)
    try:
        return asyncio.run(_run(opts))
    except AgentError as exc:
        print(f"node-agent: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
