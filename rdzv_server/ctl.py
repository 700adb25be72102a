"""`rdzv-ctl`: read and steer a running rdzv-server from a shell.

    rdzv-ctl [--server URL | --endpoint HOST:PORT] [--json] COMMAND ...
      status                          every job, one line each
      job JOB                         one job: its round, members, spares, exclusions, last failure
      events JOB [--last N]           the job's history
      drain JOB NODE [--reason R]     take a node out of the job (it may not rejoin until cleared)
      clear JOB NODE                  lift a node's exclusion or drain
      close JOB [--reason R]          end the job now (its agents exit non-zero)
      resize JOB --nnodes MIN:MAX     change min/max nodes (MIN: or :MAX keeps the other)

Standard library only (argparse, urllib, json), so it starts fast and runs wherever Python does.
Exit status: 0 done, 1 the server refused or could not be reached (one line on stderr), 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any
from collections.abc import Sequence

DEFAULT_SERVER = "http://127.0.0.1:29400"
REASON_WIDTH = 60


class CtlError(Exception):
    """A failure to report in one line (no traceback) and exit 1."""


# -- HTTP -------------------------------------------------------------------------------------------


class Client:
    def __init__(self, server: str, timeout: float) -> None:
        self.server = server.rstrip("/")
        self.timeout = timeout

    def get(self, path: str) -> Any:
        return self._call(urllib.request.Request(self.server + path, headers={"Accept": "application/json"}))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        return self._call(urllib.request.Request(self.server + path, data=data, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"}))

    def _call(self, req: urllib.request.Request) -> Any:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise CtlError(f"server {self.server} refused {req.get_method()} {req.selector}: "
                           f"{_error_text(exc)}") from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or exc.reason
            raise CtlError(f"cannot reach rdzv-server at {self.server}: {reason}") from None
        except (OSError, ValueError) as exc:   # timeouts, resets, a malformed URL
            raise CtlError(f"cannot reach rdzv-server at {self.server}: {exc}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise CtlError(f"server {self.server} answered {req.selector} with something that is not JSON "
                           f"(is it an rdzv-server?)") from None


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        doc = json.loads(exc.read())
        return f"{exc.code} {doc['code']}: {doc['message']}"
    except (ValueError, KeyError, TypeError, OSError):
        return f"HTTP {exc.code} {exc.reason}"


def _server_url(args: argparse.Namespace) -> str:
    if getattr(args, "endpoint", None):
        url = args.endpoint
    else:
        url = getattr(args, "server", None) or os.environ.get("RDZV_SERVER") or DEFAULT_SERVER
    if "://" not in url:
        url = "http://" + url
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise CtlError(f"server address must look like http://HOST:PORT or HOST:PORT, got {url!r}")
    return url


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


# -- formatting -------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; the last column is not padded."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


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
    if not iso_time:
        return "-"
    return iso_time.split("T", 1)[-1].rstrip("Z")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ranks(node: dict[str, Any]) -> str:
    first, n = node.get("rank_offset"), node.get("local_world_size", 0)
    if first is None:
        return "-"
    return str(first) if n <= 1 else f"{first}-{first + n - 1}"


def format_status(doc: dict[str, Any]) -> str:
    jobs = doc.get("jobs", [])
    if not jobs:
        return f"no jobs on this server (server time {doc.get('time', '?')})"
    rows = [(j["job_id"], j["state"], j.get("round_id"), j["world_size"],
             f"{len(j['nodes'])} ({j['min_nodes']}:{j['max_nodes']})",
             f"{j['restart_count']}/{j['max_restarts']}", len(j["spares"]), len(j["excluded"]),
             truncate(j.get("reason", ""), REASON_WIDTH)) for j in jobs]
    return table(("JOB", "STATE", "ROUND", "WORLD", "NODES", "RESTARTS", "SPARES", "EXCLUDED", "REASON"), rows)


def format_job(doc: dict[str, Any]) -> str:
    out = [f"job        {doc['job_id']}",
           f"state      {doc['state']}" + (f" since {doc['finished_at']}" if doc.get("finished_at") else ""),
           f"reason     {doc.get('reason') or '-'}",
           f"round      {doc['round_id'] if doc.get('round_id') is not None else '-'}: "
           f"{_plural(doc['group_world_size'], 'node')}, world size {doc['world_size']} "
           f"(nodes {doc['min_nodes']}:{doc['max_nodes']})",
           f"restarts   {doc['restart_count']}/{doc['max_restarts']}",
           f"created    {doc.get('created_at') or '-'}"]
    if doc.get("last_call_ends_in_s") is not None:
        out.append(f"last call  ends in {duration(max(0.0, doc['last_call_ends_in_s']))}")
    out.append("")
    if doc["nodes"]:
        out.append(table(("RANK", "NODE", "ADDR", "WORKERS", "RANKS", "LEASE AGE", "WORKER STATE"), [
            (n.get("group_rank"), n["node_id"], n["addr"], n["local_world_size"], _ranks(n),
             duration(n["lease_age_s"]), n.get("worker_state", n["state"])) for n in doc["nodes"]]))
    else:
        out.append("no round running")
    for title, key in (("waiting", "waiting"), ("spares", "spares")):
        if doc.get(key):
            out += ["", f"{title}:", table(("NODE", "ADDR", "WORKERS", "LEASE AGE"), [
                (n["node_id"], n["addr"], n["local_world_size"], duration(n["lease_age_s"])) for n in doc[key]])]
    if doc.get("excluded"):
        out += ["", "excluded:", table(("NODE", "ADDR", "EXCLUSIONS", "TIME LEFT", "LEASE AGE"), [
            (n["node_id"], n["addr"], n.get("exclusions"), duration(n.get("excluded_for_s")),
             duration(n["lease_age_s"])) for n in doc["excluded"]])]
    drained = doc.get("drained")
    if drained:   # newer servers list drained nodes; show them when present
        items = drained.items() if isinstance(drained, dict) else \
            [(d.get("node_id"), d.get("reason")) for d in drained]
        out += ["", "drained:", table(("NODE", "REASON"), list(items))]
    failure = doc.get("last_failure")
    if failure:
        how = f"signal {failure['signal']}" if failure.get("signal") else f"exit code {failure.get('exitcode')}"
        text = f"rank {failure.get('rank')} (local {failure.get('local_rank')}) on " \
               f"{failure.get('host') or failure.get('node_id')}: {failure.get('reason', 'exited')}, {how}"
        if failure.get("message"):
            text += f": {failure['message']}"
        out += ["", f"last failure  {text}"]
    return "\n".join(out)


def format_events(doc: dict[str, Any], last: int | None) -> str:
    events = doc.get("events", [])
    if last is not None:
        events = events[-last:] if last > 0 else []
    if not events:
        return f"no events for job {doc.get('job_id')}"
    return table(("TIME", "KIND", "NODE", "ROUND", "MESSAGE"), [
        (clock(e.get("time")), e["kind"], e.get("node_id"), e.get("round_id"), e["message"]) for e in events])


# -- commands ---------------------------------------------------------------------------------------


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


def run(args: argparse.Namespace, client: Client) -> str:
    cmd = args.command
    if cmd == "status":
        doc = client.get("/v1/status")
        return json.dumps(doc, indent=2) if args.json else format_status(doc)
    job = _quote(args.job)
    if cmd == "job":
        doc = client.get(f"/v1/jobs/{job}")
        return json.dumps(doc, indent=2) if args.json else format_job(doc)
    if cmd == "events":
        doc = client.get(f"/v1/jobs/{job}/events")
        if args.json:
            if args.last is not None:
                doc["events"] = doc["events"][-args.last:] if args.last > 0 else []
            return json.dumps(doc, indent=2)
        return format_events(doc, args.last)
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
    return json.dumps(doc, indent=2) if args.json else f"{done}\n\n{format_job(doc)}"


def build_parser() -> argparse.ArgumentParser:
    # Connection options are accepted before or after the command (`rdzv-ctl status --json`).
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="URL", default=argparse.SUPPRESS,
                       help=f"server URL (default: $RDZV_SERVER or {DEFAULT_SERVER})")
    where.add_argument("--endpoint", metavar="HOST:PORT", default=argparse.SUPPRESS,
                       help="server as node-agent's --endpoint spells it")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the server's JSON instead of tables")
    common.add_argument("--timeout", type=_seconds, default=argparse.SUPPRESS, metavar="S",
                        help="seconds to wait for the server (default 10)")
    p = argparse.ArgumentParser(prog="rdzv-ctl", parents=[common], allow_abbrev=False,
                                description="Inspect and steer jobs on an rdzv-server.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", parents=[common], help="every job, one line each")
    sub.add_parser("job", parents=[common], help="one job in detail").add_argument("job", metavar="JOB")
    ev = sub.add_parser("events", parents=[common], help="a job's history of rounds and decisions")
    ev.add_argument("job", metavar="JOB")
    ev.add_argument("--last", type=_count, metavar="N", help="only the last N events")
    dr = sub.add_parser("drain", parents=[common], help="take a node out of a job (it may not rejoin)")
    dr.add_argument("job", metavar="JOB")
    dr.add_argument("node", metavar="NODE")
    dr.add_argument("--reason", default="", help="why (recorded in the job's events)")
    cl = sub.add_parser("clear", parents=[common], help="lift a node's exclusion or drain")
    cl.add_argument("job", metavar="JOB")
    cl.add_argument("node", metavar="NODE")
    co = sub.add_parser("close", parents=[common], help="end a job now (its agents exit non-zero)")
    co.add_argument("job", metavar="JOB")
    co.add_argument("--reason", default="", help="why (recorded in the job's events)")
    rs = sub.add_parser("resize", parents=[common], help="change a job's min/max nodes")
    rs.add_argument("job", metavar="JOB")
    rs.add_argument("--nnodes", type=_nnodes, required=True, metavar="MIN:MAX",
                    help="new node range: MIN:MAX, N (= N:N), MIN: or :MAX (keeps the other)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.json = getattr(args, "json", False)
    try:
        server = _server_url(args)
    except CtlError as exc:
        parser.error(str(exc))        # exits 2, like any other bad usage
    try:
        text = run(args, Client(server, getattr(args, "timeout", 10.0)))
    except CtlError as exc:
        print(f"rdzv-ctl: {exc}", file=sys.stderr)
        return 1
    try:
        print(text, flush=True)
    except BrokenPipeError:      # `rdzv-ctl events JOB | head`: stop quietly, as the docs of `signal` advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
