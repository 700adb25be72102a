"""A node's snapshot/copy figures after the server restarted on its saved state: until its next note they are
the figures saved before the restart, and both readers (rdzv-ctl and the page) say so (a review: a job that ended
soon after a restart kept showing a node at 115/115 when the job had reached 395)."""
from __future__ import annotations

import msgspec

from protocol.messages import PollRequest
from protocol.notes import CopiesNote
from rdzv_ctl import tables as ctl
from rdzv_server.core.records import JobRecord
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.web import views
from rdzv_server.web.page import render as page
from tests.unit.test_copies_rounds import CFG, JOB, started
from tests.unit.test_page import Markup


def _said(rz: Rendezvous, node: str, note: CopiesNote, now: float) -> None:
    rz.handle(JOB, PollRequest(v=1, node_id=node, credential=f"secret-{node}", copies=note), now)


def _row(rz: Rendezvous, node: str, now: float) -> str:
    rows = ctl.format_job(views.job_detail(rz.jobs[JOB], now)).splitlines()
    return next(r for r in rows if r.split()[1:2] == [node])


def test_figures_saved_before_a_restart_are_marked_until_the_nodes_next_note():
    rz = started({"a": "1", "b": "2"}, CFG)
    _said(rz, "a", CopiesNote(local_step=115, copied_step=115, holder="10.0.0.2:4000"), 1.0)
    _said(rz, "b", CopiesNote(local_step=115, copied_step=115, holder="10.0.0.1:4000"), 1.0)
    assert "before restart" not in _row(rz, "a", 1.0)
    # the server goes and comes back on its saved state (the job record as the store keeps it)
    rz.jobs[JOB] = msgspec.json.decode(msgspec.json.encode(rz.jobs[JOB]), type=JobRecord)
    rz.restored(10.0, 5.0, clean=False)
    for node in ("a", "b"):
        assert views.job_detail(rz.jobs[JOB], 10.0).nodes[["a", "b"].index(node)].copies_before_restart
        assert "115/115 (before restart)" in _row(rz, node, 10.0), _row(rz, node, 10.0)
    m = Markup(page.job_page(rz, JOB, 10.0) or "")
    assert m.text.count("as said before the server restarted") == 2, m.text
    # a's next note is news: its figures stand as they are; b's are still the old ones
    _said(rz, "a", CopiesNote(local_step=395, copied_step=390, holder="10.0.0.2:4000"), 11.0)
    assert "before restart" not in _row(rz, "a", 11.0)
    assert "395/390" in _row(rz, "a", 11.0).split()
    assert "115/115 (before restart)" in _row(rz, "b", 11.0)
    m = Markup(page.job_page(rz, JOB, 11.0) or "")
    assert m.text.count("as said before the server restarted") == 1, m.text
