"""The line an agent says at its first unanswered try: it names what the server did, and asks whether one
runs there only when nothing answered."""
from __future__ import annotations

from node_agent.client.retry import unreachable_line
from node_agent.client.transport import ServerUnreachable, refusal

RUNNING_HINT = "is an rdzv-server running there?"


def test_a_standby_that_answered_not_leader_is_not_asked_whether_it_runs() -> None:
    error = refusal("not_leader", "this replica is a standby and no leader is known yet (an election is under way)")
    assert isinstance(error, ServerUnreachable)
    line = unreachable_line("10.0.0.5:29400", 60, str(error))
    assert RUNNING_HINT not in line
    assert line.startswith("the rdzv-server at 10.0.0.5:29400 answers but serves nobody now; retrying for 60s")
    assert "not_leader" in line


def test_nothing_answering_still_asks_whether_a_server_runs_there() -> None:
    line = unreachable_line("10.0.0.5:29400", 60, "ClientConnectorError: Connect call failed")
    assert RUNNING_HINT in line
