"""Findings the fuzzers have made that the server does not fix yet.

Each has a minimal reproducer in test_findings.py, marked xfail(strict=True). The suite's fuzz test
sets a reply (or a server log error) that matches one aside instead of failing on it, so the suite
stays green while it is open; `make fuzz` lists them, and still fails on any 5xx among them.
Fixing one: make the server right, drop the xfail marker of its reproducer (the strict marker
fails the suite until then) and delete its entry here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.fuzz.rawhttp import Reply
    from tests.fuzz.requests import Request


@dataclass(frozen=True)
class KnownIssue:
    reproducer: str                                  # the xfail test in test_findings.py
    matches: Callable[[Request, Reply, str], bool]   # (request, reply, one problem the oracle found)
    log: str = ""                                    # a text in the server log's error (with its traceback)


KNOWN_ISSUES: list[KnownIssue] = []


def known_log(text: str) -> str | None:
    """The reproducer of the known issue whose error the server logged as `text`, or None."""
    for issue in KNOWN_ISSUES:
        if issue.log and issue.log in text:
            return issue.reproducer
    return None


def known(request: Request, reply: Reply, problem: str) -> str | None:
    """The reproducer of the known issue that `problem` is, or None for a new finding."""
    for issue in KNOWN_ISSUES:
        if issue.matches(request, reply, problem):
            return issue.reproducer
    return None
