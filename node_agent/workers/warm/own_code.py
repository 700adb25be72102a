"""Which code is the user's own, as warm workers tell it: a file outside the interpreter's library (the standard
library and the directories packages are installed into): a package on PYTHONPATH, an editable install, a
checkout. The zygote preloads none of the script's imports that are the user's own (importing them may read the
rank or the command line, which it has not, and a restart would run code edited since), and a warm worker that
ends frees what that code made (fast_exit.py). Loaded by the zygote by path: the standard library alone."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import site
import sysconfig


@functools.lru_cache(maxsize=1)
def _library() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key)}
    with contextlib.suppress(Exception):          # (an embedded interpreter's site may lack them)
        dirs.update(site.getsitepackages())
    with contextlib.suppress(Exception):
        dirs.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def own(path: object) -> bool:
    """Whether the file at `path` is the user's own code (a built-in or frozen module, without one, is not)."""
    if not isinstance(path, str) or not os.path.isabs(path):
        return False
    return not os.path.realpath(path).startswith(_library())


def installed(top: str) -> bool:
    """Whether the top-level package `top` is found, and in the interpreter's library (found, never imported)."""
    try:
        spec = importlib.util.find_spec(top)
    except Exception:  # noqa: BLE001 - a finder that fails: the import itself would say why
        return False
    if spec is None:
        return False
    where = [spec.origin] if spec.origin and spec.has_location else list(spec.submodule_search_locations or [])
    return not any(own(place) for place in where)
