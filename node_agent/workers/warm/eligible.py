"""Which launch may start warm, and what the zygote is told for it.
Warm: `PYTHON -u script args` and `PYTHON -u -m module args`, PYTHON the zygote's, with the zygote's
environment but for the per-worker variables (another PYTHONPATH, locale... starts an interpreter
differently). All else starts cold. `entry_imports`/`imports_any` tell from the entry point's own imports
whether a round waits for the zygote and whether the agent hosts the c10d store.
"""
from __future__ import annotations

import ast
import functools
import os
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from node_agent.workers.environment import PER_WORKER_VARS


class Launch(Protocol):
    """What of a worker's launch (workers/launch.py's WorkerLaunch) decides how the zygote runs it."""
    @property
    def argv(self) -> list[str]: ...
    @property
    def env(self) -> dict[str, str]: ...
    @property
    def cpu_affinity(self) -> frozenset[int] | None: ...


@dataclass(frozen=True)
class WarmLaunch:
    argv: list[str]              # the worker's sys.argv as Python sets it before running the code
    orig_argv: list[str]         # the command line a cold worker would have had
    script: str                  # "" for a module
    module: str                  # "" for a script
    path0: str                   # sys.path[0]
    cwd: str
    env: dict[str, str]          # the worker's whole environment
    base_env: dict[str, str]     # without the per-worker variables: what the zygote must have started with
    cpus: tuple[int, ...] = ()   # CPU affinity set in the forked child (zygote._per_worker_setup); (): inherited

    def message(self) -> dict[str, Any]:
        return {"argv": self.argv, "orig_argv": self.orig_argv, "script": self.script, "module": self.module,
                "path0": self.path0, "cwd": self.cwd, "env": self.env, "cpus": list(self.cpus)}


def base_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_WORKER_VARS}


MAX_SOURCE = 4 << 20    # bytes of an entry point read to find its imports: past it, assume it imports them


def imports_any(imported: frozenset[str] | None, modules: Iterable[str]) -> bool:
    """Whether `imported` (entry_imports) holds the top-level package of any of `modules`; an unread entry
    point counts as importing them (the zygote's wait, or the agent's store, costs it no more than cold)."""
    return imported is None or any(top_package(name) in imported for name in modules)


def entry_imports(entry: str, *, module: bool, cwd: str) -> frozenset[str] | None:
    """The top-level packages the script (or `-m` module) imports anywhere in its source, read, never run;
    None when it cannot be found, read or parsed."""
    tree = parsed(entry, module=module, cwd=cwd)
    if tree is None:
        return None
    return frozenset(top for node in ast.walk(tree) for top in imported_packages(node))


def imported_packages(node: ast.AST) -> set[str]:
    """The top-level packages an import statement brings in (none for a relative import or another node)."""
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return {node.module.split(".")[0]}
    return set()


MAX_SCRIPT_PRELOADS = 32           # modules; and as many names imported from them


def top_package(preload: str) -> str:
    """The top-level package of a preload entry (`module` or `module:name`)."""
    return preload.partition(":")[0].split(".")[0]


def script_preloads(entry: str, *, module: bool, cwd: str, path0: str) -> tuple[str, ...]:
    """The modules the script imports as it starts, to preload in the zygote: the imports among its top-level
    statements (not in a function, a `try`, or `if __name__ == "__main__"`), of installed packages: not the
    standard library, not the script's own modules (found beside it or in the working directory: importing
    those may read the rank from the environment, or parse the command line, which a zygote has not). The names
    of a `from module import name` come after the modules, as `module:name`: a lazy package imports the code
    behind a name only when it is looked up (transformers' Trainer: 1.4 s of each worker's start here)."""
    tree = parsed(entry, module=module, cwd=cwd)
    if tree is None:
        return ()
    modules: list[str] = []
    names: list[str] = []
    for node in top_level(tree.body):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
            names += [f"{node.module}:{alias.name}" for alias in node.names if alias.name != "*"]
    own = [d for d in (path0, cwd) if d]
    kept = [n for n in dict.fromkeys(modules) if _installed(top_package(n), own)][:MAX_SCRIPT_PRELOADS]
    return (*kept, *[n for n in dict.fromkeys(names) if n.partition(":")[0] in kept][:MAX_SCRIPT_PRELOADS])


NOT_AT_START = ("__name__", "TYPE_CHECKING")     # an `if` on these is not run as the script starts


