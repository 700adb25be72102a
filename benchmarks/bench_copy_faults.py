"""Issue 53's targets: no work lost when an agent restarts, and no peer can take a node down. A real rdzv-server
(TLS) and three node-agents on loopback (each its own failure domain, certificates for their copies, a 3 s lease),
2 gloo workers per node running benchmarks/scripts/shard_train.py (1 MB of state per rank, a snapshot every 5
steps of about 0.1 s). Node b's agent runs with RLIMIT_NOFILE 1024 (soft and hard: it cannot raise it).

  --restart N   node b's agent SIGKILLed two steps after a snapshot and started again under its own --node-id, N
                times with its memory left in place and N times with it removed (a new host under the same id),
                alternated: the step every rank resumed from against the newest snapshot all ranks held, the
                source, own shards, kill -> every rank stepping, and its first copy after it resumed in its
                holder's store (which of its snapshots, how long after every rank stepped)
  --nnodes S    the --restart job's size: 3 (default), or 2:3 (elastic: the job waits for b rather than shrinking)
  --signal S    how --restart stops b's agent: KILL (default: an OOM kill, a crash) or TERM (`systemctl restart`:
                it stops its workers and leaves, saying it was stopped)
  --slow-stop S node b's workers take S seconds to stop on SIGTERM (a script saving a checkpoint as it stops;
                its agent's --stop-timeout S + 2): with --signal TERM, longer than the job's window (4 s) if S > 4
  --flood S     S seconds of 2,000 idle connections to each of node b's ports (its TLS copy port and its plain
                witness port), from 100 loopback addresses, each one closed opened again: whether the agent lives,
                the job's restarts, node b's descriptors at most, how soon a connection that never says a word is
                closed, and after the attack a witness question answered and node b's next copy landed
  --lines       300 connections each sending a 2 MiB line to node b's plain port: its RSS 10 s before (the control:
                its own drift), before, at most, 10 s after
  --ahead       a push of step 10^18-1 with node b's valid token (read from its holder's store) to its holder
  --busy N      both cores busy, N pushes to node b's plain port whose request line comes 0-0.6 s after the
                connect (a loaded sender): how many were answered as a witness probe

Run: .venv/bin/python benchmarks/bench_copy_faults.py [--restart 10] [--flood 15] [--lines] [--ahead] [--busy 1000]
     (make bench-copy-faults)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._flood import ask as _ask  # noqa: E402
from benchmarks._flood import flood as _flood  # noqa: E402
from benchmarks._server import running_server  # noqa: E402
from benchmarks.bench_node_loss import Job as ShardJob  # noqa: E402
from benchmarks.bench_node_loss import _stepping, _workdir  # noqa: E402
from benchmarks.bench_places import FAST, wait  # noqa: E402
from node_agent.copies import wire  # noqa: E402
from node_agent.workers.memory import COPIES, dir_name  # noqa: E402
from tests.e2e.certs import make_ca, make_server_cert  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "scripts", "shard_train.py")
ENV = {"STATE_MB": "1", "STEP_S": "0.1", "SNAP_EVERY": "5", "DISK_EVERY": "0"}
SHM = f"/dev/shm/node-agent-mem-{os.getuid()}"
NOFILE = 1024


class Job(ShardJob):
    """bench_node_loss's job, over TLS, with node b's agent at RLIMIT_NOFILE 1024."""

    def __init__(self, port: int, job: str, out: str, certs: tuple[str, str, str], extra: tuple[str, ...] = (),
                 nnodes: str = "3", slow_stop: float = 0.0) -> None:
        ca, cert, key = certs
        super().__init__(port, job, out, nnodes, ("--tls-ca", ca, "--tls-cert", cert, "--tls-key", key, *extra))
        self.ca, self.slow_stop = ca, slow_stop

    def start(self, node: str) -> None:
        slow = node == "b" and self.slow_stop > 0
        env = dict(os.environ, PYTHONPATH=ROOT, OUT_DIR=self.out, NODE=node, **ENV,
                   **({"TERM_SAVE_S": f"{self.slow_stop:g}"} if slow else {}))
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))) if node == "b" else None
        with open(os.path.join(self.out, f"agent-{node}.log"), "a") as log:
            self.agents[node] = subprocess.Popen(
                [sys.executable, "-m", "node_agent.main", "--endpoint", f"https://127.0.0.1:{self.port}", "--nnodes",
                 self.nnodes, "--nproc", "2", "--job-id", self.job, "--node-id", node, "--max-restarts", "5",
                 "--failure-domain", f"rack-{node}", *FAST, *self.extra,
                 *(("--stop-timeout", f"{self.slow_stop + 2:g}") if slow else ()), SCRIPT],
                env=env, cwd=self.out, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit)

    def view(self) -> dict:
        context = ssl.create_default_context(cafile=self.ca)
        with urllib.request.urlopen(f"https://127.0.0.1:{self.port}/v1/jobs/{self.job}", timeout=10,
                                    context=context) as resp:
            return dict(json.load(resp))

    def node(self, node: str) -> dict:
        return next((n for n in self.view()["nodes"] if n["node_id"] == node), {})

    def copies(self, node: str) -> dict:
        return dict(self.node(node).get("copies") or {})

    def top_step(self) -> int:
        return max((s for _, s, *_ in self.steps()), default=0)


def _certs(where: str) -> tuple[str, str, str]:
    ca = make_ca(where)
    cert, key = make_server_cert(where, ca)
    return ca[0], cert, key


@contextlib.contextmanager
def running_job(name: str, extra: tuple[str, ...] = (), nnodes: str = "3", slow_stop: float = 0.0) -> Iterator[Job]:
    with _workdir() as out:
        certs = _certs(out)
        with running_server("--tls-cert", certs[1], "--tls-key", certs[2]) as port:
            job = Job(port, name, out, certs, extra, nnodes, slow_stop)
            try:
                for n in ("a", "b", "c"):
                    job.start(n)
                wait(lambda: len({r for *_, r, _ in job.steps()}) == 6, 120, "the first world")
                wait(lambda: job.copies("b").get("copied_step", -1) >= 10, 120, "node b's copies")
                yield job
            finally:
                job.stop()


def restart_runs(n: int, nnodes: str, how: signal.Signals = signal.SIGKILL, slow_stop: float = 0.0) -> list[dict]:
    rows = []
    # One job, node b's agent restarted 2N times in minutes: flap damping (a node lost twice in 10 minutes is kept
    # out 5 minutes: --exclude-lost-after) is off, or the job would rightly keep b out from its second restart.
    with running_job("restart", ("--exclude-lost-after", "0"), nnodes, slow_stop) as job:
        for i in range(2 * n):
            memory = "kept" if i % 2 == 0 else "gone"
            rows.append(one_restart(job, i, memory, how))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def one_restart(job: Job, i: int, memory: str, how: signal.Signals = signal.SIGKILL) -> dict:
    """Kill (or stop: `how`) b's agent two steps past a snapshot (its last one copied), restart it under its own id.
    Its memory "gone": removed before the restart."""
    wait(lambda: (c := job.copies("b")).get("copied_step", -2) == c.get("local_step", -1), 120, "b's copies caught up")
    now = job.top_step()
    target = now + 1 + (2 - (now + 1)) % 5
    wait(lambda: job.top_step() >= target, 120, f"step {target}")
    low = min(max(s for _, s, _, _, r, _ in job.steps() if r == rank) for rank in range(6))
    held = low - low % 5     # the newest snapshot every rank held at the kill (two steps back: its save is done)
    logged, logged_a = len(job.log("b")), len(job.log("a"))
    killed_at = time.time()
    job.agents["b"].send_signal(how)
    job.agents["b"].wait()
    left = os.path.isdir(os.path.join(SHM, dir_name(job.job, "b")))     # a stopped agent keeps it when told to
    if memory == "gone" and left:
        shutil.rmtree(os.path.join(SHM, dir_name(job.job, "b")))
    job.start("b")
    wait(lambda: len(job.resumed(killed_at)) == 6 and _stepping(job, killed_at), 120, "every rank again")
    resumed, first = job.resumed(killed_at), _stepping(job, killed_at)
    step = min(int(v[0]) for v in resumed.values())
    stepping = max(first.values())
    log = job.log("b")[logged:]
    row = {"run": i, "signal": how.name, "memory": memory, "memory_left": left, "killed_after_step": low,
           "newest_held": held, "waited": "waiting up to" in job.log("a")[logged_a:],
           "steps": sorted({int(v[0]) for v in resumed.values()}), "sources": sorted({v[1] for v in resumed.values()}),
           "own_shards": sum(v[2] == "ok" for v in resumed.values()),
           "stepping_again_s": round(max(first.values()) - killed_at, 2),
           "took_up": log.count("kept the memory of node b's previous agent"), "fetched": log.count("fetched node b")}
    try:
        holder = os.path.join(SHM, dir_name(job.job, _holder_of(job, "b")[0]), COPIES, "b")
    except RuntimeError as exc:         # (b not where it was: the job went on without it)
        return {**row, "copies": str(exc)}
    held_at = wait(lambda: _newest_held(holder) > step and time.time(), 120, "b's next copy on its holder")
    landed = _newest_held(holder)         # b's first snapshot after it resumed, in its holder's store
    view = wait(lambda: (c := job.copies("b")).get("sent_bytes", 0) > 0 and c.get("copied_step", -1) >= landed
                and c, 120, "b's copies in the server's view")
    assert isinstance(view, dict)
    return {**row, "first_copy_after_resume": landed, "its_snapshots_after_resume": (landed - step) // 5,
            "copy_after_stepping_s": round(float(held_at) - stepping, 2),  # type: ignore[arg-type]
            "refused_after": view.get("refused", 0)}


def ports_of(pid: int) -> tuple[int, int]:
    """(plain witness port, TLS copy port) of an agent: its listening sockets, told apart by a witness question."""
    listening = sorted(c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN")
    plain = next(p for p in listening if _ask(p).startswith(b"rdzv-agent "))
    return plain, next(p for p in listening if p != plain)


def flood_run(seconds: float) -> dict:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))       # the attacker needs 4,000 and more
    with running_job("flood") as job:
        pid = job.agents["b"].pid
        plain, tls = ports_of(pid)
        restarts_before = job.view()["restart_count"]
        step_before = job.top_step()
        fds: list[int] = []
        sampling = True

        def sample() -> None:
            while sampling:
                with contextlib.suppress(psutil.Error):
                    fds.append(psutil.Process(pid).num_fds())
                time.sleep(0.05)   # a sampler's period
        import threading
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        attack = asyncio.run(_flood((plain, tls), 2000, seconds))
        ended = time.monotonic()
        answered = wait(lambda: _ask(plain, "127.0.0.250").startswith(b"rdzv-agent in-contact"), 30, "a witness answer")
        answer_s = time.monotonic() - ended
        held = os.path.join(SHM, dir_name(job.job, "b"), COPIES)
        source = next(n for n in os.listdir(held))       # the node whose copies b holds
        during = job.copies(source)
        landed = wait(lambda: _newest_held(os.path.join(held, source)) > during.get("copied_step", -1)
                      and time.monotonic(), 60, f"node {source}'s next copy on b")   # in b's store: no poll between
        copy_s = float(landed) - ended  # type: ignore[arg-type]
        sampling = False
        sampler.join()
        alive = job.agents["b"].poll() is None
        return {"seconds": seconds, "ports": {"plain": plain, "tls": tls}, **attack, "agent_alive": alive,
                "restarts": job.view()["restart_count"] - restarts_before,
                "steps_during": job.top_step() - step_before, "fds_max": max(fds, default=0),
                "witness_answer_after_s": round(answer_s, 2) if answered else None,
                "source_on_b": source, "its_copies_as_the_attack_ended": during,
                "its_next_copy_on_b_after_s": round(copy_s, 2),
                "said": [ln for ln in job.log("b").splitlines() if "descriptors" in ln][:3]}


def _newest_held(node_dir: str) -> int:
    """The newest step a holder holds of every rank of a node (its store's files), -1: none."""
    steps = []
    for rank in [r for r in os.listdir(node_dir) if r.isdigit()] if os.path.isdir(node_dir) else []:
        names = set(os.listdir(os.path.join(node_dir, rank)))
        steps.append(max((int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()
                          and f"{n}.sha256" in names), default=-1))
    return min(steps, default=-1)


def lines_run() -> dict:
    with running_job("lines") as job:
        pid = job.agents["b"].pid
        plain, _ = ports_of(pid)
        proc = psutil.Process(pid)
        time.sleep(30)                   # the agent's RSS settles (its first copies, its step watch)
        quiet = proc.memory_info().rss
        time.sleep(10)                   # the control: how it moves over 10 s without the attack
        before = proc.memory_info().rss
        peak = before
        line = b"x" * (2 << 20)

        def send(k: int) -> None:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", plain), timeout=10, source_address=(f"127.0.0.{2 + k % 10}", 0)) as s:
                s.sendall(line + b"\n")
                s.recv(1)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(send, k) for k in range(300)]
            while not all(f.done() for f in futures):
                peak = max(peak, proc.memory_info().rss)
                time.sleep(0.01)        # sampling the agent's RSS
        done = time.monotonic()
        while time.monotonic() - done < 10:
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.1)
        after = proc.memory_info().rss
        return {"connections": 300, "line_bytes": len(line), "rss_10s_before_mb": round(quiet / 2**20, 1),
                "rss_before_mb": round(before / 2**20, 1),
                "rss_peak_mb": round(peak / 2**20, 1), "rss_after_10s_mb": round(after / 2**20, 1),
                "grew_mb": round((peak - before) / 2**20, 1), "agent_alive": job.agents["b"].poll() is None}


