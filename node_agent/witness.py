"""What a round's witnesses say together (the wire: client/witness.py), for the policy (policy.py):
- one that hears the server holds a newer round, or none: this node's round was replaced or ended (evidence to fence
  on);
- one that hears the server holds this round: nothing moved on; wait for our own link (path_check.py);
- they answer but do not hear the server: the server itself is away; the round goes on;
- none answers but one took the connection: this node is not cut off (a stranger flooding a witness's port makes
  it close connections unanswered); nothing is concluded, the round goes on;
- none can be reached, twice, and the server cannot be reached either: this node is cut off; its workers stop.
An older witness's "in-contact" with no round means it hears the server (confirmed once)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from node_agent.client.replies import Path
from node_agent.client.witness import ASK_TIMEOUT_S, ask_each, read_answer
from node_agent.core.facts import SERVER_CHECK_DECIDES, Verdict, WitnessesAnswered
from protocol.messages import Witness


def verdict(answers: list[bytes | None], round_id: int) -> Verdict:
    """What the witnesses' answers say together, for an asker running `round_id` (facts.py); an answer is None
    where the witness could not be reached, b"" where it took the connection and said nothing."""
    said = [answer for answer in map(read_answer, answers) if answer is not None]
    heard = [held for hears, held in said if hears]   # the round each that hears the server holds (None: not said)
    # A newer round, or none (-1) while this node runs one: a member of this node's round that hears the server was
    # told its round is over (this node's loss left the job below its minimum: no newer round follows). Read as "in
    # this node's round", a host cut off from the server kept its workers until --server-wait.
    if any(r is not None and (r > round_id or (r == -1 and round_id >= 0)) for r in heard):
        return Verdict.ROUND_REPLACED
    if any(r is not None for r in heard):
        return Verdict.STILL_MEMBER          # it hears the server, which still runs this node's round (or older news)
    if heard:
        return Verdict.SERVER_HEARD          # an older witness: hears the server, says no round
    if said:
        return Verdict.SERVER_AWAY
    return Verdict.UNANSWERED if any(answer is not None for answer in answers) else Verdict.SILENT


async def ask_witnesses(witnesses: tuple[Witness, ...], round_id: int = -1,
                        timeout: float = ASK_TIMEOUT_S) -> Verdict:
    """The witnesses' verdict."""
    return verdict(await ask_each(witnesses, round_id, timeout), round_id)


async def witnesses_and_server(witnesses: tuple[Witness, ...], round_id: int,
                               reach: Callable[[], Awaitable[Path]]) -> WitnessesAnswered:
    """The witnesses asked while the server is checked (`reach`); the check is waited for only where the
    verdict needs it (facts.SERVER_CHECK_DECIDES): a replaced round must be acted on at once."""
    check = asyncio.ensure_future(reach())
    try:
        said = await ask_witnesses(witnesses, round_id)
        server = await check if said in SERVER_CHECK_DECIDES else None
    finally:
        check.cancel()     # a shared check goes on for the other requests (path_check.py): only this wait ends
        await asyncio.gather(check, return_exceptions=True)
    return WitnessesAnswered(said, server)
