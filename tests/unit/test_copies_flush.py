"""A node leaving a job that goes on sends its holders the newest step they lack before it exits (PeerCopies.close):
its workers' last write ends as they stop, and a node that never comes back is replaced from its copy."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from node_agent.copies.last_copies import FLUSH_LIMIT_S, flush_limit, last_copies
from node_agent.copies.peers import PeerCopies
from node_agent.copies.store import CopyStore
from node_agent.training import snapshot
from tests.unit.test_copies_agent import holder, pushed


@contextlib.asynccontextmanager
async def wrote_18(tmp_path, said: list[str], data: bytes = b"s18") -> AsyncIterator[tuple[CopyStore, PeerCopies]]:
    """Node b's ranks' step 16 at the holder, and their step 18 written as the workers stopped."""
    async with holder(tmp_path) as (store, at):
        copies, dirs = await pushed(tmp_path, at, said, b"s16", 16)
        for where in dirs.values():
            snapshot.save(data, 18, where=where)
        yield store, copies


async def test_a_leaving_node_sends_the_step_its_ranks_wrote_as_they_stopped(tmp_path) -> None:
    """A review (a middle node stopped for good while its ranks wrote step 18): the holder had 16, and the node
    taking its place resumed every rank from 16. The close now sends 18 first."""
    said: list[str] = []
    async with wrote_18(tmp_path, said) as (store, copies):
        await copies.close()
        assert store.held() == {("b", 0): 18, ("b", 1): 18}, said


async def test_a_node_whose_job_is_over_sends_nothing_more(tmp_path) -> None:
    said: list[str] = []
    async with wrote_18(tmp_path, said) as (store, copies):
        await copies.close(finished=True)      # its holders drop its copies instead
        assert store.held() == {}, said


async def test_a_step_not_every_rank_holds_is_not_sent(tmp_path) -> None:
    """One rank's write of 18 ended, the other's not (killed at the stop's end): 16 stays the copy, one step for
    every rank as the taker's agreement needs."""
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        copies, dirs = await pushed(tmp_path, at, said, b"s16", 16)
        snapshot.save(b"s18", 18, where=dirs[min(dirs)])
        await copies.close()
        assert store.held() == {("b", 0): 16, ("b", 1): 16}, said


def test_a_restarting_nodes_last_copies_leave_its_next_agent_half_its_place() -> None:
    """A review: SIGTERM (`systemctl restart`) with copies slow to land (a 12 MB push at --replica-bandwidth 1M).
    The flush took its 10 s, longer than the job kept the node's place (stop 2 s + lease 3 s + last call 3 s); the
    next agent came too late, the elastic job shrank and every sharded rank went back to step 0."""
    assert flush_limit(None) == FLUSH_LIMIT_S          # stopped for good, or not told: the full bound
    assert flush_limit(7.5) == 3.75                      # the next agent keeps as long again to join
    assert flush_limit(60.0) == FLUSH_LIMIT_S
    assert flush_limit(-1.0) == 0.0


async def test_no_time_left_sends_nothing_more(tmp_path) -> None:
    said: list[str] = []
    async with wrote_18(tmp_path, said) as (store, copies):
        await copies.close(flush_s=0.0)
        assert store.held() == {("b", 0): 16, ("b", 1): 16}, said


async def test_a_last_copy_that_cannot_end_in_time_is_not_begun_and_what_it_waits_for_is_said(tmp_path) -> None:
    """A review: with --replica-bandwidth 1M a restart's exit waited its whole limit for a push that could not end
    in it (and its memory stayed for its next agent anyway): ~5 s more to every rank stepping, nothing said."""
    said: list[str] = []
    async with wrote_18(tmp_path, said, b"x" * 4096) as (store, copies):
        copies.bandwidth = 1024                    # 8 KiB and more to send at 1 KiB/s: 8 s, past a 2 s limit
        await copies.close(flush_s=2.0)
        assert store.held() == {("b", 0): 16, ("b", 1): 16}
        assert any("is not sent before it exits" in line and "more than the 2s" in line for line in said), said


async def test_a_last_copy_is_said_as_it_begins(tmp_path) -> None:
    said: list[str] = []
    async with wrote_18(tmp_path, said) as (store, copies):
        await copies.close(flush_s=2.0)
        assert store.held() == {("b", 0): 18, ("b", 1): 18}
        assert any("sending this node's newest snapshot" in line and "at most 2s" in line for line in said), said


async def test_a_last_copy_cut_short_names_the_stops_whole_limit() -> None:
    """CI on a busy host: the flush had 0.0999s left of its 0.1s and said "within 0.0999s"; the lines name the
    limit the stop set, while the wait is what is left of it."""
    said: list[str] = []
    started = asyncio.Event()

    async def never_lands() -> None:
        started.set()
        await asyncio.Event().wait()

    await last_copies([(never_lands, 4096)], 0, said.append, 0.1, 0.0457)
    assert started.is_set()
    assert any("within 0.1s of its stop" in line for line in said), said
    assert not any("0.0457" in line for line in said), said


async def test_a_leaving_replicas_last_copies_are_said_once_with_their_total(tmp_path) -> None:
    """A review: a node of replicas leaving before its ranks stepped sends the round's noted step, then the one the
    server heard, and said "sending this node's newest snapshot" for each. Once now, naming the bytes of both."""
    said: list[str] = []
    async with wrote_18(tmp_path, said, b"x" * 2**20) as (store, copies):
        for where in copies._dirs.values():
            snapshot.save(b"y" * 2**20, 17, where=where)
        copies._alike, copies._past_start, copies.noted, copies.heard_step = True, False, 17, 18
        await copies.close(flush_s=5.0)
        assert store.held() == {("b", 0): 18, ("b", 1): 18}, said
        sending = [line for line in said if "sending this node's newest snapshot" in line]
        assert len(sending) == 1 and "(4 MiB)" in sending[0], said    # 2 ranks x 2 steps x 1 MiB
