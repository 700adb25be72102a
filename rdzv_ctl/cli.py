"""`rdzv-ctl`: read and steer a running rdzv-server from a shell (`rdzv-ctl --help` lists the commands). The
standard library plus protocol/ (no aiohttp), so it starts fast; HTTP, tokens and TLS are in client.py.
Exit status: 0 done, 1 the server refused or could not be reached (one line on stderr), 2 bad usage."""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from protocol.quoting import one_line
from protocol.views import DrainedView, EventsView, EventView, JobDetail, JobView, NodeView, StatusView
from rdzv_ctl.client import ADMIN_TOKEN_ENV, DEFAULT_SERVER, TOKEN_ENV, Client, CtlError, UsageError, client_for

REASON_WIDTH = 60
T = TypeVar("T")


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _visible(text: str) -> str:
    return one_line(text).replace("\t", "\\t")


def truncate(text: str, width: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 3] + "..."


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def clock(iso_time: str | None) -> str:
    """'2024-05-01T12:34:56.789Z' -> '12:34:56.789' (UTC, as the server sends it)."""
    return iso_time.split("T", 1)[-1].rstrip("Z") if iso_time else "-"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ranks(node: NodeView) -> str:
    first, n = node.rank_offset, node.local_world_size
    if first is None:
        return "-"
    return str(first) if n <= 1 else f"{first}-{first + n - 1}"


# Each table's columns, declared once as (heading, cell) pairs.
Column = tuple[str, Callable[[T], object]]
JOBS: list[Column[JobView]] = [
    ("JOB", lambda j: j.job_id), ("STATE", lambda j: j.state), ("ROUND", lambda j: j.round_id),
    ("WORLD", lambda j: j.world_size), ("NODES", lambda j: f"{j.counts.nodes} ({j.min_nodes}:{j.max_nodes})"),
    ("RESTARTS", lambda j: f"{j.restart_count}/{j.max_restarts}"), ("SPARES", lambda j: j.counts.spares),
    ("EXCLUDED", lambda j: j.counts.excluded), ("REASON", lambda j: truncate(j.reason, REASON_WIDTH))]
MEMBERS: list[Column[NodeView]] = [
    ("RANK", lambda n: n.group_rank), ("NODE", lambda n: n.node_id), ("ADDR", lambda n: n.addr),
    ("WORKERS", lambda n: n.local_world_size), ("RANKS", _ranks), ("LEASE AGE", lambda n: duration(n.lease_age_s)),
    ("WORKER STATE", lambda n: n.worker_state or n.state)]
OTHERS: list[Column[NodeView]] = [
    ("NODE", lambda n: n.node_id), ("ADDR", lambda n: n.addr), ("WORKERS", lambda n: n.local_world_size),
    ("LEASE AGE", lambda n: duration(n.lease_age_s))]
EXCLUDED: list[Column[NodeView]] = [
    ("NODE", lambda n: n.node_id), ("ADDR", lambda n: n.addr), ("EXCLUSIONS", lambda n: n.exclusions),
    ("TIME LEFT", lambda n: duration(n.excluded_for_s)), ("LEASE AGE", lambda n: duration(n.lease_age_s))]
DRAINED: list[Column[DrainedView]] = [("NODE", lambda d: d.node_id), ("REASON", lambda d: d.reason)]
EVENTS: list[Column[EventView]] = [
    ("TIME", lambda e: clock(e.time)), ("KIND", lambda e: e.kind), ("NODE", lambda e: e.node_id),
    ("ROUND", lambda e: e.round_id), ("MESSAGE", lambda e: e.message)]
# The lists after the members: (key, columns, what its cut line calls the rows).
OTHER_LISTS: list[tuple[str, Sequence[Column[Any]], str]] = [
    ("waiting", OTHERS, "waiting"), ("spares", OTHERS, "spares"), ("excluded", EXCLUDED, "excluded nodes"),
    ("drained", DRAINED, "drained nodes")]


