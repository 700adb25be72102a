"""The command line as given (each flag, else torchrun's PET_* variable) with the spelling used, so that every
error names the flag as the user wrote it; and the job's settings built from it (`job_config`)."""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any, NoReturn

import msgspec

from node_agent.cli.flags import BY_DEST, FLAGS
from node_agent.cli.rdzv_conf import INT_KEYS, SECONDS_KEYS
from node_agent.cli.values import Fail, _int, _on_off, _seconds
from protocol.messages import JobConfig


class OptionsError(ValueError):
    """A bad command line; the message is one line meant for the user."""


JOB_DEFAULTS: dict[str, Any] = {f.name: f.default for f in msgspec.structs.fields(JobConfig)}


class CommandLine:
    """The flags as given (command line, else PET_*); errors name the spelling used (`--rdzv_id`, `$PET_NNODES`)."""

    def __init__(self, ns: Any, environ: Mapping[str, str]) -> None:
        typed: dict[str, str] = ns.__dict__.get("_spelling", {})
        self.values: dict[str, Any] = {}
        self.spelling: dict[str, str] = {}
        for flag in FLAGS:
            value = getattr(ns, flag.dest)
            if value is not None:
                self.values[flag.dest] = value
                self.spelling[flag.dest] = typed.get(flag.dest) or flag.spellings[0]
            elif flag.pet and environ.get(flag.pet):   # torchrun's PET_* variable, set and not empty
                raw = environ[flag.pet]
                self.spelling[flag.dest] = f"${flag.pet}"
                self.values[flag.dest] = raw if flag.metavar is not None else self._switch(flag.dest, raw)

    def _switch(self, dest: str, raw: str) -> bool:
        try:
            return bool(int(raw))       # torchrun's rule for PET_STANDALONE, PET_MODULE, ...
        except ValueError:
            self.fail(dest, f"expected 0 or 1, got {raw!r}")

    def get(self, dest: str) -> Any:
        return self.values.get(dest)

    def name(self, dest: str) -> str:
        return self.spelling.get(dest) or BY_DEST[dest].spellings[0]

    def fail(self, dest: str, why: str) -> NoReturn:
        raise OptionsError(f"{self.name(dest)}: {why}")

    def failing(self, dest: str) -> Fail:
        return lambda why: self.fail(dest, why)


def one_line(message: str) -> NoReturn:
    raise OptionsError(message)


def job_config(line: CommandLine, conf: Mapping[str, str], min_nodes: int, max_nodes: int,
               nodes_flag: str) -> JobConfig:
    """The job's settings from the flags given, then --rdzv-conf's keys (which win, as for the plugin);
    JobConfig supplies the defaults and bounds."""
    values: dict[str, Any] = {"min_nodes": min_nodes, "max_nodes": max_nodes}
    source: dict[str, tuple[str, Fail]] = {   # field -> (text, fail)
        f.dest: (line.get(f.dest), line.failing(f.dest)) for f in FLAGS
        if f.dest in JOB_DEFAULTS and line.get(f.dest) is not None}
    for key, value in conf.items():
        field = SECONDS_KEYS.get(key) or (key if key in INT_KEYS and key in JOB_DEFAULTS else None)
        if field is not None and not (key == "timeout" and "join_timeout" in conf):
            source[field] = (value, functools.partial(_conf_fail, key))
    for field, (raw, fail) in source.items():
        default = JOB_DEFAULTS[field]
        values[field] = (_on_off(raw, fail) if isinstance(default, bool) else
                         _int(raw, fail) if isinstance(default, int) else
                         _codes(raw, fail) if isinstance(default, tuple) else _seconds(raw, fail))
    try:
        return msgspec.convert(values, JobConfig)
    except msgspec.ValidationError as exc:   # e.g. "Expected `int` >= 0 - at `$.max_restarts`"
        text, _, where = str(exc).partition(" - at ")
        field = where.strip("`").removeprefix("$.")
        why = re.sub(r"^Expected `\w+` ", "must be ", text)
        if field in source:
            source[field][1](f"{why}, got {source[field][0]!r}")
        line.fail(nodes_flag if field in ("min_nodes", "max_nodes") else field, why)


def _codes(raw: str, fail: Fail) -> tuple[int, ...]:
    """`16,17` -> (16, 17); `none` or nothing -> ()."""
    if raw.strip().lower() in ("", "none"):
        return ()
    return tuple(_int(part.strip(), fail) for part in raw.split(","))


def _conf_fail(key: str, why: str) -> NoReturn:
    raise OptionsError(f"--rdzv-conf {key}: {why}")
