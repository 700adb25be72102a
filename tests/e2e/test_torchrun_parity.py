"""torchrun and node-agent side by side: every torchrun 2.13 flag (in every spelling and through its
PET_* variable) against torchrun's own parser, and whole launch lines run under both launchers.

The rows and the table they make in docs/switching.md are in torchrun_parity.py; each row is checked
here, and the table in the docs must be the one the rows render. torchrun is run only where a job
must run; flags are checked with torchrun's parser, in this process.
"""
from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import signal
import sys
from collections.abc import Callable

import pytest
from torch.distributed.run import get_args_parser

from node_agent.cli.flags import resolve
from node_agent.cli.options import OptionsError, build_argparser, parse_options
from tests.e2e import torchrun_parity as parity
from tests.e2e.harness import SCRIPTS, Cluster, Proc, child_env, read_records
from tests.options_view import flat
from tests.ports import free_port, free_ports

pytestmark = pytest.mark.e2e
ECHO = os.path.join(SCRIPTS, "echo_env.py")
ALLREDUCE = os.path.join(SCRIPTS, "allreduce.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
LAUNCHERS = ("torchrun", "node-agent")
# Variables each launcher sets its own way (checked for their form, not compared).
OWN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


# ---- flags, against torchrun's parser --------------------------------------------------------------

def torchrun_parser(monkeypatch, env: dict[str, str]):
    """torchrun's parser as torchrun builds it under `env` (its PET_* defaults are read when it is built)."""
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return get_args_parser()


def torchrun_resolves(parser, prefix: str) -> str | None:
    """The option string torchrun's argparse takes `prefix` for (None: ambiguous or unknown)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            found = parser._parse_optional(prefix)
    except SystemExit:
        return None
    return found[1] if found and found[0] is not None else None


def test_every_torchrun_flag_and_pet_variable_has_a_row(monkeypatch) -> None:
    rows = {s: r for r in parity.FLAGS for s in r.flags}
    for action in torchrun_parser(monkeypatch, {})._actions:
        if not action.option_strings:
            continue
        row = rows.get(action.option_strings[0])
        assert row is not None, f"no row for torchrun's {action.option_strings}"
        assert set(row.flags) == set(action.option_strings)
        reads_pet = type(action).__name__ in ("env", "check_env")
        assert row.pet == (f"PET_{action.dest.upper()}" if reads_pet else None), action.option_strings


def spellings(parser, row: parity.FlagRow) -> list[list[str]]:
    """Every way to write the row's flag that torchrun accepts: each spelling, --a=b, the prefixes."""
    lines = []
    for flag in row.flags:
        forms = [flag]
        if flag.startswith("--"):
            forms += [flag[:n] for n in range(3, len(flag)) if torchrun_resolves(parser, flag[:n]) == flag]
        for form in forms:
            if row.value is None:
                lines.append([form])
            else:
                lines.append([form, row.value])
                if form.startswith("--"):
                    lines.append([f"{form}={row.value}"])
    return lines


@pytest.mark.parametrize("row", parity.FLAGS, ids=lambda r: f"{r.flags[0]}={r.value}")
def test_each_flag_row_holds_for_every_spelling_and_its_pet_variable(row: parity.FlagRow, monkeypatch) -> None:
    parser = torchrun_parser(monkeypatch, {})
    base = {"CUDA_VISIBLE_DEVICES": "", **row.env}
    if row.flags[0] == "-h":
        for line in spellings(parser, row):
            for parse in (parser.parse_args, lambda argv: parse_options(argv, base)):
                with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as done:
                    parse(line)
                assert done.value.code == 0
        return
    lines: list[tuple[list[str], dict[str, str]]] = [([*row.context, *line], {}) for line in spellings(parser, row)]
    if row.pet:
        lines.append((list(row.context), {row.pet: "1" if row.value is None else row.value}))
    assert len(lines) >= len(row.flags)
    for argv, env in lines:
        torchrun_parser(monkeypatch, env).parse_args([*argv, "train.py"])     # torchrun takes it
        if row.verdict == parity.REFUSED:
            with pytest.raises(OptionsError) as refused:
                parse_options([*argv, "train.py"], {**base, **env})
            assert row.refusal in str(refused.value) and "\n" not in str(refused.value), (argv, env)
        else:
            opts = flat(parse_options([*argv, "train.py"], {**base, **env}))
            assert row.check is not None and row.check(opts), (argv, env, opts)


def test_every_prefix_torchrun_takes_names_the_same_flag_for_node_agent(monkeypatch) -> None:
    theirs = torchrun_parser(monkeypatch, {})
    ours = build_argparser()
    actions = ours._option_string_actions
    checked = 0
    for flag in [s for a in theirs._actions for s in a.option_strings if s.startswith("--")]:
        for n in range(3, len(flag) + 1):
            meant = torchrun_resolves(theirs, flag[:n])
            if meant is not None:
                assert actions[resolve(ours, flag[:n]) or ""] is actions[meant], flag[:n]
                checked += 1
    assert checked > 100


def test_the_table_in_the_docs_is_the_one_the_rows_make() -> None:
    assert parity.current() == parity.render(), \
        "docs/switching.md is stale: run .venv/bin/python -m tests.e2e.torchrun_parity --write"


def test_every_launch_line_row_has_its_run() -> None:
    assert sorted(f.key for f in parity.FORMS) == sorted(FORMS)


# ---- launch lines, under both launchers ------------------------------------------------------------

def start(cluster: Cluster, launcher: str, argv: list[str], env: dict[str, str], name: str = "") -> Proc:
    """`launcher` (torchrun or node-agent) started with `argv`; OMP_NUM_THREADS unset unless `env` sets it, so the
    launchers' own rules for it are compared."""
    cmd = [TORCHRUN, *argv] if launcher == "torchrun" else [sys.executable, "-m", "node_agent", *argv]
    if "TMPDIR" not in env:     # torchrun leaves a log directory in TMPDIR at every run: keep it in the test's
        tmp = cluster.tmp / f"tmp-{len(cluster.procs)}"
        tmp.mkdir()
        env = {**env, "TMPDIR": str(tmp)}
    proc = Proc(cmd, child_env(**{"OMP_NUM_THREADS": None, **env}), name or launcher)
    cluster.procs.append(proc)
    return proc


def worker_lines(proc: Proc) -> list[str]:
    return sorted(line for line in proc.lines if "hello" in line)


def both(cluster: Cluster, tmp_path, argv: list[str] | Callable[[str], list[str]], env: dict[str, str] | None = None,
         *, code: int = 0) -> dict[str, tuple[Proc, str]]:
    """Run the line (or each launcher's own, where a port in it would be shared) under each launcher, side by side;
    each exits with `code`."""
    runs = {}
    for launcher in LAUNCHERS:
        out = tmp_path / launcher
        out.mkdir()
        line = argv(launcher) if callable(argv) else argv
        runs[launcher] = (start(cluster, launcher, line, {"OUT_DIR": str(out), **(env or {})}), str(out))
    for launcher, (proc, _) in runs.items():
        assert proc.wait(120) == code, f"{launcher}:\n{proc.output}"
    return runs


def same_workers(runs: dict[str, tuple[Proc, str]], ranks: int = 2, differ: set[str] = frozenset()) -> list[dict]:
    """Each launcher's workers saw the same environment (but for OWN and `differ`) and arguments."""
    seen = {launcher: sorted(read_records(out), key=lambda r: int(r["env"]["RANK"])) for launcher, (_, out) in
            runs.items()}
    for launcher, records in seen.items():
        assert [r["env"]["RANK"] for r in records] == [str(r) for r in range(ranks)], launcher
        for r in records:
            assert r["env"]["TORCHELASTIC_ERROR_FILE"].endswith(   # one node: the rank is the local rank
                os.path.join("attempt_0", r["env"]["RANK"], "error.json")), launcher
    keep = lambda r: {k: v for k, v in r["env"].items() if k not in OWN | differ}   # noqa: E731
    assert [(keep(r), r["argv"]) for r in seen["torchrun"]] == [(keep(r), r["argv"]) for r in seen["node-agent"]]
    return seen["node-agent"]


def same_console(runs: dict[str, tuple[Proc, str]]) -> list[str]:
    lines = {launcher: worker_lines(proc) for launcher, (proc, _) in runs.items()}
    assert lines["torchrun"] == lines["node-agent"]
    return lines["node-agent"]


def run_plain(cluster, tmp_path) -> None:
    runs = both(cluster, tmp_path, ["--nproc-per-node", "2", ECHO, "--out=x${local_rank}"])
    records = same_workers(runs)
    assert [r["argv"] for r in records] == [["--out=x0"], ["--out=x1"]]
    assert same_console(runs) == ["hello stderr from rank 0", "hello stderr from rank 1",
                                  "hello stdout from rank 0", "hello stdout from rank 1"]


def run_torch_test_line(cluster, tmp_path) -> None:
    runs = both(cluster, tmp_path, ["--nnodes=1", "--rdzv-id=parity-id", "--nproc-per-node=2", ECHO])
    assert {r["env"]["TORCHELASTIC_RUN_ID"] for r in same_workers(runs)} == {"parity-id"}


def run_torchx(cluster, tmp_path) -> None:
    runs = both(cluster, tmp_path, ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--rdzv_id", "app-1",
                                    "--nnodes", "1", "--nproc_per_node", "2", "--tee", "3", "--role", "", ECHO])
    assert {(r["env"]["ROLE_NAME"], r["env"]["TORCHELASTIC_RUN_ID"]) for r in same_workers(runs)} == {("", "app-1")}
    assert same_console(runs) == ["[0]:hello stderr from rank 0", "[0]:hello stdout from rank 0",
                                  "[1]:hello stderr from rank 1", "[1]:hello stdout from rank 1"]


