"""A body refused past MAX_BODY_BYTES is not kept by its refusal (rdzv_server/web/connections.py, read_body): the
refusal's traceback holds the frames it passed, in a cycle with the wait_for task that a tick of the server's gc
freezer may have frozen (gc_tuning.py), reclaimed only at the hourly collection. aiohttp's read() kept the MiB it
had read there: a real server's RSS 47 -> 309 -> 580 -> 825 MiB over three waves of 40 endless chunked bodies."""
from __future__ import annotations

import asyncio
import traceback
from unittest import mock

import pytest
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request

from protocol.codec import CONTENT_TYPE, MAX_BODY_BYTES
from protocol.errors import ErrorCode
from rdzv_server.core.errors import RendezvousError
from rdzv_server.web.connections import read_body

PIECE = 1 << 16


async def test_a_body_refused_past_the_cap_leaves_no_piece_of_it_in_the_refusal() -> None:
    payload = streams.StreamReader(mock.Mock(_reading_paused=False), PIECE, loop=asyncio.get_running_loop())
    request = make_mocked_request("POST", "/v1/jobs/j/poll", payload=payload, client_max_size=MAX_BODY_BYTES,
                                  headers={"Transfer-Encoding": "chunked", "Content-Type": CONTENT_TYPE})
    for _ in range(2 * MAX_BODY_BYTES // PIECE):     # still coming: no end of the body fed
        payload.feed_data(b"\x90" * PIECE)
    with pytest.raises(Exception) as caught:
        await read_body(request)
    kept = [(frame.f_code.co_name, name, len(value))
            for frame, _ in traceback.walk_tb(caught.value.__traceback__)
            for name, value in frame.f_locals.items()
            if isinstance(value, (bytes, bytearray, memoryview)) and len(value) >= PIECE]
    assert kept == []
    assert isinstance(caught.value, RendezvousError) and caught.value.code == ErrorCode.TOO_LARGE
