"""`rdzv-ctl`: read and steer a running rdzv-server from a shell (`rdzv-ctl --help` lists the commands). The
standard library plus protocol/ (no aiohttp), so it starts fast; HTTP, tokens and TLS are in client.py, the text
it prints in tables.py.
Exit status: 0 done, 1 the server refused or could not be reached (one line on stderr), 2 bad usage."""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from protocol.ids import job_id_problem, node_id_problem
from protocol.quoting import one_line
from protocol.views import NODE_LIMIT_MAX, EventsView, JobDetail, StatusView
from rdzv_ctl.client import ADMIN_TOKEN_ENV, DEFAULT_SERVER, TOKEN_ENV, Client, CtlError, UsageError, client_for
from rdzv_ctl.tables import format_events, format_job, format_status

T = TypeVar("T")


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def _nnodes(text: str) -> dict[str, int]:
    """'2:4' -> both; '3' -> 3:3; '2:' or ':4' -> only the given side (the server keeps the other)."""
    lo, sep, hi = text.partition(":")
    try:
        body = {"min_nodes": int(lo)} if lo else {}
        if sep and hi:
            body["max_nodes"] = int(hi)
        elif not sep:
            body["max_nodes"] = body["min_nodes"]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"expected MIN:MAX, N, MIN: or :MAX with whole numbers, got {text!r}") from None
    if not body:
        raise argparse.ArgumentTypeError(f"give at least one of MIN and MAX, got {text!r}")
    if body.get("min_nodes", 0) > body.get("max_nodes", body.get("min_nodes", 0)):
        raise argparse.ArgumentTypeError(f"MIN is larger than MAX in {text!r}")
    return body


def typed(doc: Any, kind: type[T]) -> T:
    """The server's JSON document as the view it is; one line when it is not (a server of another version)."""
    try:
        return msgspec.convert(doc, kind)
    except msgspec.ValidationError as exc:
        raise CtlError(f"the server's reply is not the {kind.__name__} this rdzv-ctl reads (another version?): "
                       f"{exc}") from None


def _query(**params: int | None) -> str:
    given = {k: v for k, v in params.items() if v is not None}
    return "?" + urllib.parse.urlencode(given) if given else ""


def run(args: argparse.Namespace, client: Client) -> str:
    cmd = args.command
    if cmd == "status":
        doc = client.get("/v1/status" + _query(offset=args.offset, limit=args.limit))
        return json.dumps(doc, indent=2) if args.json else format_status(typed(doc, StatusView))
    if cmd == "clear-unhealthy":
        doc = client.post(f"/v1/admin/hosts/{_quote(args.host)}/clear-unhealthy", {})
        return json.dumps(doc, indent=2) if args.json else f"cleared host {args.host}: it may join again"
    job = _quote(args.job)
    if cmd == "job":
        doc = client.get(f"/v1/jobs/{job}" + _query(node_offset=args.node_offset, node_limit=args.node_limit))
        return json.dumps(doc, indent=2) if args.json else format_job(typed(doc, JobDetail))
    if cmd == "events":
        doc = client.get(f"/v1/jobs/{job}/events" + _query(after=args.after, limit=args.last))
        return json.dumps(doc, indent=2) if args.json else format_events(typed(doc, EventsView), args.last)
    if cmd == "drain":
        before = typed(client.get(f"/v1/jobs/{job}" + _query(node_limit=NODE_LIMIT_MAX)), JobDetail)
        doc = client.post(f"/v1/admin/jobs/{job}/nodes/{_quote(args.node)}/drain", {"reason": args.reason})
        done = _drained(before, args.node, args.job) + _swapped_at_snapshot(doc, args.node) + _short_after_drain(doc)
    elif cmd == "clear":
        doc = client.post(f"/v1/admin/jobs/{job}/nodes/{_quote(args.node)}/clear-exclusion", {})
        done = f"cleared node {args.node} in job {args.job}: it may join again"
    elif cmd == "close":
        doc = client.post(f"/v1/admin/jobs/{job}/close", {"reason": args.reason})
        done = f"closed job {args.job}"
    else:   # resize
        doc = client.post(f"/v1/admin/jobs/{job}/resize", args.nnodes)
        done = f"resized job {args.job}"
    if args.json:
        return json.dumps(doc, indent=2)
    view = typed(doc, JobDetail)      # read as a view first: a reply of another shape is one line, no KeyError
    if cmd == "resize":
        done += f" to nodes {view.min_nodes}:{view.max_nodes}"
    return f"{done}\n\n{format_job(view)}"


def _drained(job: JobDetail, node: str, job_arg: str) -> str:
    """What a drain did: a node drained already stays so with its first reason (the server changes nothing)."""
    first = next((d.reason for d in job.drained if d.node_id == node), None)
    if first is not None:
        return f"node {node} was drained already from job {job_arg} (its reason stands: {one_line(first)})"
    return f"drained node {node} from job {job_arg}" + _absent(job, node, job_arg)


def _absent(job: JobDetail, node: str, job_arg: str) -> str:
    """A drain of a node in none of the job's lists is accepted (it is kept out when it comes), but a mistyped id
    must not read as a success: said, unless the lists were cut (the node may be in a part not shown)."""
    listed = {n.node_id for n in (*job.nodes, *job.waiting, *job.spares, *job.excluded)}
    if job.lists_cut or node in listed or any(d.node_id == node for d in job.drained):
        return ""
    return (f" (it is not in the job now: it will be kept out if it comes; a mistyped id? "
            f"undo with `rdzv-ctl clear {job_arg} {node}`)")


