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


PATH_ECHOES = (b"no route ", b" not allowed on ", b" id must be 1-128 of ", b"no agent action ")

KNOWN_ISSUES: list[KnownIssue] = [
    KnownIssue("test_a_refusal_does_not_echo_a_huge_value_whole",
               lambda req, reply, problem: problem.startswith("message of ") and (
                   b"unsupported_version" in reply.body or b" must be an integer, got " in reply.body
                   or b" must be a string, got " in reply.body)),
    KnownIssue("test_errors_about_the_path_quote_it_short_and_on_one_line",
               lambda req, reply, problem: problem.startswith(("message is not one line", "message of "))
               and any(marker in reply.body for marker in PATH_ECHOES)),
    KnownIssue("test_a_non_utf8_authorization_header_is_refused_not_a_500",
               lambda req, reply, problem: problem == "HTTP 500" and any(
                   k == "Authorization" and isinstance(v, bytes) and not v.isascii() for k, v in req.headers),
               log="in presented_token"),
    KnownIssue("test_a_lone_surrogate_in_an_admin_reason_is_refused_or_kept",
               lambda req, reply, problem: problem == "HTTP 503" and b"could not save this change (a bug" in reply.body,
               log="surrogates not allowed"),
    KnownIssue("test_a_client_gone_mid_body_is_not_an_internal_error",
               lambda req, reply, problem: False, log="ConnectionResetError: Connection lost"),
    KnownIssue("test_a_body_that_does_not_decode_logs_no_traceback",
               lambda req, reply, problem: False, log="RequestPayloadError"),
    KnownIssue("test_client_text_with_a_line_break_does_not_break_later_error_messages",
               lambda req, reply, problem: problem.startswith(("message is not one line", "reason is not one line"))
               and (reply.status == 200 or b"node_drained" in reply.body or b"job_finished" in reply.body)),
]


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