def top_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements run as the script starts: those of an `if` too, but for `if __name__ == "__main__":` (the
    script's run, not its start) and `if TYPE_CHECKING:` (never run)."""
    for node in body:
        if isinstance(node, ast.If) and not any(word in ast.unparse(node.test) for word in NOT_AT_START):
            yield from top_level(node.body)
            yield from top_level(node.orelse)
        else:
            yield node


MAX_OWN_FILES = 64       # the script's own modules read to find what they import: past it, assume anything


def standard_library_only(entry: str, *, module: bool, cwd: str, path0: str) -> bool:
    """Whether the entry point and its own modules (found beside it or in the working directory; read, never run)
    import nothing but the standard library and each other. Its zygote then preloads no torch: a torch-free
    script's zygote imported torch and torch._dynamo (3.5 s of CPU, ~300 MB) for nothing. An installed package, an
    unreadable file or more than MAX_OWN_FILES count as importing anything."""
    own = [d for d in (path0, cwd) if d]
    tree = parsed(entry, module=module, cwd=cwd)
    trees, read = ([tree] if tree is not None else []), set()
    while trees:
        for top in {top for node in ast.walk(trees.pop()) for top in imported_packages(node)}:
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if _installed(top, own):
                return False
            for path in _own_files(top, own):
                if path not in read:
                    read.add(path)
                    found = read_tree(path)
                    if found is None or len(read) > MAX_OWN_FILES:
                        return False
                    trees.append(found)
    return tree is not None


def _own_files(top: str, own: list[str]) -> list[str]:
    """The source files of the script's own module or package `top`."""
    for d in own:
        if os.path.isfile(os.path.join(d, top + ".py")):
            return [os.path.join(d, top + ".py")]
        if os.path.isdir(os.path.join(d, top)):
            return [os.path.join(root, name) for root, _, names in os.walk(os.path.join(d, top))
                    for name in sorted(names) if name.endswith(".py")][:MAX_OWN_FILES + 1]
    return []


def read_tree(path: str) -> ast.Module | None:
    try:
        st = os.stat(path)
        return _parse(path, st.st_mtime_ns, st.st_size)
    except OSError:
        return None


def _installed(top: str, own: list[str]) -> bool:
    if top in sys.stdlib_module_names or top == "__future__":
        return False
    return not any(os.path.exists(os.path.join(d, top + ".py")) or os.path.isdir(os.path.join(d, top))
                   for d in own)


def parsed(entry: str, *, module: bool, cwd: str) -> ast.Module | None:
    """The entry point's syntax tree, read, never run (None: not found, too big, not Python); parsed once per
    version of the file (the agent asks several questions of it)."""
    path = module_source(entry, [cwd, *sys.path]) if module else entry
    return None if path is None else read_tree(path)


@functools.lru_cache(maxsize=8)
def _parse(path: str, mtime_ns: int, size: int) -> ast.Module | None:
    try:
        with open(path, "rb") as f:
            source = f.read(MAX_SOURCE + 1)
        if len(source) > MAX_SOURCE:
            return None
        return ast.parse(source, filename=path)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def module_source(name: str, path: Iterable[str]) -> str | None:
    """The file `python -m name` runs, found on `path` without importing anything (None: not a plain file)."""
    parts = name.split(".")
    for entry in path:
        base = os.path.join(entry or ".", *parts)
        for candidate in (base + ".py", os.path.join(base, "__main__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def script_dir(script: str) -> str:
    """sys.path[0] of `python script`: the directory of the script, links resolved."""
    return os.path.dirname(os.path.realpath(script))


def warm_launch(launch: Launch, python: str) -> WarmLaunch | None:
    """The launch as the zygote runs it, or None when it must start cold."""
    argv = launch.argv
    if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
        return None
    env = dict(launch.env)
    cwd = os.getcwd()
    cpus = tuple(sorted(launch.cpu_affinity or ()))
    if argv[2] == "-m":
        if len(argv) < 4 or not argv[3] or argv[3].startswith("-"):
            return None
        return WarmLaunch(argv=["-m", *argv[4:]], orig_argv=list(argv), script="", module=argv[3], path0=cwd,
                          cwd=cwd, env=env, base_env=base_env(launch.env), cpus=cpus)
    if argv[2].startswith("-") or not os.path.isfile(argv[2]) or zipfile.is_zipfile(argv[2]):
        return None              # an option, stdin, a directory or a zip archive (its __main__.py): cold
    return WarmLaunch(argv=argv[2:], orig_argv=list(argv), script=argv[2], module="",
                      path0=script_dir(argv[2]), cwd=cwd, env=env, base_env=base_env(launch.env), cpus=cpus)
