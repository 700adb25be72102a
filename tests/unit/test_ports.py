"""The round's store port: the kernel's pick by default (the ephemeral range docs/deploy.md's firewall rule
allows), or a free one of NODE_AGENT_STORE_PORTS; a bad value is one line at start-up, never a traceback."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from node_agent.client.ports import STORE_PORTS, free_port, store_ports
from tests.e2e.harness import child_env


def ephemeral() -> range:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    return range(low, high + 1)


def test_by_default_the_kernel_picks_an_ephemeral_port_that_can_be_bound():
    port = free_port("127.0.0.1", environ={})
    assert port in ephemeral()
    with socket.socket() as s:
        s.bind(("", port))


def held_beside_a_free_one() -> tuple[socket.socket, int]:
    """A socket bound to a port P whose next one, P + 1, could be bound a moment ago (other tests bind ports too)."""
    for _ in range(100):
        held = socket.socket()
        held.bind(("", 0))
        taken = held.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("", taken + 1))
                return held, taken
            except OSError:
                held.close()
    raise AssertionError("no port with a free one beside it")


def test_a_range_given_is_where_every_port_offered_lies_and_a_taken_one_is_passed_over():
    held, taken = held_beside_a_free_one()
    with held:
        offered = {free_port(environ={STORE_PORTS: f"{taken}-{taken + 1}"}) for _ in range(5)}
    assert offered == {taken + 1}


def test_a_range_with_every_port_taken_is_an_error_naming_it():
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        with pytest.raises(OSError, match=f"no free port in {taken}-{taken} \\(\\${STORE_PORTS}\\)"):
            free_port(environ={STORE_PORTS: f"{taken}-{taken}"})


@pytest.mark.parametrize("text", ["abc", "29600-29500", "80-90", "29500-70000", "1-2-3", "-29500"])
def test_a_value_that_is_no_range_is_refused_naming_it(text):
    with pytest.raises(ValueError, match=f"\\${STORE_PORTS}=.*LOW-HIGH"):
        store_ports({STORE_PORTS: text})
    assert store_ports({STORE_PORTS: " 29500 - 29599 "}) == range(29500, 29600)
    assert store_ports({STORE_PORTS: "29500"}) == range(29500, 29501)
    assert store_ports({}) is None


@pytest.mark.parametrize("launcher", ["node-agent", "torchrun"])
def test_node_agent_and_the_torchrun_plugin_say_a_bad_value_in_one_line(tmp_path, launcher):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    argv = [sys.executable, "-m", "node_agent", "--standalone", str(script)] if launcher == "node-agent" else \
        [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "rdzv-server", "--rdzv-endpoint",
         "127.0.0.1:1", "--nnodes", "1", str(script)]
    env = child_env(**{STORE_PORTS: "junk", "TMPDIR": str(tmp_path)})
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "$NODE_AGENT_STORE_PORTS='junk': give LOW-HIGH" in done.stderr
    assert "Traceback" not in done.stderr and "ran" not in done.stdout
