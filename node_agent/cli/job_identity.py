"""Which job a node belongs to at a shared rdzv-server: the job's id, and a fingerprint of its command. No default
may put unrelated runs into one job (a second user's run would become a spare of the first's and "succeed"
without running). The id is the first of: the one given (`--rdzv-id`/`--job-id`, `$PET_RDZV_ID`; torchrun's
default `none` counts as none); the scheduler's job id (SCHEDULER_IDS), the same on that job's nodes only; the
user's name and a hash of the command (`alice-3f2a9c1b7d0e`), the same for the same user and command. Each
join carries the command's fingerprint: the server refuses a node whose command differs from the job's."""
from __future__ import annotations

import getpass
import hashlib
import json
import re
from collections.abc import Mapping, Sequence

TORCHRUN_DEFAULT_ID = "none"
# (variable, id format, qualifier, separator); the first one set wins. The qualifier, when set, is appended: Slurm's
# step inside an srun step; a JobSet's uid, as its name is reused by a new JobSet.
SCHEDULER_IDS = (
    ("SLURM_JOB_ID", "slurm-{}", "SLURM_STEP_ID", "."),
    ("JOBSET_NAME", "jobset-{}", "JOBSET_UID", "-"),
    ("PBS_JOBID", "pbs-{}", "", ""),
    ("LSB_JOBID", "lsf-{}", "", ""),
)


def command_fingerprint(kind: str, script: str, args: Sequence[str]) -> str:
    """A short hash of how the workers are started: `kind` (python, module, program, run-path), the
    script and its arguments. The same on every node that runs the same command."""
    return hashlib.sha256(json.dumps([kind, script, *args]).encode()).hexdigest()[:16]


def _clean(text: str) -> str:
    """`text` as a piece of a job id: other characters become '-', and it starts with a letter or digit."""
    return re.sub(r"^[^A-Za-z0-9]+", "", re.sub(r"[^A-Za-z0-9_.:@+=~-]", "-", text)) or "x"


def scheduler_job_id(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(id, where it came from) from the scheduler's variables, or None outside a known scheduler."""
    for variable, form, qualifier, sep in SCHEDULER_IDS:
        value = environ.get(variable, "").strip()
        if value:
            job_id = form.format(_clean(value))
            extra = environ.get(qualifier, "").strip() if qualifier else ""
            if extra:
                return f"{job_id}{sep}{_clean(extra)}", f"${variable}{sep}${qualifier}"
            return job_id, f"${variable}"
    return None


def default_job_id(environ: Mapping[str, str], fingerprint: str) -> tuple[str, str]:
    """(id, where it came from) when no id was given: the scheduler's, else user and command."""
    return scheduler_job_id(environ) or (f"{_clean(_user(environ))}-{fingerprint[:12]}",
                                         "your user name and the command's fingerprint")


def _user(environ: Mapping[str, str]) -> str:
    """The user's name as getpass finds it, from `environ` first."""
    for variable in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        if environ.get(variable):
            return environ[variable]
    try:
        return getpass.getuser()
    except (KeyError, OSError):   # no user name for this uid (some containers)
        return "user"
