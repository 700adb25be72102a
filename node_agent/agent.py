"""The agent's one loop: facts in (one queue: server_link.py, workers/local.py, signals), through the pure
policy (policy.py), actions out, run in order and narrated (narration.py). With no fact before the policy's
next deadline the loop makes `DeadlinePassed`, so timed rules fire on time.
The clock is monotonic: deadlines are durations here and must not jump with the wall clock (failure
timestamps are wall time: the server compares them across nodes)."""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
import uuid
from collections.abc import Mapping
from typing import TextIO

from node_agent.client.listener import caps_for_descriptors
from node_agent.client.ports import free_port
from node_agent.client.transport import Transport
from node_agent.client.witness import WitnessServer
from node_agent.copies.last_copies import flush_limit
from node_agent.copies.peers import PeerCopies
from node_agent.copies.tls import CopyTls, copy_tls
from node_agent.copies.wire import is_copy_request
from node_agent.core.actions import (
    Action,
    AskWitnesses,
    CheckNode,
    Exit,
    HoldAtSnapshot,
    KeepFrom,
    Leave,
    Rejoin,
    ReportFailure,
    ReportStall,
    ReportSuccess,
    SendNote,
    Spawn,
    StopWorkers,
)
from node_agent.core.facts import DeadlinePassed, Fact, SignalReceived, Stage
from node_agent.core.node_health import RETRY_MIN_S, NodeHealth
from node_agent.core.policy import SupervisionPolicy
from node_agent.narration import Narrator
from node_agent.node_checks import NodeChecks
from node_agent.server_link import ServerLink
from node_agent.settings import AgentSettings, Mode
from node_agent.sources import start_source
from node_agent.witness import witnesses_and_server
from node_agent.workers import succession, writes
from node_agent.workers.interfaces import gloo_interface
from node_agent.workers.local import GroupFactory, LocalWorkers
from node_agent.workers.memory import forget_after
from protocol.descriptors import raise_open_file_limit
from protocol.messages import Assignment, NodeStatus, Witness

SAME_SIGNAL_S = 1.0     # a signal repeated this soon is the first one delivered twice (see _on_signal)


def restartable(settings: AgentSettings, environ: Mapping[str, str]) -> bool:
    """Whether a SIGTERM to this agent may be a restart, after which the job keeps its place (LeaveRequest.stopped): it
    reaches an rdzv-server of its own (a standalone job, or one hosted in-process, ends with its agent), outside a
    Slurm job (there a signal ends the step: scancel, the time limit, preemption). Its next agent has its node id:
    given, or, made from this one's pid, taken with its memory (workers/succession.predecessor)."""
    link = settings.link
    return link.mode is Mode.SERVER and not link.host_if_unserved and "SLURM_JOB_ID" not in environ