def _holder_of(job: Job, node: str) -> tuple[str, str]:
    """(the holder of `node`'s copies, the token they came with: "" where the holder keeps only its verifier, as
    agents do since the copies' keys were checked by verifiers), from the holder's store on this machine."""
    for holder in ("a", "b", "c"):
        kept = os.path.join(SHM, dir_name(job.job, holder), COPIES, node)
        if os.path.exists(os.path.join(kept, ".verifier")):
            return holder, ""
        if os.path.exists(os.path.join(kept, ".token")):
            with open(os.path.join(kept, ".token")) as f:
                return holder, f.read().strip()
    raise RuntimeError(f"no holder of {node}'s copies")


def _token_of(job: Job, node: str) -> str:
    token = _holder_of(job, node)[1]
    if not token:
        raise RuntimeError(f"{node}'s copy token is not in its holder's store (holders keep only a verifier): "
                           f"--ahead and --busy need it from elsewhere")
    return token


def _push_line(token: str, node: str, step: int, round_id: int) -> bytes:
    return wire.push_line(wire.PushRequest(token, node, 0, step, 10, round_id))


def ahead_run() -> dict:
    with running_job("ahead") as job:
        holder, token = _holder_of(job, "b")[0], _token_of(job, "b")
        _, tls_port = ports_of(job.agents[holder].pid)
        context = ssl.create_default_context(cafile=job.ca)
        context.check_hostname = False
        certs = job.extra
        context.load_cert_chain(certs[3], certs[5])
        round_id = int(job.view()["round_id"])
        began = time.monotonic()
        with socket.create_connection(("127.0.0.1", tls_port), timeout=60) as raw, \
                context.wrap_socket(raw) as s:
            s.sendall(_push_line(token, "b", wire.MAX_STEP, round_id))
            answer = s.recv(512)
        waited = time.monotonic() - began
        copied = job.copies("b").get("copied_step", -1)
        wait(lambda: job.copies("b").get("copied_step", -1) > copied, 60, "node b's next copy")
        return {"answer": answer.decode(errors="replace").strip(), "answered_after_s": round(waited, 2),
                "b_copies_after": job.copies("b")}


