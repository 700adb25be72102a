"""A torchrun rendezvous handler backed by rdzv-server (`torchrun --rdzv-backend rdzv-server`), found through the
`torchrun.handlers` entry point (entry.py), so an unchanged torchrun line gets the server's membership, leases,
job-wide restart budget, events and status page. It runs inside torchrun's agent process.

How torch's agent uses a handler (torch 2.13, SimpleElasticAgent): `next_rendezvous()` before it starts the
workers and again whenever it restarts them; `num_nodes_waiting()` on every monitor tick while they are healthy
(> 0 makes it restart them); `shutdown()` once at the end. Nothing else. So:
- Rounds: `ServerSession` (session.py) long-polls in the background, renewing the lease and noticing a newer
  round, a lost node or the job's end at once; `num_nodes_waiting()` turns that into a restart of the workers.
- Restarts: torch asking for a new round while the server still runs ours means our workers failed: we report
  it, and the server counts it job-wide and moves every node on. When the server has moved on already, we adopt
  the newer round without a report. A failed or closed job, or a server gone, ends the agent: one line, exit 1.
- Success: torch tells a handler nothing of its workers' fate, but an agent enters its exit barrier only when
  all its workers exited 0, so `RoundStore` reports success there; `shutdown()` with no exception is the fallback.
- Stores: each agent hosts a TCPStore from the start (in a process of its own, agent_store.py), its port published
  at join; a round's agents use group rank 0's under `rdzv-server/JOB/ROUND/`, so a new round never reads an old
  one's keys. Workers do not share it
  (use_agent_store is False): worker rank 0 hosts their own store, fresh with every start, as under node-agent, on
  a free port group rank 0's agent passes on through the round store."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from node_agent.cli.rdzv_conf import IGNORED_KEYS, unquoted
from node_agent.client.http import RdzvClient
from node_agent.client.ports import free_port
from node_agent.client.replies import ENDINGS, OTHER_ENDING, refusal
from node_agent.plugin.agent_store import AgentStore
from node_agent.plugin.failures import worker_failures
from node_agent.plugin.probes import PROBED_KINDS, WorkerProbes
from node_agent.plugin.round_store import JOB_SUCCEEDED, RoundStore, all_arrived, first_line, pauses
from node_agent.plugin.session import (
    JoinRefused,
    ServerSession,
    SessionEnded,
    needs_rendezvous,
    still_in_round,
)
from node_agent.plugin.settings import BACKEND, PluginSettings, SettingsError, plugin_settings
from node_agent.plugin.torch_internals import PrefixStore, Store, TCPStore, launch_settings, run_loop_failures
from node_agent.workers.script_check import script_problem
from protocol.messages import Assignment, JobState, JoinRequest, WorkerFailure

RESTART_COUNT_ENV = "RDZV_SERVER_RESTART_COUNT"   # the job-wide count, for workers (torch's is per agent)
WORKER_PORT_KEY = "worker_master_port"
CONNECT_TRY_S = 2.0   # connecting to group rank 0's store is retried in tries this long, to notice a new round


def create_handler(params: RendezvousParameters) -> RdzvServerHandler:
    launch = launch_settings()
    try:
        settings = plugin_settings(endpoint=params.endpoint or "", run_id=params.run_id, min_nodes=params.min_nodes,
                                   max_nodes=params.max_nodes, local_addr=params.local_addr, conf=params.config,
                                   launch=launch)
    except SettingsError as exc:
        _exit(2, f"torchrun --rdzv-backend {BACKEND}: {exc}")
    if launch is not None and launch.kind == "python" and (
            problem := script_problem(launch.script, local_ranks=launch.local_world_size)):
        _exit(2, f"torchrun --rdzv-backend {BACKEND}: {problem}")
    probed = launch is not None and launch.kind in PROBED_KINDS
    handler = RdzvServerHandler(settings, WorkerProbes(settings.local_world_size) if probed else None)
    if settings.job_id_source:
        handler.say(f"job id {settings.job_id} (from {settings.job_id_source}; --rdzv-id or $PET_RDZV_ID sets another)")
    for key in sorted(set(unquoted(params.config)) & set(IGNORED_KEYS)):
        handler.say(f"--rdzv-conf {key} has no effect with --rdzv-backend {BACKEND}: {IGNORED_KEYS[key]}")
    return handler


def _exit(code: int, message: str) -> NoReturn:
    """One line and an exit status instead of a traceback (torchrun prints any exception in full)."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