class Agent:
    def __init__(self, settings: AgentSettings, transport: Transport, addr: str, console: TextIO | None = None, *,
                 make_group: GroupFactory | None = None, checks: NodeChecks | None = None) -> None:
        self.settings = settings
        link = self.link = settings.link
        self.transport = transport
        self.addr = addr
        self.hostname = socket.gethostname()
        self.instance = uuid.uuid4().hex[:12]   # tells a restarted agent from a duplicate node id
        self.facts: asyncio.Queue[Fact | BaseException] = asyncio.Queue()   # or what broke a source
        self.policy = SupervisionPolicy(server_wait_s=max(link.server_wait, link.job.lease_timeout_s),
                                        lease_timeout_s=link.job.lease_timeout_s,
                                        restartable=restartable(settings, os.environ))
        self.narrator = Narrator(link.node_id, console, addr, server=link.server,
                                 server_wait_s=self.policy.server_wait_s)
        self.workers = LocalWorkers(settings.workers, self.facts.put_nowait, hostname=self.hostname,
                                    make_group=make_group, say=self.narrator.say,
                                    detect_stalls=link.job.hang_detection)
        self.workers.memory.succeeded = link.mode is Mode.SERVER     # its next agent may take its id and memory
        # the secret of this node's previous agent, ended (its memory): proves this one succeeds it at its join
        self._predecessor = self._left_credential()
        # the node's own checks (GPUs, --health-check) and --numa-binding: node_checks.py
        self.checks = checks if checks is not None else NodeChecks(settings.checks, self.narrator.say)
        self._first_signal: tuple[int, float] | None = None   # the signal that asked the agent to stop, and when
        self.exit: Exit | None = None       # how the agent ended (None while it runs)
        # answers the other members' "are you there, and do you hear the server?" (witness.py)
        # strangers may connect to its listeners: their connections are capped together (client/listener.py)
        caps = caps_for_descriptors(raise_open_file_limit())
        self.copies = PeerCopies(self.workers.memory, link.nproc, link.node_id, self.narrator.say,
                                 settings.workers.copy_bandwidth, self._copy_tls(),
                                 server_tls=link.endpoint_scheme == "https", caps=caps,
                                 stepping=self.workers.all_stepping, static=link.mode is Mode.STATIC)
        self.copy_port = 0          # where this node takes peer copies (PeerCopies.listen)
        self.copies.on_copied = self._copied
        self.witness = WitnessServer(addr, lambda: self.policy.in_contact, self._holds,
                                     (is_copy_request, self.copies.serve), caps=caps, say=self.narrator.say)
        self._link: ServerLink | None = None
        self._no_port_said = False
        self._memory_kept = ""       # why this stopped node's memory stays for its next agent ("": it goes)
        self._place_until: float | None = None     # when the job stops keeping this node's place for its next agent
        self._stop_told = False      # its leave told a stop of its workers and the job keeps its place (stop_ended)
        self._memory_closed = False

    now = staticmethod(time.monotonic)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in self.settings.workers.signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self.witness.start()
        self.copy_port = await self.copies.listen(self.addr, self.witness.port)
        try:
            async with self.transport as client:
                link = self._link = ServerLink(client, self.facts.put_nowait, self.now, join=self._join,
                                               poll=self._poll)
                try:
                    code = await self._run(link)
                finally:
                    await link.close()
                # stopped, its workers stopped: once its last copies went, the wait for its next agent starts now
                if self._stop_told:
                    await self._close_memory()
                    if await link.stop_ended():
                        self.narrator.say(f"node {self.link.node_id}'s stop is over: told the server, whose wait "
                                          f"for its next agent starts now")
                return code
        finally:
            for sig in self.settings.workers.signals:
                loop.remove_signal_handler(sig)
            await self._close_memory()
            await self.witness.close()
            self.checks.close()

    async def _close_memory(self) -> None:
        """Once: the last copies sent, and the workers' memory left as the job's end or the next agent needs it."""
        if self._memory_closed:
            return
        self._memory_closed = True
        left = None if self._place_until is None else self._place_until - self.now()
        await self.copies.close(finished=self.policy.job_over, flush_s=flush_limit(left))
        await self.workers.close(keep_memory="" if self.policy.job_over else self._memory_kept)

    async def _run(self, link: ServerLink) -> int:
        chosen = gloo_interface(self.addr, os.environ)
        if chosen is not None:     # workers inherit the agent's environment
            os.environ["GLOO_SOCKET_IFNAME"] = chosen[0]
            self.narrator.say(chosen[1])
        self.checks.start()      # said before any worker starts
        self.workers.cpu_affinity = self.checks.cpu_affinity
        self.workers.gpu_busy = self.checks.gpu_busy
        interval = self.settings.checks.gpu_check_interval
        self.policy.health = NodeHealth(enabled=self.checks.enabled, interval_s=interval,
                                        retry_min_s=min(RETRY_MIN_S, interval), give_up_s=self.link.job.join_timeout_s)
        self.workers.warm_up()   # the environment is final: workers of the first round may start warm
        if not self.workers.ready:
            start_source(self._when_ready(link), self.facts.put_nowait)
        if self.policy.health.enabled:
            await self._do(CheckNode(Stage.JOIN, -1), link)    # the node joins once its checks pass
        else:
            link.rejoin()
        while self.exit is None:
            fact = await self._next_fact()
            actions = self.policy.handle(fact, self.now())
            self.narrator.fact(fact, actions)
            # A poll is held while they run: an agent killed meanwhile closes it (awaiting.py). Not before a
            # Rejoin: the server no longer counts the node, and that poll's answer would say so again (twice said).
            if actions and not any(isinstance(action, Rejoin) for action in actions):
                link.keep_polling()
            for action in actions:
                self.narrator.action(action)
                await self._do(action, link)
            if self.exit is None:
                link.keep_polling()
        return self.exit.code

    async def _next_fact(self) -> Fact:
        """The next fact, or DeadlinePassed once the policy's next deadline comes first."""
        deadline = self.policy.next_deadline()
        try:
            item = await asyncio.wait_for(self.facts.get(), None if deadline is None
                                          else max(0.0, deadline - self.now()))
        except asyncio.TimeoutError:
            return DeadlinePassed()
        if isinstance(item, BaseException):
            raise item   # a source broke (a bug): end here, loudly, rather than wait forever
        return item

    async def _do(self, action: Action, link: ServerLink) -> None:
        match action:
            case StopWorkers(signum=signum, finish_writes=finish_writes):
                # Up to --stop-timeout: the lease must not lapse meanwhile.
                async with link.lease_kept(max(0.2, self.link.job.lease_timeout_s / 3)):
                    await self.workers.stop(signum, finish_writes)
            case Spawn(assignment=assignment):
                # Its previous agent may still stop its workers, a fetch or a zygote take a while: past a lease,
                # which must not lapse meanwhile (a review: the node was lost and excluded for 300 s)
                async with link.lease_kept(max(0.2, self.link.job.lease_timeout_s / 3)):
                    await self._spawn(assignment)
            case ReportFailure(round_id=round_id, failures=failures):
                link.report_failure(round_id, failures, self.workers.progress_note(round_id))
            case ReportSuccess(round_id=round_id):
                link.report_success(round_id, self.workers.progress_note(round_id))
            case ReportStall(round_id=round_id, threshold_s=threshold_s, ranks=ranks):
                link.report_stall(round_id, threshold_s, ranks)
            case SendNote():
                link.poll_now()
            case HoldAtSnapshot(on=on):
                self.workers.memory.hold(on)
            case KeepFrom(step=step, held=held):
                self.workers.memory.keep_from(step, held)
            case Rejoin():
                link.rejoin()
            case Leave(reason=reason, unhealthy=unhealthy, stopped=stopped, stops_workers=stops_workers):
                kept = await link.leave(reason, unhealthy, stopped,
                                        writes.stop_bound(self.settings.workers.stop_timeout) if stops_workers else 0.0)
                # no answer: its memory stays as a killed agent's would (its next agent may find the job waiting)
                node = self.link.node_id
                self._place_until = self.now() + kept if stopped and kept else None
                self._stop_told = stopped and stops_workers and bool(kept)
                self._memory_kept = "" if not stopped or kept == 0 else \
                    f"the job keeps node {node}'s place for its next agent" if kept else \
                    f"the server did not answer node {node}'s leave: as a killed agent's, its memory stays"
            case CheckNode():
                start_source(self._check(action), self.facts.put_nowait)
            case AskWitnesses(witnesses=witnesses):
                start_source(self._ask_witnesses(witnesses), self.facts.put_nowait)
            case Exit():
                self.exit = action

    async def _spawn(self, assignment: Assignment) -> None:
        # (its previous agent may still stop its workers: the same --stop-timeout, and a margin)
        await succession.predecessor_gone(self.workers.memory, self.settings.workers.stop_timeout + 5.0,
                                          self.transport.credential)
        succession.settle(self.workers.memory)
        await succession.opened(self.workers.memory)     # (off the loop: a claim may wait)
        dirs = self.workers.memory.dirs_for(assignment.local_world_size, assignment.rank_offset,
                                            assignment.run, assignment.ranks_alike)
        succession.keep_credential(self.workers.memory, self.transport.credential)    # for its next agent
        if assignment.resume_at_most >= 0 and (gone := forget_after(assignment.resume_at_most, dirs)):
            self.narrator.say(f"the job's replicas diverged after step {assignment.resume_at_most}: "
                              f"snapshots of step(s) {', '.join(map(str, gone))} removed")
        self.workers.memory.hold(False)       # a hold was the last round's
        self.workers.memory.keep_from(*self.policy.keep_from)     # (a predecessor's mark: not this job's)
        await self.copies.before_spawn(assignment, dirs)      # a fetch goes on while the workers start
        # Copies no node will fetch from here (the server knows): of gone nodes, or of members whose copy landed at
        # their new holder. Their room is the live members' pushes'. (Said so: a member's are not "gone".)
        if (held := self.copies.store) is not None and assignment.copies_wanted is not None and \
                (dropped := held.drop_unwanted(assignment.copies_wanted)):
            self.narrator.say(f"peer copies: dropped those of node(s) {', '.join(dropped[:5])}"
                              f"{' ...' if len(dropped) > 5 else ''}: no longer held here (gone from the job, or "
                              f"their copies are with another holder now), and no node will fetch them from here")
        await self.workers.spawn(assignment)

    async def _check(self, action: CheckNode) -> None:
        self.facts.put_nowait(await self.checks.check(action, self.workers.stuck_pids))

    async def _ask_witnesses(self, witnesses: tuple[Witness, ...]) -> None:
        self.facts.put_nowait(await witnesses_and_server(witnesses, self.policy.known_round, self.transport.reach))

    def _copied(self) -> None:
        """A copy reached its peer: while a swap waits for it (the ranks hold), or a fetched node's copies wait for
        the server to hear it (PeerCopies.heard), the server hears it now."""
        if (self.policy.holding or self.copies.let_go is not None) and self._link is not None:
            self._link.poll_now()

    def _holds(self) -> int:
        """The round a witness says this node runs: the policy's, or a newer one already assigned while the
        loop was busy (what a cut-off peer must hear: it was replaced)."""
        assigned = self._link.assigned_round if self._link is not None else -1
        known = self.policy.known_round
        return max(known, assigned) if known >= 0 else known

    def _on_signal(self, signum: int) -> None:
        """The first signal stops the workers with it, leaves and exits; a second forces the exit (kill, no
        clean-up), like a second Ctrl-C. The same signal within SAME_SIGNAL_S is the first delivered twice:
        Ctrl-C reaches the whole foreground group, and a wrapper there (timeout, srun) forwards it again."""
        now = self.now()
        if self._first_signal is not None:
            first, at = self._first_signal
            if signum == first and now - at < SAME_SIGNAL_S:
                return
            self.workers.kill()
            self.narrator.forced_exit(signum)
            os._exit(128 + signum)
        self._first_signal = (signum, now)
        self.facts.put_nowait(SignalReceived(signum))

    def _left_credential(self) -> str:
        return succession.left_credential(self.workers.memory) if self.link.mode is Mode.SERVER and \
            self.workers.memory.enabled else ""

    async def _join(self) -> NodeStatus:
        # a predecessor that still stopped its workers as this agent started may have ended since: where its leave
        # never reached the server (away meanwhile), its secret is what takes the node's record before its lease ends
        self._predecessor = self._predecessor or self._left_credential()
        return await self.transport.join(
            addr=self.addr, host=self.hostname, local_world_size=self.link.nproc, master_port=self._free_port(),
            config=self.link.job, instance=self.instance, role=self.link.role, witness_port=self.witness.port,
            command=self.link.command, checks=self.checks.summary, ready=self.workers.ready,
            domain=self.link.failure_domain, copy_port=self.copy_port, store_per_round=True, launcher="node-agent",
            copy_verifiers=True, predecessor=self._predecessor)

    def _free_port(self) -> int:
        """A port for the store, should this node host the next round's (0: none to offer now: the server keeps the
        one offered before). Out of descriptors it is said, once, and tried again on the next request."""
        try:
            return free_port(self.addr)
        except OSError as exc:
            if not self._no_port_said:
                self._no_port_said = True
                self.narrator.say(f"no port to offer for the round's store ({exc.strerror or exc}): the server keeps "
                                  f"the one offered before; tried again on the next request")
            return 0

    def _copy_tls(self) -> CopyTls | None:
        """The TLS contexts of peer copies from --tls-cert/--tls-key/--tls-ca (None: not given, or unusable: said)."""
        link = self.link
        if link.tls_cert is None or link.tls_key is None or link.tls_ca is None:
            return None
        try:
            return copy_tls(link.tls_cert, link.tls_key, link.tls_ca)
        except (ssl.SSLError, OSError) as exc:
            self.narrator.say(f"peer copies off: --tls-cert/--tls-key/--tls-ca cannot be used ({exc})")
            return None

    async def _poll(self, wait_s: float) -> NodeStatus:
        known = self.policy.known_round
        self.workers.memory.alive()
        status = await self.transport.poll(known, wait_s, master_port=self._free_port(),
                                           progress=self.workers.progress_note(known) if known >= 0 else None,
                                           ready=self.workers.ready, copies=(copies := self.copies.note()),
                                           checks_passed=self.policy.health.readmit_passed,
                                           holding=self.policy.holding)
        self.copies.heard(copies)       # answered: the server knows what it said (a fetched node's copies may go)
        self.copies.told(status.sources_noted)      # at once, not as a fact: a leaver's last push waits on it
        self.copies.landed = status.moved_landed    # (a moving member's copy held here makes room only then)
        return status

    async def _when_ready(self, link: ServerLink) -> None:
        """The server forms rounds only of nodes that can start their workers at once: say so as soon as this one
        can (its warm interpreter imported what it preloads), in a poll of its own beside the held one."""
        waited = self.now()
        self.narrator.say("preparing: the warm interpreter imports what the workers need; this node enters a "
                          "round once it is ready")
        await self.workers.until_ready()
        if self.exit is not None:       # the agent is ending (refused, stopped): its zygote was closed, not ready
            return
        self.narrator.say(f"ready after {self.now() - waited:.1f}s: this node's workers can start at once")
        link.poll_now()