async def _pushes(port: int, token: str, n: int) -> dict:
    witness, replica, other = 0, 0, 0
    gate = asyncio.Semaphore(20)

    async def one(k: int) -> None:
        nonlocal witness, replica, other
        async with gate:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                await asyncio.sleep(random.uniform(0.0, 0.6))      # the sender's line comes late, as under load
                writer.write(_push_line(token, "b", 0, 0))
                line = await asyncio.wait_for(reader.readline(), 10)
                writer.close()
            except (OSError, asyncio.TimeoutError):
                line = b""
            if line.startswith((b"rdzv-agent in-contact", b"rdzv-agent alone")):
                witness += 1
            elif line.startswith(b"rdzv-agent refused") or line == wire.GO:
                replica += 1
            else:
                other += 1

    await asyncio.gather(*(one(k) for k in range(n)))
    return {"pushes": n, "answered_as_witness": witness, "answered_as_copy": replica, "no_answer": other}


def busy_run(n: int) -> dict:
    with running_job("busy") as job:
        token = _token_of(job, "b")
        plain, _ = ports_of(job.agents["c" if _holder_of(job, "b")[0] == "c" else "a"].pid)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        try:
            return asyncio.run(_pushes(plain, token, n))
        finally:
            for b in burners:
                b.kill()
                b.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--restart", type=int, default=0)
    p.add_argument("--nnodes", default="3", help="the --restart job's size (2:3: elastic, awaiting.py's case)")
    p.add_argument("--signal", default="KILL", choices=["KILL", "TERM"], help="how --restart stops b's agent")
    p.add_argument("--slow-stop", type=float, default=0.0, help="b's workers take this long to stop (--restart)")
    p.add_argument("--flood", type=float, default=0.0)
    p.add_argument("--lines", action="store_true")
    p.add_argument("--ahead", action="store_true")
    p.add_argument("--busy", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench-copy-faults.json"))
    args = p.parse_args()
    report: dict = {}
    if args.restart:
        report["restart"] = restart_runs(args.restart, args.nnodes, signal.Signals[f"SIG{args.signal}"],
                                         args.slow_stop)
    if args.flood:
        report["flood"] = flood_run(args.flood)
        print(json.dumps(report["flood"]), flush=True)
    if args.lines:
        report["lines"] = lines_run()
        print(json.dumps(report["lines"]), flush=True)
    if args.ahead:
        report["ahead"] = ahead_run()
        print(json.dumps(report["ahead"]), flush=True)
    if args.busy:
        report["busy"] = busy_run(args.busy)
        print(json.dumps(report["busy"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
