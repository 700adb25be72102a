"""One client process of `make fuzz`: hypothesis-drawn requests against a real server, checked one by one.

It owns a canary job (3 nodes that never send anything after joining, timers a week long): any
change to the canary comes from a request. A hostile join from a canary node's own instance before
any accepted request carried that node's secret is the server's lost-reply rule, not a forgery: the
fresh secret it hands out becomes the node's. After every refused request aimed at it (and every 200th
request) the canary's JSON view and event count are compared with the last baseline, and a node's
lease age must not drop (a refused request must not renew a lease). An accepted request may change
it: the baseline is taken again, and a canary that requests finished or took a node out is
replaced. Results go to a JSON file for soak.py.

    python -m tests.fuzz.soak_client --port P --index I --requests N --out FILE [--hang-s S]
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
import traceback
from collections import Counter
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz import known_issues, oracle, payloads
from tests.fuzz.operator_requests import any_request
from tests.fuzz.rawhttp import Connection, NoReply, Reply, request_bytes
from tests.fuzz.requests import MSGPACK, Context, Node, Request, body_map, own_instance_join, valid_body

CHUNK = 1000            # examples per hypothesis run (a fresh engine each: its memory stays bounded)
MAX_PROBLEMS = 40       # problem reports kept per kind
PROGRESS_EVERY = 10_000


class FuzzClient:
    def __init__(self, port: int, index: int, hang_s: float) -> None:
        self.conn = Connection("127.0.0.1", port, timeout=hang_s)
        self.check_conn = Connection("127.0.0.1", port, timeout=hang_s)
        self.authority = f"127.0.0.1:{port}"
        self.index = index
        self.canaries = 0
        self.sent = 0
        self.by_status: Counter[str] = Counter()
        self.by_label: dict[str, Counter[str]] = {}
        self.known: Counter[str] = Counter()
        self.problems: dict[str, list[str]] = {}
        self.forged_accepted = 0
        self.lost_reply_rejoins = 0
        self.proven: set[str] = set()        # canary nodes whose secret an accepted request carried
        self.credentials = False
        self.dead = False
        self.ctx = self.new_canary()
        self.baseline = self.read_canary()

    # -- bookkeeping --
    def problem(self, kind: str, text: str) -> None:
        kept = self.problems.setdefault(kind, [])
        if len(kept) < MAX_PROBLEMS:
            kept.append(text if len(text) <= 4000 else text[:1500] + " [...] " + text[-2500:])
        kept_count = self.by_status
        kept_count[f"problem:{kind}"] += 1

    def get(self, path: str) -> Reply:
        return self.check_conn.send(request_bytes("GET", path, [], host=self.authority, content_length=False))

    # -- the canary --
    def new_canary(self) -> Context:
        self.canaries += 1
        self.proven = set()
        ctx = Context(self.authority, f"canary-{self.index}-{self.canaries}", ())
        nodes = []
        for name in ("node-a", "node-b", "node-c"):
            node = Node(name, secrets.token_hex(6), None)
            request = Request("POST", f"/v1/jobs/{ctx.job_id}/join", (("Content-Type", MSGPACK),),
                              payloads.packb(valid_body(ctx, "join", node)), "setup.join", "agent", host=self.authority)
            reply = self.check_conn.send(request.to_bytes())
            status = oracle.agent_status(reply)
            if reply.status != 200 or status is None:
                raise RuntimeError(f"canary join refused: {reply.status} {reply.body[:300]!r}")
            nodes.append(replace(node, credential=status.get("credential")))
            ctx = replace(ctx, nodes=tuple(nodes), round_id=status["round_id"])
        self.credentials = any(n.credential for n in nodes)
        return ctx

    def read_canary(self) -> dict[str, Any]:
        view = json.loads(self.get(f"/v1/jobs/{self.ctx.job_id}").body)
        events = json.loads(self.get(f"/v1/jobs/{self.ctx.job_id}/events").body)["events"]
        ages = {}
        for group in ("nodes", "waiting", "spares", "excluded"):
            for node in view.get(group, []):
                ages[node["node_id"]] = node.pop("lease_age_s")
        view.pop("last_call_ends_in_s", None)
        return {"view": view, "ages": ages, "last_seq": events[-1]["seq"] if events else 0}

    def live_nodes(self) -> set[str]:
        view = self.baseline["view"]
        return {n["node_id"] for g in ("nodes", "waiting", "spares", "excluded") for n in view.get(g, [])}

    def check_canary(self, request: Request | None, reply: Reply | None) -> None:
        now = self.read_canary()
        before = self.baseline
        changed = [k for k in set(now["view"]) | set(before["view"]) if now["view"].get(k) != before["view"].get(k)]
        if now["last_seq"] != before["last_seq"]:
            changed.append(f"events {before['last_seq']} -> {now['last_seq']}")
        renewed = [n for n, age in now["ages"].items() if age < before["ages"].get(n, 0.0) - 0.002]
        if renewed:
            changed.append(f"lease renewed for {renewed}")
        if changed:
            what = request.describe() if request else "(no single request: found by a periodic check)"
            status = f"{reply.status} {reply.body[:200]!r}" if reply else ""
            self.problem("refused request changed the state", f"{changed} after {status} to {what}")
            self.rebase()

    def rebase(self) -> None:
        """After an accepted request: take the canary as it is now, or a new one when it was spoiled."""
        view = self.read_canary()
        ours = {n.node_id for n in self.ctx.nodes}
        self.baseline = view
        if view["view"]["state"] in ("succeeded", "failed", "closed") or self.live_nodes() != ours:
            self.ctx = self.new_canary()
            self.baseline = self.read_canary()
        else:
            round_id = view["view"]["round_id"]
            self.ctx = replace(self.ctx, round_id=-1 if round_id is None else round_id)

    # -- one request --
    def fire(self, request: Request) -> None:
        if self.dead:
            return
        live = request.node_id in self.live_nodes() and request.job_id == self.ctx.job_id
        node = next((n for n in self.ctx.nodes if n.node_id == request.node_id), None) if live else None
        carries_secret = node is not None and bool(node.credential) \
            and body_map(request).get("credential") == node.credential
        rejoin = node is not None and not carries_secret and node.node_id not in self.proven \
            and own_instance_join(request, node)
        self.sent += 1
        if self.sent % PROGRESS_EVERY == 0:
            print(f"fuzz client {self.index}: {self.sent:,} requests sent", file=sys.stderr, flush=True)
        label = request.label.split("@")[0]
        try:
            reply = self.conn.send(request.to_bytes(), head=request.method == "HEAD")
        except NoReply as exc:
            key = "hang" if exc.hang else "closed"
            self.by_status[key] += 1
            self.by_label.setdefault(label, Counter())[key] += 1
            if exc.hang or not request.framework:
                self.problem("no reply in time" if exc.hang else "connection closed without a reply",
                             f"{exc} to {request.describe()}")
            self.dead = self.check_alive()
            return
        self.by_status[str(reply.status)] += 1
        self.by_label.setdefault(label, Counter())[str(reply.status)] += 1
        for found in oracle.problems(request, reply):
            issue = known_issues.known(request, reply, found)
            if issue is not None:
                self.known[issue] += 1
                if reply.status < 500:
                    continue
            self.problem("5xx" if reply.status >= 500 else "bad reply",
                         f"{found}; reply {reply.status} {reply.body[:300]!r} to {request.describe()}")
        if rejoin and reply.status < 300:
            self.lost_reply_rejoins += 1
            self.follow_secret(request.node_id, (oracle.agent_status(reply) or {}).get("credential"))
        elif request.forged and live and reply.status < 400:
            self.forged_accepted += 1
            if self.credentials:
                self.problem("forged request accepted", request.describe())
        elif carries_secret and reply.status < 300 and node is not None:
            self.proven.add(node.node_id)
        on_canary = request.job_id == self.ctx.job_id
        if on_canary and reply.status < 300 and request.method not in ("GET", "HEAD"):
            self.rebase()
        elif (on_canary and request.method not in ("GET", "HEAD")) or self.sent % 200 == 0:
            self.check_canary(request if on_canary else None, reply if on_canary else None)

    def follow_secret(self, node_id: str | None, credential: str | None) -> None:
        """A lost-reply rejoin gave the node a fresh secret: later requests carry that one."""
        if credential:
            self.ctx = replace(self.ctx, nodes=tuple(replace(n, credential=credential) if n.node_id == node_id
                                                     else n for n in self.ctx.nodes))

    def check_alive(self) -> bool:
        """After a request got no reply: True when the server is gone (nothing answers /healthz)."""
        try:
            return self.get("/healthz").status != 200
        except (NoReply, OSError):
            return True

    def run(self, total: int) -> None:

        strategy: tuple[Context, st.SearchStrategy[Request]] | None = None

        def one(data: st.DataObject) -> None:
            nonlocal strategy
            if strategy is None or strategy[0] is not self.ctx:      # (made once per context: it is validated)
                strategy = (self.ctx, any_request(self.ctx))
            request = data.draw(strategy[1])
            try:
                self.fire(request)
            except Exception:    # a bug of the fuzzer, or a reply it cannot read: reported, not fatal
                self.problem("fuzzer error", f"{traceback.format_exc()} on {request.describe()}")
                self.rebase()

        while self.sent < total and not self.dead:
            # Exactly the examples still wanted: every example draws a request (hypothesis checks that
            # an example draws the same way when it is run again).
            chunk = settings(max_examples=min(CHUNK, total - self.sent), database=None, deadline=None,
                             phases=[Phase.generate], suppress_health_check=list(HealthCheck))(given(st.data())(one))
            chunk()
        if not self.dead:
            self.check_canary(None, None)

    def results(self) -> dict[str, Any]:
        return {"sent": self.sent, "by_status": dict(self.by_status),
                "by_label": {k: dict(v) for k, v in self.by_label.items()}, "known": dict(self.known),
                "problems": self.problems, "forged_accepted": self.forged_accepted,
                "lost_reply_rejoins": self.lost_reply_rejoins, "credentials": self.credentials,
                "canaries": self.canaries, "canary": self.ctx.job_id, "dead": self.dead}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hang-s", type=float, default=20.0)
    args = p.parse_args()
    started = time.monotonic()
    client = FuzzClient(args.port, args.index, args.hang_s)
    try:
        client.run(args.requests)
    except BaseException:        # a bug of the fuzzer (or an unreadable reply): reported, not lost
        client.problem("fuzzer error", traceback.format_exc())
        raise
    finally:
        out = client.results() | {"seconds": time.monotonic() - started}
        with open(args.out, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