def _swapped_at_snapshot(doc: Any, node: str) -> str:
    """A drained member still listed among the job's nodes goes at the job's next snapshot (a spare takes its place
    then, fetching from it: core/swaps.py): said, or the operator would take it for a drain that did nothing."""
    job = typed(doc, JobDetail)
    if not any(n.node_id == node for n in (*job.nodes, *job.excluded)) or all(d.node_id != node for d in job.drained):
        return ""
    return ("; a spare takes its place at the job's next snapshot, fetching it from the node, which then goes "
            "(nothing is trained again)")


def _short_after_drain(doc: Any) -> str:
    """What a drain cost, said with it: a job left below its minimum runs nothing until nodes come, and fails if too
    few are ready within its join timeout (the server accepts the drain: the operator may mean to add a node)."""
    job = typed(doc, JobDetail)
    have, least = job.counts.nodes + job.counts.waiting + job.counts.spares, job.config.min_nodes
    if job.state != "waiting" or have >= least:
        return ""
    return (f"; the job has {have} of its minimum {least} nodes: it runs nothing until nodes join, "
            f"and fails if too few are ready within its join timeout ({job.config.join_timeout_s:g}s)")


def _checked(problem: Callable[[str], str]) -> Callable[[str], str]:
    """An operand checked by the server's own id rule: a wrong id is bad usage, said before any request (an empty one
    made the server answer "no route")."""
    def check(text: str) -> str:
        if why := problem(text):
            raise argparse.ArgumentTypeError(why)
        return text
    return check


def _positive(text: str) -> int:
    n = _count(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    # Connection options are accepted before or after the command (`rdzv-ctl status --json`).
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="URL", default=argparse.SUPPRESS,
                       help=f"server URL (default: $RDZV_SERVER or {DEFAULT_SERVER})")
    where.add_argument("--endpoint", metavar="HOST:PORT", default=argparse.SUPPRESS,
                       help="server as node-agent's --endpoint spells it (replicas: a:29400,b:29400)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the server's JSON instead of tables")
    common.add_argument("--timeout", type=_seconds, default=argparse.SUPPRESS, metavar="S",
                        help="seconds to wait for the server (default 10)")
    common.add_argument("--token-file", metavar="F", default=argparse.SUPPRESS,
                        help=f"file holding the server's token, for reading (or set ${TOKEN_ENV})")
    common.add_argument("--admin-token-file", metavar="F", default=argparse.SUPPRESS,
                        help=f"file holding the server's admin token, for drain/clear/close/resize "
                             f"(or set ${ADMIN_TOKEN_ENV}); it reads too")
    common.add_argument("--tls-ca", metavar="F", default=argparse.SUPPRESS,
                        help="CA certificate(s) that signed the server's TLS certificate (https:// servers)")
    p = argparse.ArgumentParser(prog="rdzv-ctl", parents=[common], allow_abbrev=False,
                                description="Inspect and steer jobs on an rdzv-server.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, *operands: str) -> argparse.ArgumentParser:
        """A COMMAND taking the connection options and its `operands` (JOB, NODE, HOST), in order."""
        parser = sub.add_parser(name, parents=[common], help=summary)
        for operand in operands:
            kind = {"JOB": _checked(job_id_problem), "NODE": _checked(node_id_problem)}.get(operand, str)
            parser.add_argument(operand.lower(), metavar=operand, type=kind)
        return parser

    st = command("status", "one page of jobs, one line each")
    st.add_argument("--offset", type=_count, metavar="N", help="skip the first N jobs (the next page)")
    st.add_argument("--limit", type=_positive, metavar="N", help="at most N jobs (the server caps it)")
    jb = command("job", "one job in detail", "JOB")
    jb.add_argument("--node-offset", type=_count, metavar="N", help="skip the first N nodes of each list")
    jb.add_argument("--node-limit", type=_positive, metavar="N", help="at most N nodes per list")
    ev = command("events", "a job's history of rounds and decisions", "JOB")
    ev.add_argument("--last", type=_count, metavar="N",
                    help="at most N events: the newest N (with --after, the first N after SEQ)")
    ev.add_argument("--after", type=_count, metavar="SEQ", help="only events after event number SEQ")
    dr = command("drain", "take a node out of a job (it may not rejoin)", "JOB", "NODE")
    dr.add_argument("--reason", default="", help="why (recorded in the job's events)")
    command("clear", "lift a node's exclusion or drain", "JOB", "NODE")
    co = command("close", "end a job now (its agents exit non-zero)", "JOB")
    co.add_argument("--reason", default="", help="why (recorded in the job's events)")
    rs = command("resize", "change a job's min/max nodes", "JOB")
    rs.add_argument("--nnodes", type=_nnodes, required=True, metavar="MIN:MAX",
                    help="new node range: MIN:MAX, N (= N:N), MIN: or :MAX (keeps the other)")
    command("clear-unhealthy", "let a host held out as unhealthy (it left a job with a broken GPU, ...) join again",
            "HOST")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.json = getattr(args, "json", False)
    try:
        text = run(args, client_for(args))
    except (UsageError, CtlError) as exc:
        print(f"rdzv-ctl: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    try:
        print(text, flush=True)
    except BrokenPipeError:      # `rdzv-ctl events JOB | head`: stop quietly, as the docs of `signal` advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
