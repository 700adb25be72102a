"""The check of the workers' Python script before the node joins (node_agent/workers/script_check.py)."""
from __future__ import annotations

from node_agent.workers.script_check import script_problem


def test_local_rank_in_the_path_checks_each_local_ranks_script(tmp_path) -> None:
    # torchrun substitutes ${local_rank} in the script's path too: `torchrun train_${local_rank}.py`
    for r in (0, 1):
        (tmp_path / f"train_{r}.py").write_text("x = 1\n")
    template = str(tmp_path / "train_${local_rank}.py")
    assert script_problem(template, local_ranks=2) is None
    problem = script_problem(template, local_ranks=3)
    assert problem is not None and "train_2.py' does not exist" in problem
    (tmp_path / "train_2.py").write_text("x = = 1\n")
    problem = script_problem(template, local_ranks=3)
    assert problem is not None and "train_2.py' does not compile, line 1" in problem


def test_a_plain_path_is_checked_once(tmp_path) -> None:
    script = tmp_path / "train.py"
    problem = script_problem(str(script), local_ranks=4)
    assert problem is not None and "does not exist" in problem
    script.write_text("print('hi')\n")
    assert script_problem(str(script), local_ranks=4) is None
