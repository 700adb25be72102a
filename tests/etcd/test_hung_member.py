"""An etcd member that takes connections but never answers (a stopped process, or a host cut off after
the handshake) in front of a real cluster: the store, built as rdzv-server builds it, waits on it no
longer than the election does (one request's timeout from the leader's TTL), then commits through the
next member and stays there."""
from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from rdzv_server.cli import build_parser, replication
from rdzv_server.store.etcd.client import EtcdClient, created_at, put
from rdzv_server.store.etcd.election import Leadership
from rdzv_server.store.etcd.store import EtcdStore
from rdzv_server.store.snapshots import snapshot
from tests.ports import free_port
from tests.unit.test_store import every_state


class HungMember:
    """Listens, accepts, reads every request and answers none."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.requests: list[bytes] = []
        self.hung_up = threading.Event()         # a client gave up on a request and closed the connection
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._read, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    self.hung_up.set()
                    return
                self.requests.append(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def hung():
    member = HungMember()
    try:
        yield member
    finally:
        member.close()


def test_a_commit_waits_on_a_hung_member_no_longer_than_the_election(etcd, settings, hung):
    members = ",".join(e.split("://", 1)[1] for e in settings.endpoints)
    args = build_parser().parse_args(["--store", f"etcd://127.0.0.1:{hung.port},{members}",
                                      "--etcd-prefix", settings.prefix, "--leader-ttl", "8"])
    rep = replication(args)
    assert rep is not None
    store = rep.store

    async def election_timeout() -> float:
        async def nothing() -> None:
            return None
        lead = Leadership(store.settings, store, "http://127.0.0.1:1", rep.leader_ttl_s, on_elected=nothing,
                          on_deposed=nothing)
        return lead._client.settings.timeout_s

    assert store.settings.timeout_s <= asyncio.run(election_timeout())
    assert store.settings.timeout_s < rep.leader_ttl_s / 2       # two hung members still leave the lease some

    # the election key, as the leader would hold it, put through the live members with the fixture's timeout: a
    # create-if-absent that timed out on a loaded machine after it committed would fail its retry
    client = EtcdClient(settings)
    ok, reply = client.txn([created_at(store.leader_key, 0)], [put(store.leader_key, b"http://me:1")])
    client.close()
    assert ok
    store.fence = int(reply["header"]["revision"])
    hung.requests.clear()
    hung.hung_up.clear()
    rz = every_state()
    jobs = [snapshot(job, job.nodes, job.events, reset=True) for job in rz.jobs.values()]
    store.write(jobs[:1], 1.0)
    assert any(b"POST /v3/kv/txn" in r for r in hung.requests), "the hung member was not tried first"
    assert hung.hung_up.wait(5), "the store did not give up on the hung member"
    tried = len(hung.requests)
    store.write(jobs[1:2], 2.0)                 # the member that answered is tried first now
    assert len(hung.requests) == tried
    store.release()
    assert set(EtcdStore(settings).load().jobs) == {s.job_id for s in jobs[:2]}