def run_tutorial(cluster, tmp_path) -> None:
    """The tutorial's fault-tolerant line with one node and nothing at the endpoint: each agent hosts it."""
    ports = dict(zip(LAUNCHERS, free_ports(len(LAUNCHERS)), strict=True))
    runs = both(cluster, tmp_path, lambda launcher: [
        "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-id", "100", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"localhost:{ports[launcher]}", ECHO])
    assert {(r["env"]["WORLD_SIZE"], r["env"]["TORCHELASTIC_MAX_RESTARTS"]) for r in same_workers(runs)} == \
        {("2", "3")}


def run_pet(cluster, tmp_path) -> None:
    env = {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1", "PET_MAX_RESTARTS": "1", "PET_ROLE": "trainer",
           "PET_TEE": "1"}
    runs = both(cluster, tmp_path, [ECHO], env)
    assert {r["env"]["TORCHELASTIC_MAX_RESTARTS"] for r in same_workers(runs)} == {"1"}
    assert same_console(runs) == ["[trainer0]:hello stdout from rank 0", "[trainer1]:hello stdout from rank 1",
                                  "hello stderr from rank 0", "hello stderr from rank 1"]


def run_static(cluster, tmp_path) -> None:
    runs = {}
    for launcher, port in zip(LAUNCHERS, map(str, free_ports(len(LAUNCHERS))), strict=True):    # side by side
        out = tmp_path / launcher
        out.mkdir()
        runs[launcher] = [start(cluster, launcher, ["--nnodes", "2", "--node-rank", str(rank), "--master-addr",
                                                    "127.0.0.1", "--master-port", port, "--nproc-per-node", "1",
                                                    ALLREDUCE], {"OUT_DIR": str(out)}, f"{launcher}-{rank}")
                          for rank in (0, 1)], port
    for launcher, (nodes, port) in runs.items():
        out = tmp_path / launcher
        assert [n.wait(120) for n in nodes] == [0, 0], "\n".join(n.output for n in nodes)
        records = read_records(out)
        assert sorted(r["env"]["RANK"] for r in records) == ["0", "1"] and {r["sum"] for r in records} == {3.0}
        assert {r["env"]["MASTER_PORT"] for r in records} == {port}


