"""The agent's settings seen flat, as one command line sets them: every part's fields on one object (the
tests of the command line read what a flag set, whichever part runs with it)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from node_agent.settings import AgentSettings


def flat(settings: AgentSettings) -> SimpleNamespace:
    fields: dict[str, object] = {"reply_file": settings.reply_file, "warnings": settings.warnings,
                                 "settings": settings}
    for part in (settings.checks, settings.workers, settings.link):
        fields.update({f.name: getattr(part, f.name) for f in dataclasses.fields(part)})
    fields.update(warm=settings.workers.warm, endpoint=settings.link.endpoint, server=settings.link.server)
    return SimpleNamespace(**fields)
