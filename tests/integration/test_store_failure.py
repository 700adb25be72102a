"""A commit the store refuses (a full disk): the reply says so, and the change is not kept."""
from __future__ import annotations

import sqlite3

import msgpack
import pytest

from rdzv_server.coordinator import Coordinator
from rdzv_server.looplag import LoopLagMeter
from rdzv_server.store.sqlite import SqliteStore
from rdzv_server.web.app import COORDINATOR, create_app
from tests.integration.support import remember_credential, start_app, url, with_credential

MSGPACK = {"Content-Type": "application/msgpack"}


class FullDisk(SqliteStore):
    """The real store, whose next `fail` commits fail as SQLite does on a full disk."""
    fail = 0

    def write(self, snapshots, alive_at, deleted=()):
        if self.fail and snapshots:
            self.fail -= 1
            raise sqlite3.OperationalError("database or disk is full")
        super().write(snapshots, alive_at, deleted)


async def join(http, srv, job: str, node: str) -> tuple[int, dict]:
    body = with_credential(srv, job, {"v": 1, "node_id": node, "addr": "10.0.0.1", "local_world_size": 1,
                                      "master_port": 1, "config": {"min_nodes": 2, "max_nodes": 2}})
    async with http.post(url(srv, f"/v1/jobs/{job}/join"), data=msgpack.packb(body), headers=MSGPACK) as resp:
        reply = msgpack.unpackb(await resp.read())
        remember_credential(srv, job, node, reply)
        return resp.status, reply


async def test_a_full_disk_refuses_the_join_by_name_and_keeps_nothing_of_it(tmp_path, http):
    store = FullDisk(str(tmp_path))
    srv = await start_app(create_app(Coordinator(store=store, loop_lag=LoopLagMeter())))
    try:
        assert (await join(http, srv, "kept", "a"))[0] == 200
        store.fail = 1
        status, reply = await join(http, srv, "kept", "b")          # the job existed: b's join is refused
        assert status == 503 and reply["code"] == "store_unavailable"
        assert "is full" in reply["message"]
        core = srv.app[COORDINATOR].core
        assert set(core.jobs["kept"].nodes) == {"a"} and core.node_count == 1
        store.fail = 1
        status, _ = await join(http, srv, "new", "a")                # a new job: not created at all
        assert status == 503 and "new" not in core.jobs
        assert (await join(http, srv, "kept", "b"))[0] == 200       # the disk has room again
        assert core.jobs["kept"].round is not None
    finally:
        await srv.close()
    assert set(SqliteStore(str(tmp_path)).load().jobs) == {"kept"}


async def test_restored_jobs_that_cannot_be_saved_refuse_the_start_in_one_line(tmp_path):
    from rdzv_server.core.rendezvous import Rendezvous
    from rdzv_server.store.api import StoreError
    from tests.unit.test_store import _save, every_state

    first = SqliteStore(str(tmp_path))
    _save(first, every_state())
    first.release()
    store = FullDisk(str(tmp_path))
    store.fail = 1
    coordinator = Coordinator(Rendezvous(), store=store)
    try:
        with pytest.raises(StoreError, match="cannot save the restored jobs: .*is full"):
            await coordinator.start()
        assert not coordinator.serving()
    finally:
        await coordinator.persister.close()