def run_server(cluster, tmp_path) -> None:
    cluster.start_server("--state-dir", "none")
    runs = {}
    for launcher in LAUNCHERS:          # side by side
        out = tmp_path / launcher
        out.mkdir()
        endpoint = cluster.endpoint() if launcher == "node-agent" else f"127.0.0.1:{free_port()}"
        runs[launcher] = [start(cluster, launcher, ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                                                    "--rdzv-id", "parity", "--nnodes", "2", "--nproc-per-node", "1",
                                                    ECHO], {"OUT_DIR": str(out)}, f"{launcher}-{n}") for n in (0, 1)]
    for launcher, nodes in runs.items():
        out = tmp_path / launcher
        assert [n.wait(120) for n in nodes] == [0, 0], "\n".join(n.output for n in nodes)
        records = read_records(out)
        assert sorted((r["env"]["RANK"], r["env"]["WORLD_SIZE"], r["env"]["TORCHELASTIC_RUN_ID"]) for r in records) \
            == [("0", "2", "parity"), ("1", "2", "parity")]


def run_redirect_failure(cluster, tmp_path) -> None:
    replies, layouts = {}, {}
    for launcher in LAUNCHERS:
        (tmp_path / f"tmp-{launcher}").mkdir()
        (tmp_path / f"reply-{launcher}").mkdir()
    runs = {}
    for launcher in LAUNCHERS:          # side by side
        out, tmp = tmp_path / launcher, tmp_path / f"tmp-{launcher}"
        out.mkdir()
        reply = tmp_path / f"reply-{launcher}" / "error.json"
        runs[launcher] = (start(cluster, launcher, ["--nproc-per-node", "2", "-r", "3", ECHO],
                                {"OUT_DIR": str(out), "TMPDIR": str(tmp), "TORCHELASTIC_ERROR_FILE": str(reply),
                                 "EXIT_RANK": "1", "EXIT_CODE": "3"}), str(out))
    for launcher, (proc, _) in runs.items():
        tmp, reply = tmp_path / f"tmp-{launcher}", tmp_path / f"reply-{launcher}" / "error.json"
        assert proc.wait(120) == 1, proc.output
        assert worker_lines(proc) == []                        # -r 3: nothing on the console
        body = json.loads(reply.read_text())["message"]
        replies[launcher] = (body["message"], body["extraInfo"]["py_callstack"], body["errorCode"])
        run_dir, = glob.glob(os.path.join(str(tmp), "*", "*", "attempt_0", ".."))
        layouts[launcher] = sorted(os.path.relpath(p, run_dir) for p in glob.glob(os.path.join(run_dir, "**"),
                                                                               recursive=True))
    assert replies["torchrun"] == replies["node-agent"] == ("ValueError: rank 1 gives up", "Traceback: echo_env.py", 3)
    assert layouts["torchrun"] == layouts["node-agent"]
    assert "attempt_0/1/error.json" in layouts["node-agent"] and "attempt_0/0/stdout.log" in layouts["node-agent"]
    same_workers(runs)


