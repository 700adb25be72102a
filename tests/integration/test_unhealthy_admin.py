"""A node leaving unhealthy, seen from the real app: its event, the hold in /v1/status and on the page,
the counter by kind in /metrics, the refused join of its host, and the operator's clear-unhealthy."""
from __future__ import annotations

import asyncio

from tests.integration.support import url
from tests.integration.test_admin import running_job


async def get_text(http, server, path: str) -> str:
    async with http.get(url(server, path)) as resp:
        assert resp.status == 200
        return await resp.text()


async def test_an_unhealthy_leave_is_recorded_held_counted_and_cleared_by_the_operator(server, http) -> None:
    a, b, c = await running_job(http, server, "gpujob", ("a", "b", "c"), min_nodes=2, max_nodes=2)
    waiter = asyncio.create_task(a.poll(known_round=1, wait_s=10))
    reason = "unhealthy: GPU check: GPU 0 (0000:1b:00.0): NVML: GPU is lost"
    await b.post("leave", {"reason": reason, "unhealthy": "gpu"})
    woken = await asyncio.wait_for(waiter, 5)            # the spare c takes b's place at once
    assert woken["assignment"]["round_id"] == 2 and woken["restart_count"] == 0
    events = (await (await http.get(url(server, "/v1/jobs/gpujob/events"))).json())["events"]
    gone = next(e for e in events if e["kind"] == "node_unhealthy")
    assert gone["node_id"] == "b" and gone["message"] == f"node b left: {reason}"
    assert gone["data"] == {"kind": "gpu", "host": "10.0.0.1"}

    status = await (await http.get(url(server, "/v1/status"))).json()
    [held] = status["unhealthy_hosts"]
    assert (held["host"], held["kind"], held["job_id"], held["node_id"], held["reason"]) == \
        ("10.0.0.1", "gpu", "gpujob", "b", reason)
    metrics = await get_text(http, server, "/metrics")
    assert 'rdzv_nodes_unhealthy_total{reason="gpu"} 1.0' in metrics
    assert 'rdzv_nodes_unhealthy_total{reason="health_check"} 0.0' in metrics
    assert "rdzv_unhealthy_hosts 1.0" in metrics
    page = await get_text(http, server, "/")
    assert "<h2>Unhealthy hosts</h2>" in page and "NVML: GPU is lost" in page

    refused = await b.join(expect=409)                   # its host is held out
    assert refused["code"] == "host_unhealthy" and "clear-unhealthy 10.0.0.1" in refused["message"]
    assert (await clear(http, server, "10.0.0.1"))["cleared"]["node_id"] == "b"
    assert (await b.join())["node_state"] == "spare"
    assert (await clear(http, server, "10.0.0.1", expect=404))["code"] == "not_found"


async def clear(http, server, host: str, expect: int = 200) -> dict:
    async with http.post(url(server, f"/v1/admin/hosts/{host}/clear-unhealthy"), data=b"",
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == expect
        return await resp.json()
