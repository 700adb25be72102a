"""What every route module shares: the app's coordinator key and the job id rule for paths."""
from __future__ import annotations

from aiohttp import web

from protocol.codec import DecodeError
from protocol.errors import ErrorCode
from protocol.ids import job_id_problem
from rdzv_server.coordinator import Coordinator

COORDINATOR = web.AppKey("coordinator", Coordinator)

def job_id_of(request: web.Request) -> str:
    """The `{job_id}` of the path, or a 400 naming the rule it breaks."""
    job_id = request.match_info["job_id"]
    if problem := job_id_problem(job_id):
        raise DecodeError(ErrorCode.BAD_REQUEST, problem)
    return job_id
