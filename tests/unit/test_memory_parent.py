"""The parent of the node's memory directories (memory.parent_dir, /dev/shm/node-agent-mem-UID) must be this user's
own: another local user may make the name first in the sticky /dev/shm. Then memory is off, said in one line, and
nothing is read from or written into it (snapshots, the server's secret: workers/succession.py)."""
from __future__ import annotations

import os
import stat

from node_agent.workers import memory
from node_agent.workers.memory import MemoryDirs, dir_name
from node_agent.workers.succession import SECRET, WAITING, keep_credential, left_credential, predecessor
from tests.unit.test_memory_dirs import killed_agent

NOBODY = 65534


def made_by_another_user(tmp_path, monkeypatch) -> tuple[str, int]:
    """This user's parent directory, made another user's (mode 0o777): as root for real (chown to nobody), else by
    this process taking another uid for itself (os.getuid), under whose name the directory is moved. Its path, and
    the uid that owns it as this process sees it."""
    made = memory.parent_dir(str(tmp_path))
    os.makedirs(made, exist_ok=True)
    os.chmod(made, 0o777)
    if os.getuid() == 0:
        os.chown(made, NOBODY, NOBODY)
        return made, NOBODY
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    parent = memory.parent_dir(str(tmp_path))
    os.rename(made, parent)
    return parent, real


def tree(root: str) -> dict[str, bytes | None]:
    """Every path under `root` and a file's content (None: a directory)."""
    out: dict[str, bytes | None] = {}
    for where, dirs, names in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(where, name), root)] = None
        for name in names:
            with open(os.path.join(where, name), "rb") as f:
                out[os.path.relpath(os.path.join(where, name), root)] = f.read()
    return out


def test_a_parent_another_user_made_turns_memory_off_in_one_line_and_nothing_in_it_is_read_or_written(
        tmp_path, monkeypatch) -> None:
    base = str(tmp_path)
    node = killed_agent(tmp_path, "job", "HOSTNAME-PID")     # its memory, snapshots and secret: as if planted
    parent, owner = made_by_another_user(tmp_path, monkeypatch)
    home = os.path.join(parent, dir_name("job", node))
    with open(os.path.join(home, WAITING), "w") as f:
        f.write(f"{os.getpid()} 0\nplanted")              # a waiting secret of an ended agent, as it reads
    before = tree(parent)
    assert predecessor("job", 2, base) is None           # its node id and memory are not taken
    said: list[str] = []
    dirs = MemoryDirs("job", 2, 2**20, say=said.append, base=base, node_id=node)
    assert left_credential(dirs) == ""                    # its secrets are not shown to the server
    assert dirs.dirs(2) == {} and dirs.dirs_for(2, 2, "run-1") == {} and not dirs.enabled
    keep_credential(dirs, "this-agents-secret")
    assert len(said) == 1 and "\n" not in said[0], said
    assert parent in said[0] and f"uid {owner}" in said[0] and "remove it" in said[0], said
    assert tree(parent) == before
    dirs.close()
    assert tree(parent) == before


def test_a_parent_that_is_a_symlink_is_not_followed(tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    parent = memory.parent_dir(str(tmp_path))
    os.symlink(elsewhere, parent)
    said: list[str] = []
    dirs = MemoryDirs("job", 1, 2**20, say=said.append, base=str(tmp_path))
    assert dirs.dirs(1) == {}
    assert len(said) == 1 and f"{parent} is a symlink" in said[0], said
    assert os.listdir(elsewhere) == []


def test_a_parent_of_this_user_others_may_write_to_is_tightened_and_used(tmp_path) -> None:
    parent = memory.parent_dir(str(tmp_path))
    os.makedirs(parent)
    os.chmod(parent, 0o777)
    dirs = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path))
    assert list(dirs.dirs(1)) == [0]
    assert stat.S_IMODE(os.lstat(parent).st_mode) == 0o700
    dirs.close()


def test_the_secret_is_never_written_through_a_symlink(tmp_path) -> None:
    dirs = MemoryDirs("job", 1, 2**20, say=lambda _: None, base=str(tmp_path), node_id="n")
    dirs.dirs(1)
    assert dirs.root is not None
    target = tmp_path / "target"
    target.write_text("kept")
    os.symlink(target, os.path.join(dirs.root, SECRET + ".new"))
    keep_credential(dirs, "secret")
    assert target.read_text() == "kept"
    dirs.close()
