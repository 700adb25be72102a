"""torchrun -> node-agent, flag by flag and form by form: the rows of the table in docs/switching.md.

Each flag row says what node-agent makes of one torchrun 2.13 flag (and its PET_* variable), and how
to check it: a predicate on node-agent's options, or the words of its refusal. Each form row is a whole
launch line that test_torchrun_parity.py runs under both launchers. The table in docs/switching.md is
rendered from these rows and checked against them by the tests; regenerate it with

    .venv/bin/python -m tests.e2e.torchrun_parity --write
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "docs", "switching.md")
BEGIN, END = "<!-- parity-table:begin -->", "<!-- parity-table:end -->"
SAME, MAPPED, REFUSED = "same", "mapped", "refused"


@dataclass(frozen=True)
class FlagRow:
    flags: tuple[str, ...]            # torchrun's spellings of the flag
    pet: str | None                   # its PET_* variable (None: torchrun reads none)
    value: str | None                 # the value tried (None: an on/off flag)
    verdict: str
    text: str                         # what node-agent does, for the table
    check: Callable[[Any], bool] | None = None   # on node-agent's settings, seen flat (same, mapped)
    refusal: str = ""                 # words of node-agent's one-line refusal (refused)
    context: tuple[str, ...] = ()     # other flags the line needs
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FormRow:
    key: str                          # the test that runs it (test_torchrun_parity.FORMS)
    form: str
    verdict: str
    text: str


STATIC = ("--nnodes", "2")
FLAGS: tuple[FlagRow, ...] = (
    FlagRow(("--nnodes",), "PET_NNODES", "1:2", SAME, "the job's MIN:MAX nodes (or N)",
            lambda o: (o.job.min_nodes, o.job.max_nodes) == (1, 2), context=("--rdzv-backend", "c10d")),
    FlagRow(("--nproc-per-node", "--nproc_per_node"), "PET_NPROC_PER_NODE", "2", SAME,
            "workers on this node: a number, `cpu`, `gpu` or `auto` (GPUs are counted without importing torch)",
            lambda o: o.nproc == 2),
    FlagRow(("--nproc-per-node", "--nproc_per_node"), "PET_NPROC_PER_NODE", "xpu", REFUSED,
            "`xpu` (and other non-CUDA accelerators): node-agent counts NVIDIA GPUs only; give the number",
            refusal="NVIDIA GPUs only"),
    FlagRow(("--rdzv-backend", "--rdzv_backend"), "PET_RDZV_BACKEND", "c10d", MAPPED,
            "`static` (the default) keeps torchrun's static and single-node forms; any other name (`c10d`, "
            "`etcd`, `rdzv-server`) means the rdzv-server at `--rdzv-endpoint`",
            lambda o: o.mode.value == "server" and o.endpoint == "h:29400",
            context=("--rdzv-endpoint", "h:29400", "--nnodes", "2")),
    FlagRow(("--rdzv-endpoint", "--rdzv_endpoint"), "PET_RDZV_ENDPOINT", "h:29400", MAPPED,
            "with a backend other than static: the rdzv-server (port 29400 when left out; an empty endpoint "
            "means localhost:29400). Port 0 (TorchX's `localhost:0`) or none, with one node: the in-process "
            "rendezvous, as torchrun hosts it itself. With the static backend: node rank 0, as in torchrun; "
            "several nodes there without `--node-rank` are refused (every one would be rank 0: torchrun hangs)",
            lambda o: (o.endpoint_host, o.endpoint_port) == ("h", 29400),
            context=("--rdzv-backend", "c10d", "--nnodes", "2")),
    FlagRow(("--rdzv-id", "--rdzv_id"), "PET_RDZV_ID", "team/exp1", SAME,
            "the job id (1-512 characters, `/` allowed). Left out (or `none`) with a server: the scheduler's "
            "job id (`SLURM_JOB_ID`, `JOBSET_NAME`, ...), else your user name and a hash of the command, so "
            "unrelated runs never meet; with one node: a fresh id, as torchrun",
            lambda o: o.job_id == "team/exp1",
            context=("--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--nnodes", "2")),
    FlagRow(("--rdzv-conf", "--rdzv_conf"), "PET_RDZV_CONF", "join_timeout=30,last_call_timeout=1", MAPPED,
            "keys become the job's settings: `join_timeout` (`timeout`), `last_call_timeout`, `heartbeat_timeout`, "
            "`max_restarts`, `exclude_*`; also `server_wait`, `node_id`, `token_file`, `tls_ca`. Keys with "
            "nothing to do here (`close_timeout`, `read_timeout`, `is_host`, ...) are said once; unknown keys "
            "are refused, naming the known ones", lambda o: (o.job.join_timeout_s, o.job.last_call_s) == (30, 1)),
    FlagRow(("--standalone",), "PET_STANDALONE", None, SAME, "one node, an in-process rendezvous, no server",
            lambda o: o.mode.value == "standalone"),
    FlagRow(("--max-restarts", "--max_restarts"), "PET_MAX_RESTARTS", "3", MAPPED,
            "the job-wide restart budget, counted once per failure by the server (torchrun: per agent)",
            lambda o: o.job.max_restarts == 3),
    FlagRow(("--monitor-interval", "--monitor_interval"), "PET_MONITOR_INTERVAL", "0.5", SAME,
            "accepted and checked; node-agent sees a worker's exit at once instead of polling",
            lambda o: o.warnings == ()),
    FlagRow(("--start-method", "--start_method"), "PET_START_METHOD", "fork", SAME,
            "accepted and checked; as under torchrun, a script always starts as a new process",
            lambda o: o.warnings == ()),
    FlagRow(("--event-log-handler", "--event_log_handler"), "PET_EVENT_LOG_HANDLER", "null", SAME,
            "`null`, torchrun's default", lambda o: o.warnings == ()),
    FlagRow(("--event-log-handler", "--event_log_handler"), "PET_EVENT_LOG_HANDLER", "console", REFUSED,
            "other handlers: node-agent loads no torch event handlers; the job's events are at the rdzv-server "
            "(`rdzv-ctl events JOB`)", refusal="rdzv-ctl events"),
    FlagRow(("--role",), "PET_ROLE", "trainer", SAME,
            "`ROLE_NAME` and the prefix of tee'd lines (`\"\"` allowed, as TorchX passes it)",
            lambda o: o.role == "trainer"),
    FlagRow(("-m", "--module"), "PET_MODULE", None, SAME, "`python -u -m SCRIPT`", lambda o: o.module),
    FlagRow(("--no-python", "--no_python"), "PET_NO_PYTHON", None, SAME, "runs the script as a program",
            lambda o: o.no_python),
    FlagRow(("--run-path", "--run_path"), "PET_RUN_PATH", None, SAME,
            "the script runs through `runpy.run_path` in a fresh interpreter (torchrun: in its spawned worker); "
            "wins over `-m` and `--no-python`", lambda o: o.run_path),
    FlagRow(("--log-dir", "--log_dir"), "PET_LOG_DIR", "/tmp/logs", SAME,
            "torchrun's layout `DIR/ID_XXXXXXXX/attempt_N/LOCAL_RANK/`, a new `ID_XXXXXXXX` for every run",
            lambda o: o.log_dir == "/tmp/logs"),
    FlagRow(("-r", "--redirects"), "PET_REDIRECTS", "3", SAME,
            "log files only (without `--log-dir`, in a temporary directory that is kept, as torchrun's)",
            lambda o: o.redirects.for_rank(0) == 3),
    FlagRow(("-t", "--tee"), "PET_TEE", "0:1,1:3", SAME, "log files and the console, prefixed `[ROLE LOCAL_RANK]:`",
            lambda o: (o.tee.for_rank(0), o.tee.for_rank(1)) == (1, 3)),
    FlagRow(("--local-ranks-filter", "--local_ranks_filter"), "PET_LOCAL_RANKS_FILTER", "0,1", SAME,
            "only these local ranks reach the console", lambda o: o.local_ranks_filter == {0, 1}),
    FlagRow(("--duplicate-stdout-filters", "--duplicate_stdout_filters"), "PET_DUPLICATE_STDOUT_FILTERS", "a,,b,c",
            SAME, "tee'd stdout lines holding any of them also go to `attempt_N/filtered_stdout.log`",
            lambda o: o.dup_stdout == ("a,b", "c")),
    FlagRow(("--duplicate-stderr-filters", "--duplicate_stderr_filters"), "PET_DUPLICATE_STDERR_FILTERS", "x", SAME,
            "the same for stderr, `filtered_stderr.log`", lambda o: o.dup_stderr == ("x",)),
    FlagRow(("--node-rank", "--node_rank"), "PET_NODE_RANK", "1", SAME,
            "static launch: this node's rank; no server, ranks from the values given (every node runs the same "
            "`--nproc-per-node`); restarts are the node's own, as with torchrun's static backend",
            lambda o: (o.mode.value, o.node_rank) == ("static", 1), context=STATIC),
    FlagRow(("--master-addr", "--master_addr"), "PET_MASTER_ADDR", "10.0.0.9", SAME,
            "static launch: `MASTER_ADDR`; worker rank 0 hosts the workers' store there",
            lambda o: (o.mode.value, o.master_addr) == ("static", "10.0.0.9"), context=STATIC),
    FlagRow(("--master-port", "--master_port"), "PET_MASTER_PORT", "29600", SAME,
            "static launch: `MASTER_PORT` (29500 when left out)",
            lambda o: (o.mode.value, o.master_port) == ("static", 29600), context=STATIC),
    FlagRow(("--local-addr", "--local_addr"), "PET_LOCAL_ADDR", "10.0.0.2", SAME,
            "the address other nodes reach this node at (`MASTER_ADDR` when it is group rank 0)",
            lambda o: o.local_addr == "10.0.0.2"),
    FlagRow(("--logs-specs", "--logs_specs"), None, "default", SAME,
            "torchrun's own log layout (torch's `DefaultLogsSpecs`), which node-agent writes under `--log-dir`",
            lambda o: o.warnings == ()),
    FlagRow(("--logs-specs", "--logs_specs"), None, "custom", REFUSED,
            "any other name: node-agent loads no torch plugins (it never imports torch); its layout is "
            "torchrun's default, under `--log-dir`", refusal="only 'default'"),
    FlagRow(("--numa-binding", "--numa_binding"), None, "node", SAME,
            "`node`, `socket`, `exclusive`, `core-complex`: each worker's CPUs near its GPU, as torchrun's modes "
            "(from sysfs and NVML, without CUDA); no NUMA information: one warning, workers unbound",
            lambda o: o.numa_binding == "node"),
    FlagRow(("--signals-to-handle", "--signals_to_handle"), "PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1", SAME,
            "each stops the workers with that signal (then SIGKILL after the grace) and the agent exits "
            "128+N; Slurm's `--signal=USR1@90` reaches the workers; the workers get the list as "
            "`TORCHELASTIC_SIGNALS_TO_HANDLE`", lambda o: o.signals == (15, 10)),
    FlagRow(("--shutdown-timeout", "--shutdown_timeout"), "PET_SHUTDOWN_TIMEOUT", "45", SAME,
            "the stop grace (also `--stop-timeout`); default `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else 30 s",
            lambda o: o.stop_timeout == 45),
    FlagRow(("--virtual-local-rank", "--virtual_local_rank"), "PET_VIRTUAL_LOCAL_RANK", None, SAME,
            "`LOCAL_RANK=0`, each worker seeing its own GPU in `CUDA_VISIBLE_DEVICES`",
            lambda o: o.virtual_local_rank),
    FlagRow(("-h", "--help"), None, None, SAME, "prints node-agent's flags and exits 0"),
)

FORMS: tuple[FormRow, ...] = (
    FormRow("plain", "`--nproc-per-node 2 train.py --out=x${local_rank}` (no rendezvous flags)", SAME,
            "in process, no server; same worker environment, console lines and `${local_rank}` in the arguments"),
    FormRow("torch_test_line", "`--nnodes=1 --rdzv-id=ID --nproc-per-node=2` (torch's own launcher tests)", SAME,
            "in process, no server. torchrun ignores the id here and uses a random one; node-agent keeps the "
            "id given (`TORCHELASTIC_RUN_ID`)"),
    FormRow("torchx", "TorchX's single node: `--rdzv_backend c10d --rdzv_endpoint localhost:0 --rdzv_id APP "
                      "--nnodes 1 --tee 3 --role \"\"`", SAME, "in process, no server; the same `[0]:` prefixes"),
    FormRow("tutorial", "the tutorial's line with one node and nothing at the endpoint: `--nnodes 1 "
                        "--rdzv-backend c10d --rdzv-endpoint localhost:29400 --rdzv-id 100`", SAME,
            "in process, no server (said once); with an rdzv-server listening there, that server"),
    FormRow("pet", "`PET_NPROC_PER_NODE=2 PET_NNODES=1 PET_MAX_RESTARTS=1 PET_ROLE=trainer PET_TEE=1 torchrun "
                   "train.py`", SAME, "the same workers and console"),
    FormRow("static", "static, 2 nodes: `--nnodes 2 --node-rank R --master-addr A --master-port P` (gloo "
                      "all-reduce)", SAME, "no server; the same ranks and the same all-reduce result"),
    FormRow("server", "2 nodes at an endpoint: `--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID "
                      "--nnodes 2`", MAPPED,
            "the endpoint is an rdzv-server (torchrun's first agent hosts a c10d store there instead); the same "
            "ranks"),
    FormRow("redirect_failure", "`-r 3` without `--log-dir`, a worker failing with `@record`, "
                                "`TORCHELASTIC_ERROR_FILE` set (as TorchX sets it)", SAME,
            "output hidden in a kept temporary directory with torchrun's layout; exit 1; the same root "
            "cause in the launcher's error file (node-agent also writes one when the worker left none)"),
    FormRow("tee_logs", "`--log-dir D --tee 3 --local-ranks-filter 1 --duplicate-stdout-filters hello "
                        "--duplicate-stderr-filters nowhere` with `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`", SAME,
            "the same console lines, log files, `filtered_stdout.log` and an empty `filtered_stderr.log`"),
    FormRow("grace", "SIGTERM to the launcher while a worker saves for 6 s", SAME,
            "the worker gets SIGTERM and 30 s (torchrun's grace) to finish"),
    FormRow("usr1", "`--signals-to-handle SIGTERM,SIGUSR1` and SIGUSR1 to the launcher (Slurm's warning)", SAME,
            "the workers get SIGUSR1, and `TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGUSR1`"),
    FormRow("run_path", "`--run-path train.py`", SAME, "the same workers"),
    FormRow("module", "`-m package.module`", SAME, "the same workers"),
    FormRow("no_python", "`--no-python program args`", SAME, "the same workers"),
    FormRow("virtual_local_rank", "`--virtual-local-rank --nproc-per-node 2`", SAME,
            "`LOCAL_RANK=0`, `CUDA_VISIBLE_DEVICES` 0 and 1"),
    FormRow("standalone", "`--standalone --nproc-per-node 2`", SAME, "the same workers"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The generated part of docs/switching.md."""
    counts = {v: sum(1 for r in FLAGS if r.verdict == v) for v in (SAME, MAPPED, REFUSED)}
    lines = [
        BEGIN,
        "<!-- Generated from tests/e2e/torchrun_parity.py and checked by tests/e2e/test_torchrun_parity.py;",
        "     regenerate with: .venv/bin/python -m tests.e2e.torchrun_parity --write -->",
        "",
        f"{len(FLAGS)} rows for torchrun 2.13's {len({r.flags for r in FLAGS})} flags: {counts[SAME]} the same, "
        f"{counts[MAPPED]} mapped onto node-agent's meaning, {counts[REFUSED]} refused with one line saying why "
        "and what to use instead. Every spelling torchrun accepts is tested (`--a-b`, `--a_b`, `--a=b`, the "
        "unambiguous prefixes, the `PET_*` variable), against torchrun's own parser.",
        "",
        "| torchrun flag | `PET_*` variable | node-agent |",
        "|---|---|---|",
    ]
    for r in FLAGS:
        shown = r.value in ("xpu", "console", "null", "default")      # a row about that one value
        flags = ", ".join(f"`{f}`" for f in r.flags) + (f" `{r.value}`" if shown else "")
        lines.append(f"| {_cell(flags)} | {f'`{r.pet}`' if r.pet else ''} | **{r.verdict}**: {_cell(r.text)} |")
    lines += [
        "",
        f"Launch lines run under both launchers ({len(FORMS)}): exit status, worker environment, console and "
        "files compared.",
        "",
        "| torchrun line | node-agent |",
        "|---|---|",
    ]
    lines += [f"| {_cell(f.form)} | **{f.verdict}**: {_cell(f.text)} |" for f in FORMS]
    lines.append(END)
    return "\n".join(lines)


def current() -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(BEGIN), text.find(END)
    return text[start:end + len(END)] if start >= 0 and end > start else ""


def write() -> None:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{DOC}: no {BEGIN} ... {END} section to fill")
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(text[:start] + render() + text[end + len(END):])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(render())
