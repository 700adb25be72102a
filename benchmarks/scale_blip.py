"""The server-blip scenario of `bench_scale.py` (issue 26): one job of N simulated nodes, formed and
steady, then every packet to and from the server's port dropped for a few seconds (an nftables rule on
the loopback interface: TCP sees a silent path, as in a switch blip), then healed.

What it reports:
- `back_s`: heal -> the server holds as many long-polls as before the blip (`rdzv_open_long_polls`,
  sampled every SAMPLE_S; the 99 % mark beside it), and when the nodes sent their polls again;
- the server's event loop after the heal: its own stall gauge (`rdzv_event_loop_lag_max_seconds`,
  before and after: a rise is a stall in the blip or the return) and /healthz answer times sampled
  every PROBE_EVERY_S for PROBE_FOR_S from the heal, on a connection of the controller's;
- the nodes' path checks and resent polls (scale_fleet.py follows client/path_check.py);
- spurious losses: nodes lost, rounds beyond the first, rejoins (0 of each is the target).
"""
from __future__ import annotations

import contextlib
import http.client
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks._server import running_server
from benchmarks.scale_clients import Clients, make_specs
from benchmarks.scale_probe import ServerSampler, load, server_counters
from benchmarks.scale_scenarios import Settings, _all_times, _formation, _losses, _pct, _phase, _tallies, _wait_holding

SAMPLE_S = 0.1
PROBE_EVERY_S = 0.02
PROBE_FOR_S = 5.0
BACK_TIMEOUT_S = 60.0
TABLE = "rdzv_bench_blip"


@contextlib.contextmanager
def dropped(port: int) -> Iterator[None]:
    """Every TCP packet to or from `port` on this machine dropped while inside (root, nftables)."""
    rules = (f"add table inet {TABLE}\n"
             f"add chain inet {TABLE} input {{ type filter hook input priority -10; }}\n"
             f"add rule inet {TABLE} input tcp dport {port} drop\n"
             f"add rule inet {TABLE} input tcp sport {port} drop\n")
    subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True)
    try:
        yield
    finally:
        subprocess.run(["nft", "delete", "table", "inet", TABLE], check=False)


class HealthProbe:
    """/healthz answer times on one keep-alive connection, every PROBE_EVERY_S, in a thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.times: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self._stop.wait(PROBE_EVERY_S):
            t0 = time.monotonic()
            try:
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                self.times.append(time.monotonic() - t0)
            except (OSError, http.client.HTTPException):
                self.failures += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.close()

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        t = self.times
        if not t:
            return {"samples": 0, "failures": self.failures}
        return {"samples": len(t), "failures": self.failures, "p50_ms": round(1000 * _pct(t, 0.5), 1),
                "p99_ms": round(1000 * _pct(t, 0.99), 1), "max_ms": round(1000 * max(t), 1)}


def _until(count: Callable[[], int], want: int, healed: float) -> tuple[dict[str, Any], list[int]]:
    """Heal -> `count()` reaches `want`, and 99 % of it, sampled every SAMPLE_S for up to
    BACK_TIMEOUT_S: the marks (None: never) and every count seen."""
    marks: dict[str, Any] = {"back_99pct_s": None, "back_s": None}
    seen: list[int] = []
    while time.monotonic() - healed < BACK_TIMEOUT_S:
        seen.append(count())
        since = round(time.monotonic() - healed, 2)
        if marks["back_99pct_s"] is None and seen[-1] >= 0.99 * want:
            marks["back_99pct_s"] = since
        if seen[-1] >= want:
            marks["back_s"] = since
            break
        time.sleep(SAMPLE_S)
    return marks, seen


def _until_back(port: int, steady: int, healed: float) -> dict[str, Any]:
    """Heal -> the server holds as many long-polls as before the blip (`steady`: a few nodes are always
    between two polls), and 99 % of that."""
    marks, seen = _until(lambda: int(server_counters(port)["open_long_polls"]), steady, healed)
    return {**marks, "polls_held_before": steady, "fewest_polls_held": min([steady, *seen])}


def _resent(before: list[dict], after: list[dict], healed: float) -> dict[str, Any]:
    """The polls sent again after a path check: how many, and how long after the heal (those after it)."""
    times = [t for a, b in zip(before, after, strict=True) for t in b["resent"][len(a["resent"]):]]
    late = sorted(t - healed for t in times if t >= healed)
    out: dict[str, Any] = {"polls_resent": len(times), "resent_after_heal": len(late),
                           "path_checks": sum(b["path_checks"] - a["path_checks"]
                                              for a, b in zip(before, after, strict=True))}
    if late:
        out.update(resent_p50_s=round(_pct(late, 0.5), 3), resent_p99_s=round(_pct(late, 0.99), 3),
                   resent_max_s=round(late[-1], 3))
    return out


def blip(n: int, s: Settings, blip_s: float = 5.0, label: str = "blip") -> dict[str, Any]:
    job = f"scale-{n}"
    per_client, _ = make_specs({job: n}, s.clients, s.per_address, s.witness_port)
    with open("/proc/sys/net/core/somaxconn") as f:       # the server's accept backlog is capped at it
        somaxconn = int(f.read())
    out: dict[str, Any] = {"kind": label, "nodes": n, "jobs": 1, "clients": s.clients, "blip_s": blip_s,
                           "server_args": s.server_args, "somaxconn": somaxconn, "load_start": load()}
    pids: list[int] = []
    with running_server(*s.server_args, pids=pids) as port, ServerSampler(pids[0]) as sampler, \
            Clients(port, per_client) as clients:
        m0 = sampler.mark()
        clients.ask({"cmd": "start"})
        formed = _wait_holding(clients, {job: 1}, n, s.formation_timeout_s)
        out["formation"] = {"complete": formed, **_formation(_all_times(clients, job), m0["t"])}
        time.sleep(s.settle_s)
        before = server_counters(port)
        out["before"] = {"open_long_polls": before["open_long_polls"],
                         "loop_lag_max_ms": round(1000 * before["loop_lag_max_s"], 1)}
        m1, c1 = sampler.mark(), clients.ask({"cmd": "window"})
        with dropped(port):
            time.sleep(blip_s)          # the blip itself: its length is the scenario
        healed = time.monotonic()
        with HealthProbe(port) as probe:
            out["return"] = _until_back(port, before["open_long_polls"], healed)
            time.sleep(max(0.0, PROBE_FOR_S - (time.monotonic() - healed)))
        out["return"]["healthz_after_heal"] = probe.summary()
        m2, c2 = sampler.mark(), clients.ask({"cmd": "window"})
        out["return"].update(_phase(m1, m2, c1, c2))
        out["return"].update(_resent(c1, c2, healed))
        time.sleep(s.post_s)            # room for a late loss to show
        c3 = clients.ask({"cmd": "window"})
        out["losses"] = _losses(port, [job], 1, _tallies(c3))
        after = server_counters(port)
        out["return"]["loop_lag_max_ms_after"] = round(1000 * after["loop_lag_max_s"], 1)
        out["server_rss_peak_mib"] = round(sampler.peak_rss / 2 ** 20, 1)
    out["load_end"] = load()
    return out
