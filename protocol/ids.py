"""The identifier rules both sides check: a job id (in the URL path) and a node id (in every request), defined once
so the agent refuses a bad id before it connects, in the server's words. Job ids take what tools put in --rdzv-id
(`team/exp1`), percent-encoded by clients, escaped when shown; URL, HTML and shell metacharacters are refused."""
from __future__ import annotations

import re

from protocol.quoting import quote

JOB_ID_RULE = "1-512 of [A-Za-z0-9_.:@/+=~-] starting with a letter or digit"
NODE_ID_RULE = "1-128 of [A-Za-z0-9._:@-] starting with a letter or digit"
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/+=~-]{0,511}")
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def job_id_problem(job_id: str) -> str:
    """Why `job_id` is not a valid job id ("" when it is)."""
    return "" if JOB_ID.fullmatch(job_id) else f"job id must be {JOB_ID_RULE}, got {quote(job_id)}"


def node_id_problem(node_id: str) -> str:
    """Why `node_id` is not a valid node id ("" when it is)."""
    return "" if NODE_ID.fullmatch(node_id) else f"node id must be {NODE_ID_RULE}, got {quote(node_id)}"
