"""node-agent's GPU flags: --numa-binding (torchrun's modes), --no-gpu-check, --gpu-check-interval,
--health-check, --health-check-timeout, --kill-timeout. Bad input: one line, exit 2, before connecting."""
from __future__ import annotations

import pytest

from node_agent import main as cli
from node_agent.cli.options import parse_options
from tests.options_view import flat


def test_the_defaults_check_gpus_every_5_s_and_bind_nothing() -> None:
    o = flat(parse_options(["--standalone", "t.py"], {}))
    assert (o.numa_binding, o.gpu_check, o.gpu_check_interval, o.health_check, o.health_check_timeout,
            o.kill_timeout) == (None, True, 5.0, None, 30.0, 10.0)


@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "core-complex"])
def test_every_torchrun_mode_is_taken(mode: str) -> None:
    assert flat(parse_options(["--standalone", f"--numa_binding={mode}", "t.py"], {})).numa_binding == mode


def test_the_check_flags_are_read() -> None:
    o = flat(parse_options(["--standalone", "--no-gpu-check", "--gpu-check-interval", "2.5", "--health-check",
                            "/opt/site/check --quick", "--health-check-timeout", "7", "--kill-timeout", "3", "t.py"],
                           {}))
    assert (o.gpu_check, o.gpu_check_interval, o.health_check, o.health_check_timeout, o.kill_timeout) == \
        (False, 2.5, "/opt/site/check --quick", 7.0, 3.0)


@pytest.mark.parametrize("argv, line", [
    (["--numa-binding", "nodes"], "node-agent: error: --numa-binding: expected one of node, socket, exclusive, "
                                  "core-complex; got 'nodes'"),
    (["--gpu-check-interval", "0"], "node-agent: error: --gpu-check-interval: must be > 0 (turn the check off "
                                    "with --no-gpu-check)"),
    (["--health-check", " "], "node-agent: error: --health-check: must name a command"),
    (["--kill-timeout", "-1"], "node-agent: error: --kill-timeout: must be >= 0 and finite, got '-1'"),
])
def test_bad_gpu_flags_are_one_line_and_exit_2_without_connecting(argv: list[str], line: str, capsys,
                                                                  monkeypatch) -> None:
    def no_connecting(*args: object) -> None:
        raise AssertionError("the agent connected despite bad input")

    monkeypatch.setattr(cli, "_run", no_connecting)
    assert cli.main(["--standalone", *argv, "t.py"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line] and captured.out == ""
