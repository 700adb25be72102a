"""Every flag node-agent accepts: its spellings, its `PET_*` variable, and how a command line is split. All of
torchrun's flags (torch 2.13, `torch/distributed/run.py`) in all their spellings, then our own. As in torchrun a
long flag may be cut to a prefix naming one flag (`--redirect=3`); a prefix of one of torchrun's and one of ours
is torchrun's, so a torchrun line never changes meaning. What the values mean is `options.py`'s business."""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn


class FlagError(ValueError):
    """A command line that cannot be split or parsed; one line meant for the user."""


@dataclass(frozen=True)
class Flag:
    spellings: tuple[str, ...]
    dest: str
    metavar: str | None        # None: an on/off flag
    help: str
    pet: str | None = None     # the PET_* variable torchrun reads when the flag is left out
    torchrun: tuple[str, ...] = ()   # the spellings torchrun itself accepts (empty: ours only)


def _t(spellings: tuple[str, ...], dest: str, metavar: str | None, help: str, pet: bool = True) -> Flag:
    """A torchrun flag: every spelling is torchrun's; its PET_* name comes from torchrun's first long one."""
    first = next(s for s in spellings if s.startswith("--"))
    return Flag(spellings, dest, metavar, help, f"PET_{first[2:].replace('-', '_').upper()}" if pet else None,
                spellings)


def _both(ours: tuple[str, ...], torchrun: tuple[str, ...], dest: str, metavar: str | None, help: str) -> Flag:
    """One of our flags that is also a torchrun flag under other spellings."""
    return replace(_t(torchrun, dest, metavar, help), spellings=(*ours, *torchrun))