def run_tee_logs(cluster, tmp_path) -> None:
    runs = {}
    layouts, filtered = {}, {}
    for launcher in LAUNCHERS:          # side by side
        out, logs = tmp_path / launcher, tmp_path / f"logs-{launcher}"
        out.mkdir()
        env = {"OUT_DIR": str(out), "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}/${rank}] "}
        runs[launcher] = (start(cluster, launcher, ["--log-dir", str(logs), "--tee", "3", "--local-ranks-filter",
                                                    "1", "--duplicate-stdout-filters", "hello",
                                                    "--duplicate-stderr-filters", "nowhere",   # matches no line
                                                    "--nproc-per-node", "2", ECHO], env), str(out))
    for launcher, (proc, _) in runs.items():
        logs = tmp_path / f"logs-{launcher}"
        assert proc.wait(120) == 0, proc.output
        run_dir, = glob.glob(os.path.join(str(logs), "*"))
        layouts[launcher] = sorted(os.path.relpath(p, run_dir) for p in glob.glob(os.path.join(run_dir, "**"),
                                                                               recursive=True))
        with open(os.path.join(run_dir, "attempt_0", "filtered_stdout.log")) as f:
            filtered[launcher] = f.read()
    assert same_console(runs) == ["[default/1] hello stderr from rank 1", "[default/1] hello stdout from rank 1"]
    assert layouts["torchrun"] == layouts["node-agent"]
    assert filtered["torchrun"] == filtered["node-agent"] == "[default/1] hello stdout from rank 1\n"
    assert "attempt_0/filtered_stderr.log" in layouts["node-agent"]      # torchrun opens it, matched or not


