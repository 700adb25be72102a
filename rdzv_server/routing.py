"""What every route module shares: the app's coordinator key and the job id rule for paths."""
from __future__ import annotations

import re

from aiohttp import web

from protocol.codec import DecodeError
from protocol.errors import ErrorCode
from rdzv_server.coordinator import Coordinator

COORDINATOR = web.AppKey("coordinator", Coordinator)

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def job_id_of(request: web.Request) -> str:
    """The `{job_id}` of the path, or a 400 naming the rule it breaks."""
    job_id = request.match_info["job_id"]
    if not JOB_ID.fullmatch(job_id):
        raise DecodeError(ErrorCode.BAD_REQUEST,
                          f"job id must be 1-128 of [A-Za-z0-9._:-] starting with a letter or digit, got {job_id!r}")
    return job_id