# A dest that names a JobConfig field is that job setting: its default ({default} in the help) and bounds
# are JobConfig's; other defaults are node_agent/settings.py's. Defaults here are None so use can be told apart.
FLAGS: tuple[Flag, ...] = (
    _both(("--endpoint",), ("--rdzv-endpoint", "--rdzv_endpoint"), "endpoint", "[https://]HOST:PORT",
          "the rdzv-server (port 29400 when left out; [::1]:PORT for IPv6; https:// for TLS; replicas of one "
          "server on etcd as a comma-separated list, the agent follows the leader). "
          "--endpoint always names an rdzv-server; --rdzv-endpoint follows torchrun: with the default "
          "--rdzv-backend static it names the master of a static launch"),
    _t(("--rdzv-backend", "--rdzv_backend"), "rdzv_backend", "NAME",
       "torchrun's rendezvous backend: static (torchrun's default: --node-rank/--master-addr/--master-port, or one "
       "node with no server) or any other name (c10d, etcd, rdzv-server): the rdzv-server at --rdzv-endpoint"),
    _t(("--rdzv-conf", "--rdzv_conf"), "rdzv_conf", "K=V,...",
       "rendezvous settings: join_timeout, last_call_timeout, heartbeat_timeout, ... (docs/switching.md)"),
    _t(("--standalone",), "standalone", None,
       "one node: an in-process rendezvous, no server (also the default for one node without rendezvous flags)"),
    Flag(("--token-file", "--token_file"), "token_file", "F",
         "file holding the server's token (or set RDZV_TOKEN_FILE, or RDZV_TOKEN to the token itself)"),
    Flag(("--transport",), "transport", "(gone)", "refused: long-polls are the only transport"),
    Flag(("--tls-ca", "--tls_ca"), "tls_ca", "F",
         "CA certificates (PEM) that signed the server's TLS certificate; implies https"),
    Flag(("--tls-cert", "--tls_cert"), "tls_cert", "F",
         "this node's certificate (PEM, signed by --tls-ca's CA): peer copies of snapshots go over TLS, both ways "
         "checked; where the server uses TLS, copies need it (else this node makes none)"),
    Flag(("--tls-key", "--tls_key"), "tls_key", "F", "the private key of --tls-cert (PEM)"),
    _both(("--nproc",), ("--nproc-per-node", "--nproc_per_node"), "nproc", "N|gpu|cpu|auto",
          "workers on this node: a number, one per GPU, one per CPU, or auto (GPUs if any, else CPUs); default 1"),
    _t(("--nnodes",), "nnodes", "MIN:MAX|N", "number of nodes, or an elastic range; default 1:1"),
    Flag(("-j", "--j"), "j", "[MIN:]NxM", "TorchX shorthand: N nodes (elastic MIN:N) of M workers each"),
    _both(("--job-id",), ("--rdzv-id", "--rdzv_id"), "job_id", "ID",
          "job id shared by every node of the job; default: the scheduler's job id (SLURM_JOB_ID, "
          "JOBSET_NAME, ...), else your user name and a hash of the command"),
    _t(("--max-restarts", "--max_restarts"), "max_restarts", "K",
       "job-wide worker group restarts before the job fails; default {default}"),
    _t(("--node-rank", "--node_rank"), "node_rank", "R", "this node's rank in a static launch; default 0"),
    _t(("--master-addr", "--master_addr"), "master_addr", "ADDR",
       "node rank 0's address in a static launch (worker rank 0 hosts the store there); default 127.0.0.1"),
    _t(("--master-port", "--master_port"), "master_port", "PORT",
       "the workers' store port on node rank 0 in a static launch; default 29500"),
    Flag(("--node-id", "--node_id"), "node_id", "ID", "this node's id at the server; default HOSTNAME-PID"),
    _t(("--local-addr", "--local_addr"), "local_addr", "ADDR",
       "address other nodes reach this node at (MASTER_ADDR when it is group rank 0)"),
    _t(("--role",), "role", "NAME", "worker role (ROLE_NAME); default {default!r}"),
    _t(("-m", "--module"), "module", None, "run the script as a module, like python -m"),
    _t(("--no-python", "--no_python"), "no_python", None, "run the script directly, not with python"),
    _t(("--run-path", "--run_path"), "run_path", None,
       "run the script with runpy.run_path in a fresh interpreter (torchrun's --run-path)"),
    _t(("--log-dir", "--log_dir"), "log_dir", "DIR",
       "base directory of this run's logs: DIR/ID_XXXXXXXX/attempt_N/LOCAL_RANK/ holds stdout.log, stderr.log "
       "and error.json (torchrun's layout, a new ID_XXXXXXXX for every run)"),
    _t(("-r", "--redirects"), "redirects", "STD",
       "send worker streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or a "
       "per-local-rank map such as 0:1,1:2"),
    _t(("-t", "--tee"), "tee", "STD",
       "send worker streams to log files and the console, prefixed [ROLE LOCAL_RANK]: (format as -r)"),
    _t(("--local-ranks-filter", "--local_ranks_filter"), "local_ranks_filter", "R,R,...",
       "show only these local ranks on the console (log files keep everything)"),
    _t(("--duplicate-stdout-filters", "--duplicate_stdout_filters"), "dup_stdout", "TEXT,...",
       "also copy tee'd stdout lines containing any TEXT to attempt_N/filtered_stdout.log (,, is a comma)"),
    _t(("--duplicate-stderr-filters", "--duplicate_stderr_filters"), "dup_stderr", "TEXT,...",
       "the same for stderr (attempt_N/filtered_stderr.log)"),
    Flag(("--log-line-prefix", "--log_line_prefix"), "log_line_prefix", "TEMPLATE",
         "prefix every console line of the workers: ${{role_name}}, ${{rank}}, ${{local_rank}}, ${{host}}; "
         "e.g. '[${{host}}:${{rank}}] '"),
    _both(("--stop-timeout", "--stop_timeout"), ("--shutdown-timeout", "--shutdown_timeout"), "stop_timeout",
          "S", "seconds between the stop signal and SIGKILL when stopping workers; default "
               "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else {default:g}"),
    _t(("--signals-to-handle", "--signals_to_handle"), "signals", "SIG,...",
       "signals that stop the workers (forwarded to them) and the agent; default SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
    _t(("--virtual-local-rank", "--virtual_local_rank"), "virtual_local_rank", None,
       "LOCAL_RANK=0 in every worker, each seeing only its own GPU through CUDA_VISIBLE_DEVICES"),
    _t(("--monitor-interval", "--monitor_interval"), "monitor_interval", "S",
       "accepted; node-agent sees a worker exit at once instead of polling"),
    _t(("--start-method", "--start_method"), "start_method", "spawn|fork|forkserver",
       "accepted; like torchrun, scripts always start as new processes"),
    _t(("--event-log-handler", "--event_log_handler"), "event_log_handler", "NAME",
       "null only: the job's events are at the rdzv-server (rdzv-ctl events JOB)"),
    _t(("--logs-specs", "--logs_specs"), "logs_specs", "NAME",
       "only `default`: torchrun's log layout, the one node-agent writes (see docs/switching.md)", pet=False),
    _t(("--numa-binding", "--numa_binding"), "numa_binding", "MODE",
       "pin each worker to the CPUs near its GPU, as torchrun: node, socket, exclusive or core-complex "
       "(read from sysfs; no NUMA information: a warning, workers unbound)", pet=False),
    Flag(("--last-call", "--last_call"), "last_call_s", "S",
         "seconds an elastic round waits for more nodes once it has MIN; default {default:g}"),
    Flag(("--join-timeout", "--join_timeout"), "join_timeout_s", "S",
         "seconds to wait for a round to form; default {default:g}"),
    Flag(("--lease-timeout", "--lease_timeout"), "lease_timeout_s", "S",
         "seconds of silence after which the server drops a node; default {default:g}"),
    Flag(("--server-wait", "--server_wait"), "server_wait", "S",
         "seconds to keep retrying an unreachable server (never less than --lease-timeout); default {default:g}"),
    Flag(("--hang-detection", "--hang_detection"), "hang_detection", "on|off",
         "restart the job, naming the culprit, when ranks wait on a rank that is stopped or gone, or every rank "
         "waits in a collective with nothing moving (a deadlock); default on"),
    Flag(("--hang-alone-timeout", "--hang_alone_timeout"), "hang_alone_timeout_s", "S",
         "a rank working alone (an evaluation, an upload, its own loop) while the others wait is shown at once "
         "and a hang only after this long, never twice at one place; 0: never; default {default:g}"),
    Flag(("--hang-timeout", "--hang_timeout"), "hang_timeout_s", "S",
         "the hard cap for ranks that all wait in collectives while data still moves (or a GPU computes): a hang "
         "after this long; 0: none; default {default:g}"),
    Flag(("--replace-slow-nodes", "--replace_slow_nodes"), "replace_slow_nodes", None,
         "swap a node named slow (the others wait on it) for a ready spare at the job's next snapshot (nothing "
         "redone); default off"),
    Flag(("--suspect-exit-codes", "--suspect_exit_codes"), "suspect_exit_codes", "CODE[,CODE...]",
         "worker exit codes that ask for other hardware (Megatron's 16 and 17): the node is replaced by a ready "
         "spare at once, excluded when it asks twice; none: no such code; default 16,17"),
    Flag(("--memory-dir-limit", "--memory_dir_limit"), "memory_dir_limit", "SIZE",
         "size limit of the node's in-memory checkpoint directories ($NODE_AGENT_MEMORY_DIR, in /dev/shm, "
         "kept across worker restarts), shared by the local ranks: 8G, 512M, ...; 0 turns them off; "
         "default half of /dev/shm's free space"),
    Flag(("--no-memory-dir", "--no_memory_dir"), "no_memory_dir", None,
         "no in-memory checkpoint directory (the same as --memory-dir-limit 0)"),
    Flag(("--replicas",), "replicas", "K",
         "copy each rank's newest in-memory snapshot to K other nodes' memory (in another failure domain), so a "
         "node that takes a lost node's place resumes from it rather than from disk; 0: off; default {default}"),
    Flag(("--failure-domain", "--failure_domain"), "failure_domain", "LABEL",
         "what fails with this node (a rack, a switch): copies go to nodes with another label; default "
         "$SLURM_TOPOLOGY_ADDR's switch, else the host"),
    Flag(("--replica-bandwidth", "--replica_bandwidth"), "copy_bandwidth", "SIZE",
         "the most this node sends per second of copies to its peers (100M, 1G, ...); 0: no cap; default 1G"),
    Flag(("--exclude-after", "--exclude_after"), "exclude_after", "K",
         "exclude a node after K worker failures within --exclude-window (job-wide); 0 never; default {default}"),
    Flag(("--exclude-window", "--exclude_window"), "exclude_window_s", "S",
         "window for counting a node's failures; default {default:g}"),
    Flag(("--exclude-cooldown", "--exclude_cooldown"), "exclude_cooldown_s", "S",
         "first exclusion's length, doubling each time up to {cooldown_max:g} s; default {default:g}"),
    Flag(("--exclude-lost-after", "--exclude_lost_after"), "exclude_lost_after", "K",
         "exclude a node that comes back after it was lost K times within --exclude-window (a flapping host; an agent "
         "restart the job waits for: K+1); 0 never; "
         "default {default}"),
    Flag(("--exclude-lost-cooldown", "--exclude_lost_cooldown"), "exclude_lost_cooldown_s", "S",
         "how long such a node is excluded the first time, doubling each time up to {cooldown_max:g} s; "
         "default {default:g}"),
    Flag(("--no-gpu-check", "--no_gpu_check"), "no_gpu_check", None,
         "do not check this node's NVIDIA GPUs through NVML (by default they are checked before joining, "
         "before each restart and every --gpu-check-interval while workers run, where /dev/nvidia* exists)"),
    Flag(("--gpu-check-interval", "--gpu_check_interval"), "gpu_check_interval", "S",
         "seconds between GPU checks while workers run; default {default:g}"),
    Flag(("--health-check", "--health_check"), "health_check", "CMD",
         "the site's own node check, run at the same points (exit 0: healthy; otherwise the node leaves, "
         "quoting its first line of output)"),
    Flag(("--health-check-timeout", "--health_check_timeout"), "health_check_timeout", "S",
         "longest a --health-check run may take (past it: unhealthy); default {default:g}"),
    Flag(("--kill-timeout", "--kill_timeout"), "kill_timeout", "S",
         "a worker still alive this long after SIGKILL (uninterruptible sleep, a GPU fault) marks the node "
         "unhealthy: it leaves instead of waiting; default {default:g}"),
    Flag(("--warm-workers", "--warm_workers"), "warm_workers", "auto|off",
         "auto: workers of a Python script or -m module are forked from an interpreter that has already imported "
         "--warm-preload (a restart skips `import torch`); off: every worker starts cold; default {default}"),
    Flag(("--warm-preload", "--warm_preload"), "warm_preload", "MOD[,MOD...]",
         "the modules warm workers find imported (exactly these; module:name also looks a name up in it, as "
         "`from module import name` does); default torch, torch.distributed, torch.nn, torch.optim, torch._dynamo "
         "and the installed packages the script imports at its top level, with the names it imports from them "
         "(Lightning, transformers, ...; not the script's own modules)"),
    Flag(("--no-command-check", "--no_command_check"), "no_command_check", None,
         "let nodes whose script or arguments differ join one job (by default the server refuses them)"),
)
BY_DEST: dict[str, Flag] = {f.dest: f for f in FLAGS}
TORCHRUN_SPELLINGS: frozenset[str] = frozenset(s for f in FLAGS for s in f.torchrun) | {"-h", "--help"}


class _Parser(argparse.ArgumentParser):
    # argparse would print usage and sys.exit(2); the CLI decides how to show errors instead.
    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):   # only the script is
            message = "missing the training script: node-agent [options] SCRIPT [ARGS...]"
        raise FlagError(message)


