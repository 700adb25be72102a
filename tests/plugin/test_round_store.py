"""The agents' round store: torch's own exit barrier on it reports success, and is abandoned when
the job moves on. A real TCPStore in this process; the barrier is torch's (elastic.utils.store)."""
from __future__ import annotations

import threading

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier

from node_agent.plugin.round_store import EXIT_BARRIER, JOB_SUCCEEDED, RoundStore, all_arrived
from tests.e2e.harness import wait_until


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


def test_a_round_whose_agents_all_come_goes_on_for_all(tcp_store):
    round_store = dist.PrefixStore("job/1", tcp_store)
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(all_arrived(round_store, 3, lambda: "", 30)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True, True, True]


def test_a_round_that_moved_on_before_all_came_is_void_for_every_agent(tcp_store):
    """A hunt (3 torchrun agents, a late one scaling the job up): group rank 0 of round 1 went into torch's role
    exchange while the other agent had gone on to round 2; torch's multi_get waited out the store's 60 s, and
    DistStoreError left torchrun as a traceback. Now the first to see the round move on voids it, and an agent
    coming later does not go on into torch's exchange either."""
    round_store = dist.PrefixStore("job/1", tcp_store)
    moved = iter(["", "round 2 formed"])
    assert all_arrived(round_store, 2, lambda: next(moved), 30) is False
    assert all_arrived(round_store, 2, lambda: "", 30) is False    # the last to come: the round is void


def test_an_agent_that_sees_the_round_move_on_after_all_came_goes_on_with_them(tcp_store):
    """Either all go on or none: once the last agent said go, the round is theirs, news or not."""
    round_store = dist.PrefixStore("job/1", tcp_store)
    first: list[bool] = []
    t = threading.Thread(target=lambda: first.append(all_arrived(round_store, 2, lambda: "", 30)))
    t.start()
    wait_until(lambda: tcp_store.check(["job/1/agents_arrived"]), 30, "the first agent to come")
    assert all_arrived(round_store, 2, lambda: "round 2 formed", 30) is True
    t.join(60)
    assert first == [True]


def test_a_round_some_agent_never_comes_to_is_voided_at_the_timeout(tcp_store):
    round_store = dist.PrefixStore("job/1", tcp_store)
    with pytest.raises(TimeoutError, match="did not all come within 0.1s"):
        all_arrived(round_store, 2, lambda: "", 0.1)
    assert tcp_store.get("job/1/agents_gate") == b"void"