class RdzvServerHandler(RendezvousHandler):
    def __init__(self, settings: PluginSettings, probes: WorkerProbes | None = None) -> None:
        self.settings = settings
        self._probes = probes    # which failed workers failed at start (plugin/probes.py)
        self._session: ServerSession | None = None
        self._agent_store: AgentStore | None = None
        self._assignment: Assignment | None = None   # the round torch's workers run
        self._succeeded_round = -1                   # the round whose success this node reported
        self._rounds = 0                             # rounds handed to torch
        self._closed = False
        self._shut_down = False
        atexit.register(self._leave_at_exit)

    def say(self, message: str) -> None:
        print(f"[rdzv-server plugin {self.settings.node_id}] {message}", file=sys.stderr, flush=True)

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """False: worker rank 0 hosts the workers' store, fresh with every start (see the top)."""
        return False

    def get_run_id(self) -> str:
        return self.settings.job_id

    def is_closed(self) -> bool:
        view = self._session.view if self._session is not None else None
        return self._closed or (view is not None and view.job_state.finished)

    def set_closed(self) -> None:
        """This node leaves the job (closing a whole job is an operator's `rdzv-ctl close`)."""
        self._closed = True
        if self._session is not None:
            with contextlib.suppress(SessionEnded):
                self._session.leave("torchrun closed the rendezvous on this node")

    def num_nodes_waiting(self) -> int:
        session, running = self._session, self._assignment
        if session is None or running is None:
            return 0
        moved = session.ended is not None or session.rejoined or needs_rendezvous(session.view, running.round_id)
        return 1 if moved else 0

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError(f"the rendezvous of job {self.settings.job_id!r} is closed on this node")
        session = self._start()
        ran = self._assignment
        failures = None
        # Once the session ended (the server out past server_wait, this node taken over) torch stopped the workers
        # for that: nothing of theirs failed, and a report would only wait out server_wait once more
        if ran is not None and self._succeeded_round != ran.round_id and session.ended is None:
            failures = self._failures(run_loop_failures(None), ran)
            if still_in_round(session.view, ran.round_id):
                self.say(f"round {ran.round_id}: this node's workers failed; reporting it")
            else:   # another node's report ended the round: ours failing at start too is the script's (as node-agent),
                over = session.view is not None and session.view.job_state.finished      # news while the job lives
                failures = None if over else [f for f in failures if f.before_group] or None
                if failures:
                    self.say(f"round {ran.round_id}: this node's workers failed at start too; reporting it")
        self._assignment = None
        after = ran.round_id if ran is not None else -1
        while True:
            assignment = self._next_assignment(session, after, failures)
            failures = None
            try:
                info = self._round_info(assignment)
            except RendezvousConnectionError as exc:   # group rank 0's store unreachable: as a session's end
                self._exit_cleanly(1, str(exc))
            if info is not None:
                break
            after = assignment.round_id   # the round moved on while this node set up its store
        self._assignment, self._rounds = assignment, self._rounds + 1
        if self._probes is not None:
            self._probes.arm()     # torch starts this round's workers once we return
        os.environ[RESTART_COUNT_ENV] = str(assignment.restart_count)
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None
        self.say(f"round {assignment.round_id}: group rank {assignment.group_rank}/{assignment.group_world_size}, "
                 f"world size {assignment.world_size}, master {bootstrap.master_addr}:{bootstrap.master_port}, "
                 f"job restart count {assignment.restart_count}/{assignment.max_restarts}")
        return info

    def shutdown(self) -> bool:
        """torch's launcher calls it at the end, with its exception (if any) on the way out."""
        if self._shut_down:
            return True
        self._shut_down = True
        session, ran = self._session, self._assignment
        if session is None:
            return True
        exc = sys.exc_info()[1]
        failures: list[WorkerFailure] | None = None
        leave, verdict = "", ""
        if ran is not None and self._succeeded_round != ran.round_id:
            if exc is None:      # torch's agent returned: its workers succeeded (no exit barrier was seen)
                self._report_success()
            else:
                failures = self._failures(run_loop_failures(exc), ran)
                leave = "the torchrun agent stopped after its workers failed"
        view = session.view
        if self._succeeded_round >= 0 and view is not None and view.job_state is not JobState.SUCCEEDED:
            if view.job_state.finished:
                verdict = f"this node's workers finished, but {view.job_id!r} {view.job_state.value}: {view.reason}"
            elif needs_rendezvous(view, self._succeeded_round):
                leave = "its workers finished, and torchrun's agent cannot start them again for a new round"
                verdict = (f"the job went on to round {view.round_id} after this node's workers finished; "
                           "torchrun's agent cannot run them again, so this node left the job")
        if not failures and not verdict and view is not None and not view.job_state.finished:
            leave = leave or "the torchrun agent is exiting"
        session.close(ran.round_id if ran is not None else -1, failures, leave)
        if self._probes is not None:
            self._probes.close()
        if verdict and exc is None:
            _exit(1, f"[rdzv-server plugin {self.settings.node_id}] {verdict}")
        return True

    def _start(self) -> ServerSession:
        if self._session is None:
            s = self.settings
            # On --local-addr alone where that is this host's, as node-agent's store (it authenticates nobody)
            self._agent_store = AgentStore(s.addr, self.say)
            client = RdzvClient(s.host, s.port, s.job_id, s.node_id, scheme=s.scheme, token=s.token, tls_ca=s.tls_ca)
            session = ServerSession(s, client, master_port=self._agent_store.port, say=self.say)
            session.start()
            self._session = session
        return self._session

    def _next_assignment(self, session: ServerSession, after: int, failures: list[WorkerFailure] | None) -> Assignment:
        try:
            return session.next_assignment(after, failures)
        except JoinRefused as exc:
            if ENDINGS.get(refusal(exc.code, JoinRequest), OTHER_ENDING)[0] == 0:   # done, nothing failed (drained)
                self._exit_cleanly(0, str(exc))
            self._exit_cleanly(1, str(exc))
        except SessionEnded as exc:
            # The job failed or closed, the server refused or stayed away: one line and exit 1, not an exception
            # torch prints in full (torchrun handles none of its rendezvous errors); 1: this node's workers did not
            # run the job to its end
            self._exit_cleanly(1, str(exc))

    def _failures(self, failures: dict[int, Any] | None, ran: Assignment) -> list[WorkerFailure]:
        at_start = self._probes.failed_at_start if self._probes is not None else lambda local_rank: False
        return worker_failures(failures, ran, self.settings.hostname, at_start)

    def _exit_cleanly(self, code: int, message: str) -> NoReturn:
        self.say(message)
        self.shutdown()
        raise SystemExit(code)

    def _round_info(self, a: Assignment) -> RendezvousInfo | None:
        """The round's store and the workers' MASTER_ADDR/PORT; None when the round moved on meanwhile."""
        if a.group_rank == 0 and self._agent_store is not None:
            self._agent_store.ensure()
        base = self._connect(a)      # group rank 0's own too: its store is a process of its own
        if base is None:
            return None
        inner = PrefixStore(f"rdzv-server/{self.settings.job_id}/{a.round_id}", base)
        if a.group_rank == 0:
            try:
                port = free_port(self.settings.addr)
            except OSError as exc:
                raise RendezvousConnectionError(f"round {a.round_id}: no port for the workers' store: {exc}") from None
            inner.set(WORKER_PORT_KEY, str(port))
        else:
            if not self._wait_for_key(inner, WORKER_PORT_KEY, a):
                return None
            port = int(inner.get(WORKER_PORT_KEY))
        try:
            if not all_arrived(inner, a.group_world_size, lambda: self._moved_on(a.round_id),
                               self.settings.store_timeout_s):
                return None
        except (dist.DistError, TimeoutError) as exc:     # rank 0's store went away, or an agent never came
            if self._moved_on(a.round_id):
                return None
            raise RendezvousConnectionError(f"round {a.round_id}: {first_line(exc)}") from None
        store = RoundStore(inner, self._report_success, lambda: self._barrier_over(a.round_id))
        return RendezvousInfo(store, a.group_rank, a.group_world_size, RendezvousStoreInfo(a.master_addr, port))

    def _connect(self, a: Assignment) -> Store | None:
        """A client of group rank 0's agent store, retried until it answers or the round moves on."""
        deadline = time.monotonic() + self.settings.store_timeout_s
        while True:
            try:
                store = TCPStore(a.master_addr, a.master_port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=CONNECT_TRY_S))
                store.set_timeout(timedelta(seconds=self.settings.store_timeout_s))
                return store
            except (RuntimeError, OSError) as exc:
                if self._moved_on(a.round_id):
                    return None
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"round {a.round_id}: cannot reach group rank 0's store at {a.master_addr}:{a.master_port} "
                        f"for {self.settings.store_timeout_s:g}s (--rdzv-conf read_timeout): "
                        f"{first_line(exc)}") from None

    def _wait_for_key(self, store: Store, key: str, a: Assignment) -> bool:
        """Until group rank 0's agent publishes `key`; False when the round moves on first (rank 0 may
        never come: it died, or finished its workers and cannot run another round)."""
        deadline = time.monotonic() + self.settings.store_timeout_s
        problem = "it did not publish the workers' port"
        for pause in pauses():
            try:
                if store.check([key]):
                    return True
            except dist.DistError as exc:    # its store went away: the server will say why
                problem = f"its store failed: {first_line(exc)}"
            if self._moved_on(a.round_id):
                return False
            if time.monotonic() >= deadline:
                raise RendezvousConnectionError(
                    f"round {a.round_id}: group rank 0's agent at {a.master_addr}:{a.master_port}: {problem} "
                    f"within {self.settings.store_timeout_s:g}s (--rdzv-conf read_timeout)")
            time.sleep(pause)
        return False

    def _moved_on(self, round_id: int) -> str:
        """Why `round_id` is over for this node ("" while it is not)."""
        session = self._session
        if session is None:
            return ""
        if session.ended is not None:
            return str(session.ended)
        view = session.view
        if needs_rendezvous(view, round_id):
            assert view is not None
            return f"job {view.job_state.value}, round {view.round_id}, this node {view.node_state.value}"
        return ""

    def _barrier_over(self, round_id: int) -> str:
        view = self._session.view if self._session is not None else None
        return JOB_SUCCEEDED if view is not None and view.job_state is JobState.SUCCEEDED else self._moved_on(round_id)

    def _report_success(self) -> None:
        """This node's workers of the running round all exited 0 (torch's exit barrier began)."""
        ran, session = self._assignment, self._session
        if ran is None or session is None or self._succeeded_round == ran.round_id:
            return
        self._succeeded_round = ran.round_id
        with contextlib.suppress(SessionEnded):
            session.report_success(ran.round_id)

    def _leave_at_exit(self) -> None:
        """torch skips shutdown() when a signal stops its agent: leave, so the others go on at once."""
        if self._session is not None and not self._shut_down:
            self._shut_down = True
            with contextlib.suppress(Exception):
                self._session.close(leave_reason="the torchrun agent exited")
        if self._probes is not None:
            self._probes.close()
