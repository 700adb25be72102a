"""What one worker is started with (`WorkerLaunch`)."""
from __future__ import annotations

from dataclasses import dataclass

from node_agent.option_values import Std


@dataclass(frozen=True)
class WorkerLaunch:
    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]
    log_dir: str | None          # this rank's directory for stdout.log / stderr.log
    redirect: Std = Std.NONE     # streams that go to the log file only
    tee: Std = Std.NONE          # streams that go to the log file and the console
    echo: bool = True            # False: kept off the console (--local-ranks-filter)
    prefix: str = ""             # e.g. "[host:rank 3]"
    heartbeat: bool = False      # give the worker a heartbeat pipe (NODE_AGENT_HEARTBEAT_FD)

    @property
    def error_file(self) -> str | None:
        """Where the worker writes its error (torch's @record), when it has a place for one."""
        return self.env.get("TORCHELASTIC_ERROR_FILE")