def stop_by_signal(cluster, tmp_path, argv: list[str], env: dict[str, str], sig: int) -> dict[str, str]:
    """Start each launcher (side by side), send `sig` once its worker waits; return what each worker left."""
    left, procs = {}, {}
    for launcher in LAUNCHERS:
        out = tmp_path / launcher
        out.mkdir()
        procs[launcher] = start(cluster, launcher, [*argv, "--nproc-per-node", "1", ECHO], {"OUT_DIR": str(out), **env})
    for proc in procs.values():
        proc.wait_for_line(r"rank 0 waiting for")
        os.kill(proc.pid, sig)
    for launcher, proc in procs.items():
        out = tmp_path / launcher
        proc.wait(120)
        left[launcher] = " ".join(sorted(p.name + "=" + p.read_text() for p in out.iterdir()
                                         if p.name.startswith(("signal", "done"))))
    return left


def run_grace(cluster, tmp_path) -> None:
    # 6 s: more than node-agent's old 5 s grace, well inside torchrun's (and now node-agent's) 30 s
    left = stop_by_signal(cluster, tmp_path, [], {"SLEEP_RANK": "0", "GRACE": "6"}, signal.SIGTERM)
    assert left == {launcher: "done-0=saved signal-0=SIGTERM" for launcher in LAUNCHERS}


def run_usr1(cluster, tmp_path) -> None:
    left = stop_by_signal(cluster, tmp_path, ["--signals-to-handle", "SIGTERM,SIGUSR1"],
                          {"SLEEP_RANK": "0", "WAIT_SIGNAL": "SIGUSR1"}, signal.SIGUSR1)
    assert left == {launcher: "done-0=saved signal-0=SIGUSR1" for launcher in LAUNCHERS}
    exported = {launcher: [r["env"]["TORCHELASTIC_SIGNALS_TO_HANDLE"] for r in read_records(tmp_path / launcher)]
                for launcher in LAUNCHERS}
    assert exported == {launcher: ["SIGTERM,SIGUSR1"] for launcher in LAUNCHERS}


def run_run_path(cluster, tmp_path) -> None:
    records = same_workers(both(cluster, tmp_path, ["--run-path", "--nproc-per-node", "2", ECHO, "a", "b"]))
    assert records[0]["argv"] == ["a", "b"]


def run_module(cluster, tmp_path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([SCRIPTS, child_env()["PYTHONPATH"]])}
    records = same_workers(both(cluster, tmp_path, ["-m", "--nproc-per-node", "2", "echo_env", "x"], env))
    assert records[0]["argv"] == ["x"]


def run_no_python(cluster, tmp_path) -> None:
    records = same_workers(both(cluster, tmp_path, ["--no-python", "--nproc-per-node", "2", sys.executable, ECHO, "y"]))
    assert records[0]["argv"] == ["y"]


def run_virtual_local_rank(cluster, tmp_path) -> None:
    records = same_workers(both(cluster, tmp_path, ["--virtual-local-rank", "--nproc-per-node", "2", ECHO]))
    assert [(r["env"]["LOCAL_RANK"], r["env"]["CUDA_VISIBLE_DEVICES"]) for r in records] == [("0", "0"), ("0", "1")]


def run_standalone(cluster, tmp_path) -> None:
    runs = both(cluster, tmp_path, ["--standalone", "--nproc-per-node", "2", ECHO])
    same_workers(runs)
    same_console(runs)


FORMS: dict[str, Callable[..., None]] = {
    "plain": run_plain, "torch_test_line": run_torch_test_line, "torchx": run_torchx, "tutorial": run_tutorial,
    "pet": run_pet,
    "static": run_static, "server": run_server, "redirect_failure": run_redirect_failure, "tee_logs": run_tee_logs,
    "grace": run_grace, "usr1": run_usr1, "run_path": run_run_path, "module": run_module, "no_python": run_no_python,
    "virtual_local_rank": run_virtual_local_rank, "standalone": run_standalone,
}


@pytest.mark.parametrize("key", [f.key for f in parity.FORMS])
def test_the_launch_line_runs_alike_under_both(key: str, cluster, tmp_path) -> None:
    FORMS[key](cluster, tmp_path)
