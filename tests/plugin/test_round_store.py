"""The agents' round store: torch's own exit barrier on it reports success, and is abandoned when
the job moves on. A real TCPStore in this process; the barrier is torch's (elastic.utils.store)."""
from __future__ import annotations

import threading

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier

from node_agent.plugin.round_store import EXIT_BARRIER, JOB_SUCCEEDED, RoundStore


@pytest.fixture
def tcp_store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_entering_the_exit_barrier_reports_success_once_per_agent(tcp_store):
    reported: list[int] = []
    stores = [RoundStore(dist.PrefixStore("job/1", tcp_store), lambda i=i: reported.append(i), lambda: "")
              for i in range(2)]
    errors: list[BaseException] = []

    def agent(store: RoundStore) -> None:
        try:
            barrier(store, 2, EXIT_BARRIER, 30)
        except BaseException as exc:   # reported below, in the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=agent, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and sorted(reported) == [0, 1]


def test_the_exit_barrier_is_abandoned_when_the_job_moves_on(tcp_store):
    checks = iter(["", "", "round 2 formed without this node"])
    store = RoundStore(dist.PrefixStore("job/1", tcp_store), lambda: None, lambda: next(checks))
    with pytest.raises(dist.DistStoreError, match="exit barrier abandoned: round 2 formed"):
        barrier(store, 2, EXIT_BARRIER, 60)    # the other agent never arrives


def test_the_exit_barrier_ends_when_the_server_says_every_node_succeeded(tcp_store):
    checks = iter(["", JOB_SUCCEEDED])
    store = RoundStore(dist.PrefixStore("job/1", tcp_store), lambda: None, lambda: next(checks))
    barrier(store, 2, EXIT_BARRIER, 60)    # returns: the other agent reported success and went away
    with pytest.raises(StopIteration):
        next(checks)


def test_other_keys_pass_through_with_the_round_prefix(tcp_store):
    store = RoundStore(dist.PrefixStore("job/7", tcp_store), lambda: pytest.fail("not a barrier"), lambda: "")
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    assert store.add("n", 2) == 2 and store.check(["a", "n"])
    store.wait(["a"])
    assert tcp_store.get("job/7/a") == b"1" and not tcp_store.check(["a"])
