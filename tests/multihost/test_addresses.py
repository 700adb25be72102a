"""Addresses on a multi-host job: what every node is told to connect to must reach the right host.

- The server on a training host, and that host's agent told `--endpoint 127.0.0.1:PORT`: its agent
  advertises 127.0.0.1; as group rank 0 that becomes every node's MASTER_ADDR, and the other host's
  workers look for the store on their own loopback. Issue 12 asks for a clear error (or a corrected
  address) within seconds, saying which flag fixes it (`--local-addr`), never a silent hang. Either
  outcome passes; what fails is silence.
- Hosts whose name resolves to a loopback address (here every namespace host shares one name that
  maps to 127.0.0.1, like Debian's 127.0.1.1): gloo advertises that address unless
  GLOO_SOCKET_IFNAME names an interface. Issue 12 asks the agent to set it, and to say so.
"""
from __future__ import annotations

import time

import pytest

from tests.e2e.harness import wait_until
from tests.multihost.job import GLOO_IFNAME
from tests.multihost.scenarios import SETUP_LIMIT_S, MissingBehaviour

pytestmark = pytest.mark.multihost

# From the (second) agent's start: a round forms after the last call (3 s), and workers start within
# seconds. Today's behaviour is a hang with no end (the workers' store timeout), so this is loose.
VERDICT_BOUND_S = 30.0


def first_within(bound_s: float, verdict):
    """Poll `verdict()` until it returns something or `bound_s` passes (then None)."""
    deadline = time.time() + bound_s
    found = verdict()
    while found is None and time.time() < deadline:
        time.sleep(0.2)
        found = verdict()
    return found


def test_loopback_endpoint_on_a_multi_host_job_fails_clearly_within_seconds(multihost):
    job = multihost(["a", "b"], server_host="a")
    port = job.start_server(listen="0.0.0.0")       # inside host a's namespace: its lo and eth0 only
    job.start_agent("a", endpoint=f"127.0.0.1:{port}")
    # a joins first, so it is group rank 0 and its address is the one every node is given
    wait_until(lambda: (job.view() or {}).get("waiting"), SETUP_LIMIT_S,
               lambda: f"host a waiting in the job\n{job.diagnosis()}")
    started = time.time()
    job.start_agent("b")

    def verdict() -> dict | None:
        said = [h for h, p in job.agents.items() if "--local-addr" in p.output]
        exited = {h: p.popen.poll() for h, p in job.agents.items() if p.popen.poll() is not None}
        trained = job.training(["a", "b"], 2) is not None
        if said and (trained or any(code != 0 for code in exited.values())):
            return {"said": said, "exited": exited, "trained": trained}
        return None

    found = first_within(VERDICT_BOUND_S, verdict)
    print(f"after {time.time() - started:.1f} s: {found}")
    if found is None:
        exited = {h: p.popen.poll() for h, p in job.agents.items()}
        raise MissingBehaviour(f"{VERDICT_BOUND_S:g} s after the second agent started, no agent named "
                               f"--local-addr and the job neither trained nor stopped (agents' exit codes: "
                               f"{exited})\n{job.diagnosis()}")


def test_agent_sets_gloo_interface_when_the_host_name_resolves_to_loopback(multihost):
    job = multihost(["a", "b"])
    job.start_server()
    started = time.time()
    for host in ("a", "b"):
        job.start_agent(host, gloo_ifname=None)

    def verdict() -> dict | None:
        first = job.training(["a", "b"], 2)
        said = [h for h, p in job.agents.items() if "GLOO_SOCKET_IFNAME" in p.output]
        return {"trained": first, "said": said} if first and len(said) == 2 else None

    found = first_within(VERDICT_BOUND_S, verdict)
    print(f"after {time.time() - started:.1f} s: {found}")
    if found is None:
        raise MissingBehaviour(f"{VERDICT_BOUND_S:g} s after the agents started without GLOO_SOCKET_IFNAME, the "
                               f"job had not trained across the hosts with both agents saying which interface "
                               f"they chose (expected {GLOO_IFNAME})\n{job.diagnosis()}")
