"""A join the rules refuse for what the node asked is said in the server's log (rdzv_server/refused_joins.py):
once per job, node and kind of refusal a minute, with how many came since; the agent gets the error as before."""
from __future__ import annotations

import logging

import pytest

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JoinRequest
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.errors import RendezvousError
from rdzv_server.refused_joins import LINES_EVERY, REMEMBERED, RefusedJoins


def join(node: str, config: JobConfig) -> JoinRequest:
    return JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=1, master_port=1, config=config,
                       instance=node)


async def test_a_join_asking_another_config_is_said_once_with_the_field_and_the_node(caplog):
    coord = Coordinator()
    await coord.start()
    caplog.set_level(logging.WARNING, logger="rdzv_server")
    try:
        await coord.handle("j", join("a", JobConfig(min_nodes=2, max_nodes=2, max_restarts=3)))
        for _ in range(3):
            with pytest.raises(RendezvousError) as err:
                await coord.handle("j", join("b", JobConfig(min_nodes=2, max_nodes=2, max_restarts=5)))
            assert err.value.code == ErrorCode.CONFIG_CONFLICT
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 1, said
        assert "join of node 'b'" in said[0] and "max_restarts" in said[0], said
    finally:
        await coord.stop()


def test_repeats_are_counted_and_said_with_the_next_line(caplog):
    caplog.set_level(logging.WARNING, logger="rdzv_server")
    joins = RefusedJoins()
    for now in (0.0, 1.0, 2.0, 61.0):
        joins.note("j", "b", "10.0.0.2", ErrorCode.NODE_DRAINED, "drained", now)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "(2 more since the last said)" in said[1], said


def test_other_errors_are_not_said_and_made_up_ids_are_bounded(caplog):
    caplog.set_level(logging.WARNING, logger="rdzv_server")
    joins = RefusedJoins()
    joins.note("j", "b", "p", ErrorCode.UNAUTHORIZED, "no token", 0.0)
    assert not caplog.records
    for i in range(3 * REMEMBERED):
        joins.note("j", f"n{i}", "p", ErrorCode.CONFIG_CONFLICT, "x", 0.0)
    assert len(joins._said) <= REMEMBERED and len(caplog.records) == LINES_EVERY     # the log not flooded
    joins.note("j", "late", "p", ErrorCode.CONFIG_CONFLICT, "x", 61.0)
    assert f"{3 * REMEMBERED - LINES_EVERY} other refused join(s) not said" in caplog.records[-1].getMessage()