class _Formatter(argparse.HelpFormatter):
    # Each alias once, then the metavar ("--nproc, --nproc-per-node N"): a metavar per alias is unreadable.
    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        return f"{', '.join(action.option_strings)} {self._format_args(action, action.dest.upper())}"


class _Spelled(argparse.Action):
    """Store a value and remember which spelling the user typed, so errors name that spelling."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.__dict__.setdefault("_spelling", {})[self.dest] = option_string


def build_argparser(help_of: Mapping[str, str]) -> argparse.ArgumentParser:
    """The parser of the launcher's own options (everything before the script), `help_of` each flag's dest."""
    p = _Parser(prog="node-agent", allow_abbrev=False, formatter_class=_Formatter,
                description="Join an elastic training job (at a rendezvous server, or on this node alone), "
                            "then run and supervise this node's workers: a drop-in replacement for torchrun.")
    for flag in FLAGS:
        how: dict[str, Any] = ({"action": "store_true"} if flag.metavar is None
                               else {"action": _Spelled, "metavar": flag.metavar})
        p.add_argument(*flag.spellings, dest=flag.dest, default=None, help=help_of[flag.dest], **how)
    p.add_argument("script", help="training script (or module with -m, or program with --no-python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="everything after the script goes to it untouched")
    return p


def resolve(parser: argparse.ArgumentParser, name: str) -> str | None:
    """The full spelling a long option `name` stands for (itself, or the flag it prefixes); None when nothing
    matches (argparse says what is wrong). A prefix of several flags is torchrun's one if exactly one is."""
    actions = parser._option_string_actions
    if name in actions:
        return name
    matches = [s for s in actions if s.startswith(name) and s.startswith("--")]
    by_action: dict[int, list[str]] = {}
    for spelling in matches:
        by_action.setdefault(id(actions[spelling]), []).append(spelling)
    groups = list(by_action.values())
    if len(groups) > 1:
        groups = [group for group in groups if any(s in TORCHRUN_SPELLINGS for s in group)]
        if len(groups) != 1:
            raise FlagError(f"ambiguous option: {name} could match {', '.join(sorted(matches))}")
    if not groups:
        return None
    return next((s for s in groups[0] if s in TORCHRUN_SPELLINGS), groups[0][0])


def split_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the launcher's options, prefixes written out in full; the script and its arguments). The script is found
    as argparse would, and its arguments are kept as torchrun passes them: untouched, but for a `--` right after
    the script where none came before it (argparse takes that one as the end of the launcher's options); a line
    that cannot be split (an unknown option) comes back as options only, so that argparse names the problem."""
    actions = parser._option_string_actions
    options: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return options, list(argv[i + 1:])
        if not tok.startswith("-") or tok == "-":
            return options, [tok, *argv[i + 2:]] if argv[i + 1:i + 2] == ["--"] else list(argv[i:])
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            full = resolve(parser, name)
            if full is None:
                return [*options, *argv[i:]], []
            options.append(f"{full}={value}" if eq else full)
            takes_value = not eq and actions[full].nargs != 0
        else:
            action = actions.get(tok[:2])
            if action is None:
                return [*options, *argv[i:]], []
            options.append(tok)
            takes_value = len(tok) == 2 and action.nargs != 0
        if takes_value and i + 1 < len(argv):
            options.append(argv[i + 1])
            i += 1
        i += 1
    return options, []

