"""A real one-machine Slurm cluster for tests: slurmctld and two slurmd ("n1", "n2") on this host.

Everything lives in a temporary folder: the config (auth/none, so no munge), state, spool dirs, logs.
Both slurmd run on the same host under different node names and ports (Debian builds Slurm with
multiple-slurmd support). The daemons run in the foreground as our children; `close()` cancels
every job, stops the daemons and kills any process left that carries this cluster's SLURM_CONF
(job steps started by slurmd), so nothing outlives the test.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess

import psutil

from tests.e2e.harness import wait_until
from tests.ports import free_ports

NODES = ("n1", "n2")


class SlurmCluster:
    def __init__(self, root: str) -> None:
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.daemons: list[subprocess.Popen] = []
        self.host = socket.gethostname().split(".")[0]
        ctld_port, *node_ports = free_ports(1 + len(NODES))
        for sub in ("state", "log", *(os.path.join("spool", n) for n in NODES)):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        plugstack = os.path.join(root, "plugstack.conf")    # empty: ignore /etc/slurm/plugstack.conf
        open(plugstack, "w").close()
        cpus = max(1, len(os.sched_getaffinity(0)))     # what this process may use (a CI runner's cpuset)
        lines = [
            "ClusterName=deploytest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/none", "CredType=cred/none",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log", f"SlurmdLogFile={root}/log/slurmd-%n.log",
            # task/affinity: a step's tasks are bound to the CPUs they were given, as on most clusters
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/affinity", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin", "ReturnToService=2",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            f"PlugStackConfig={plugstack}",
            *(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={p} CPUs={cpus} "
              f"RealMemory=1000 State=UNKNOWN" for n, p in zip(NODES, node_ports, strict=True)),
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
            f"OverSubscribe=YES",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    # -- life cycle ------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        for n in NODES:
            self._daemon(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", self.conf])
        wait_until(lambda: self.node_states() == {n: "idle" for n in NODES}, timeout,
                   lambda: f"both slurmd idle; sinfo says {self.node_states()}; logs:\n{self.logs()}")

    def _daemon(self, name: str, argv: list[str]) -> None:
        out = open(os.path.join(self.root, "log", f"{name}.out"), "w")
        self.daemons.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                             start_new_session=True))
        out.close()

    def close(self) -> None:
        if not self.daemons:
            return
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=10)
        try:
            wait_until(lambda: not self.run("squeue", "-h", "-o", "%i").stdout.strip(), 15, "jobs to end")
        except (AssertionError, subprocess.SubprocessError):
            pass    # the daemons are killed below whatever state the jobs are in
        ours = self._our_processes()
        for p in self.daemons:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.daemons:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for proc in ours | self._our_processes():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.daemons.clear()

    def _our_processes(self) -> set[psutil.Process]:
        """Processes started for this cluster: the daemons' descendants and anything with our SLURM_CONF."""
        found: set[psutil.Process] = set()
        for d in self.daemons:
            try:
                found |= set(psutil.Process(d.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        me = os.getpid()
        for proc in psutil.process_iter():
            try:
                if proc.pid != me and proc.environ().get("SLURM_CONF") == self.conf:
                    found.add(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    # -- commands --------------------------------------------------------------------------------

    def run(self, *argv: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split()[:2] for line in out.splitlines() if line.strip())

    def sbatch(self, args: list[str], env: dict[str, str], cwd: str) -> BatchJob:
        """Submit a batch job; `BatchJob.wait()` gives its exit status. (`sbatch --wait` would do, but it
        checks on the job with growing pauses and notices the end up to half a minute late.)"""
        full = dict(self.env, **env)
        done = subprocess.run(["sbatch", "--parsable", *args], env=full, cwd=cwd, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, f"sbatch {args}: {done.stdout}{done.stderr}"
        return BatchJob(self, done.stdout.strip().split(";")[0])

    def job_fields(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def logs(self, tail: int = 30) -> str:
        parts = []
        logdir = os.path.join(self.root, "log")
        for name in sorted(os.listdir(logdir)):
            with open(os.path.join(logdir, name), errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if "pmix" not in ln]
            parts.append(f"--- {name}\n" + "\n".join(lines[-tail:]))
        return "\n".join(parts)


class BatchJob:
    FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}

    def __init__(self, cluster: SlurmCluster, job_id: str) -> None:
        self.cluster, self.id = cluster, job_id
        self.fields: dict[str, str] = {}

    def finished(self) -> bool:
        self.fields = self.cluster.job_fields(self.id)
        return self.fields.get("JobState") in self.FINISHED

    def wait(self, timeout: float) -> int:
        """The batch script's exit status once the job has ended (Slurm's ExitCode=STATUS:SIGNAL)."""
        wait_until(self.finished, timeout, lambda: f"job {self.id} to end; it is {self.fields.get('JobState')}")
        status, signal_ = (int(x) for x in self.fields["ExitCode"].split(":"))
        return status if signal_ == 0 else 128 + signal_

    def cancel(self) -> None:
        self.cluster.run("scancel", self.id)