def columns_table(columns: Sequence[Column[T]], items: Sequence[T]) -> str:
    """Columns padded to their widest cell, the last not padded; a row per item. Cells may quote what clients sent:
    control characters are escaped, so none can move the cursor or recolour the operator's terminal."""
    rows = [[cell(item) for _, cell in columns] for item in items]
    cells = [[head for head, _ in columns]] + [["-" if c is None else _visible(str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def format_status(doc: StatusView) -> str:
    held = [f"unhealthy host {h.host}: held out {h.held_for_s}s more (node {h.node_id} of job {h.job_id}, "
            f"{h.kind}: {truncate(h.reason, REASON_WIDTH)})" for h in doc.unhealthy_hosts]
    return "\n".join([_format_jobs(doc), *held])


def _format_jobs(doc: StatusView) -> str:
    jobs, total = doc.jobs, doc.total
    if not jobs:
        if total:
            return f"no jobs from offset {doc.offset} (the server holds {_plural(total, 'job')})"
        return f"no jobs on this server (server time {doc.time or '?'})"
    out = columns_table(JOBS, jobs)
    if doc.offset or len(jobs) < total:
        out += f"\njobs {doc.offset + 1}-{doc.offset + len(jobs)} of {total}"
        if doc.next_offset is not None:
            out += f"; next page: rdzv-ctl status --offset {doc.next_offset}"
    return out


def _cut(doc: JobDetail, key: str, what: str) -> list[str]:
    """'N more WHAT (...)' when the server sent only part of a node list."""
    shown, count, offset = len(getattr(doc, key)), getattr(doc.counts, key), doc.node_offset
    if offset + shown >= count:
        return [] if not offset or shown else [f"(no {what} from {offset}: {count} in all)"]
    return [f"... {count - offset - shown} more {what} (rdzv-ctl job {doc.job_id} --node-offset {offset + shown})"]


def format_job(doc: JobDetail) -> str:
    out = [f"job        {doc.job_id}",
           f"state      {doc.state}" + (f" since {doc.finished_at}" if doc.finished_at else ""),
           f"reason     {_visible(doc.reason or '-')}",
           f"round      {doc.round_id if doc.round_id is not None else '-'}: "
           f"{_plural(doc.group_world_size, 'node')}, world size {doc.world_size} "
           f"(nodes {doc.min_nodes}:{doc.max_nodes})",
           f"restarts   {doc.restart_count}/{doc.max_restarts}",
           f"created    {doc.created_at or '-'}"]
    if doc.last_call_ends_in_s is not None:
        out.append(f"last call  ends in {duration(max(0.0, doc.last_call_ends_in_s))}")
    out.append("")
    if doc.nodes:
        out.append(columns_table(MEMBERS, doc.nodes))
    elif not doc.counts.nodes:
        out.append("no round running")
    out += _cut(doc, "nodes", "members")
    for key, columns, what in OTHER_LISTS:
        if getattr(doc, key):
            out += ["", f"{key}:", columns_table(columns, getattr(doc, key))]
        out += _cut(doc, key, what)
    if failure := doc.last_failure:
        how = f"signal {failure.signal}" if failure.signal else f"exit code {failure.exitcode}"
        text = f"rank {failure.rank} (local {failure.local_rank}) on " \
               f"{failure.host or failure.node_id}: {failure.reason or 'exited'}, {how}"
        if failure.message:
            text += f": {_visible(failure.message)}"
        out += ["", f"last failure  {text}"]
    return "\n".join(out)


def format_events(doc: EventsView, last: int | None) -> str:
    events = doc.events
    if last is not None:       # the server already kept only the last N; an older one sends them all
        events = events[-last:] if last > 0 else []
    if not events:
        return f"no events for job {doc.job_id}"
    return columns_table(EVENTS, events)


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
        doc = client.post(f"/v1/admin/jobs/{job}/nodes/{_quote(args.node)}/drain", {"reason": args.reason})
        done = f"drained node {args.node} from job {args.job}"
    elif cmd == "clear":
        doc = client.post(f"/v1/admin/jobs/{job}/nodes/{_quote(args.node)}/clear-exclusion", {})
        done = f"cleared node {args.node} in job {args.job}: it may join again"
    elif cmd == "close":
        doc = client.post(f"/v1/admin/jobs/{job}/close", {"reason": args.reason})
        done = f"closed job {args.job}"
    else:   # resize
        doc = client.post(f"/v1/admin/jobs/{job}/resize", args.nnodes)
        done = f"resized job {args.job} to nodes {doc['min_nodes']}:{doc['max_nodes']}"
    return json.dumps(doc, indent=2) if args.json else f"{done}\n\n{format_job(typed(doc, JobDetail))}"


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
            parser.add_argument(operand.lower(), metavar=operand)
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
