"""`rdzv-server`: parse flags, start the aiohttp app, stop cleanly on SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from aiohttp import web

from rdzv_server.app import Coordinator, create_app
from rdzv_server.store import SqliteStore, StoreError
from rdzv_server.views import iso


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": iso(record.created), "level": record.levelname, "message": record.getMessage()}
        for key in ("job_id", "event", "node_id", "round_id"):
            value = getattr(record, key, None)
            if value not in (None, "", -1):      # -1 / "": not about one round / node
                doc[key] = value
        return json.dumps(doc)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        job = getattr(record, "job_id", None)
        prefix = f"[{job}] " if job else ""
        return f"{self.formatTime(record, '%H:%M:%S')} {record.levelname.lower()} {prefix}{record.getMessage()}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdzv-server", allow_abbrev=False,
                                description="Standalone rendezvous server for node-agent jobs.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29400, help="port to listen on; 0 picks a free one (default 29400)")
    p.add_argument("--state-dir", default="rdzv-state", metavar="DIR",
                   help="folder for the durable state store (created when missing; default ./rdzv-state). "
                        "'none' keeps state in memory only: it does not survive a restart")
    p.add_argument("--allow-remote-admin", action="store_true",
                   help="accept /v1/admin/ actions from any address, not only loopback (no authentication!)")
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


async def serve(host: str, port: int, ready: asyncio.Future | None = None,
                store: SqliteStore | None = None, allow_remote_admin: bool = False) -> None:
    app = create_app(Coordinator(store=store), allow_remote_admin=allow_remote_admin)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    # A large accept backlog: after a restart every agent reconnects at once, and a SYN dropped from
    # a full queue is retried by the kernel only after a second.
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=4096)
    await site.start()
    bound = runner.addresses[0]
    print(f"rdzv-server listening on http://{bound[0]}:{bound[1]}", flush=True)
    if ready is not None:
        ready.set_result(bound[1])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        print("rdzv-server stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"rdzv-server: --port must be 0..65535, got {args.port}", file=sys.stderr)
        return 2
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if args.log_format == "json" else _TextFormatter())
    logger = logging.getLogger("rdzv_server")
    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    try:
        store = None if args.state_dir.lower() in ("none", "memory", "") else SqliteStore(args.state_dir)
    except StoreError as exc:
        print(f"rdzv-server: error: {exc}", file=sys.stderr)
        return 1
    if store is None:
        print("rdzv-server: state in memory only (--state-dir none): jobs do not survive a restart",
              file=sys.stderr)
    try:
        asyncio.run(serve(args.host, args.port, store=store, allow_remote_admin=args.allow_remote_admin))
    except StoreError as exc:
        print(f"rdzv-server: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rdzv-server: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
