"""Does the script change its environment, or where imports are found, before it imports a package the zygote
preloads? A package reads some variables as it loads (OMP_NUM_THREADS when torch loads, a cache directory when a
hub library does); a warm interpreter loaded it before the script ran, so what the script set would not reach it:
such a script's workers start cold, as under torchrun (node_agent/workers/local.py says so once). A script's own
import found after a change of `sys.path` (a vendored copy) is not preloaded: the zygote would find another.

Read from the script's source, never run: its top-level statements in order, the bodies of its own functions it
calls there, and the top-level statements of its own modules (beside it or in the working directory) where it
imports them. A variable is set or removed through `os.environ[...] =`, `|=`, `del`, `update`, `setdefault`,
`pop`, `clear`, `os.putenv`, `os.unsetenv`, under any name `os` or `environ` was imported as; `sys.path` is
changed by assigning it (or an item), its methods, or `site.addsitedir`. Not seen: a change through another
call. Variables read only later (the rendezvous's, NCCL's, CUDA's at its first use) do not count."""
from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Sequence

from node_agent.workers.warm.eligible import imported_packages, parsed, read_tree, script_dir, top_level, top_package

READ_LATER = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TOKENIZERS_PARALLELISM",
              "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF")
READ_LATER_PREFIXES = ("NCCL_", "GLOO_", "WANDB_", "TORCH_NCCL_")


SYS_PATH = "sys.path"      # what `_first` names for a change of where imports are found


def environment_set_first(entry: str, preload: Iterable[str], *, module: bool, cwd: str,
                          path_counts: Iterable[str] = ()) -> tuple[str, str] | None:
    """(the variable, or SYS_PATH, and the preloaded package, or `module:name`, the script imports after changing
    it), or None. A change of `sys.path` counts only before the imports of `path_counts` (the script's own)."""
    tree = parsed(entry, module=module, cwd=cwd)
    if tree is None:
        return None
    entries = list(preload)
    keys = {top_package(name) for name in entries} | {name for name in entries if ":" in name}
    own = [d for d in dict.fromkeys((cwd if module else script_dir(entry), cwd)) if d]
    walk = _Walk(keys, {top_package(n) for n in path_counts} | {n for n in path_counts if ":" in n}, own)
    try:
        return walk.statements(tree.body)
    except RecursionError:          # a statement nested past what ast's walkers take: not judged
        return None


def cold_because(variable: str, entry: str) -> str:
    """The one line that says a script's workers start cold, and why."""
    return (f"warm workers off: the script {change(variable)} before it imports {entry}, which a warm interpreter "
            f"has loaded already (what it reads as it loads would not reach it); its workers start cold, as under "
            f"torchrun. Set it in node-agent's environment to keep warm starts")


def change(variable: str) -> str:
    """What the script does, as said: "changes sys.path", or "changes X in its environment"."""
    return "changes sys.path" if variable == SYS_PATH else f"changes {variable} in its environment"


def preloads_before_a_set(entry: str, preload: Sequence[str], base: Sequence[str], *, module: bool,
                          cwd: str) -> tuple[tuple[str, ...], tuple[str, str] | None, tuple[str, str] | None]:
    """`preload` less the script's own entries (those not in `base`) that it imports after changing a variable in
    its environment, or `sys.path`: (what is left, the first (variable, entry) left out, or None; a (variable,
    package) of `base` it imports after changing a variable: its workers start cold, or None). A review: `import
    transformers`, then a variable set, then `from transformers import Trainer` gave warm workers other log levels
    than cold ones."""
    bases = {top_package(name) for name in base}
    in_base = [n for n in preload if n in base or top_package(n) in bases]     # `from torch import nn` too
    found = environment_set_first(entry, in_base, module=module, cwd=cwd)
    if found is not None:
        return tuple(preload), None, found
    kept, left_out = list(preload), None
    while (early := environment_set_first(entry, own := [n for n in kept if n not in in_base], module=module,
                                          cwd=cwd, path_counts=own)) is not None:
        what = early[1]
        left_out = left_out or early
        kept = [name for name in kept if name in base or (name != what and top_package(name) != what)]
    return tuple(kept), left_out, None


MAX_OWN_MODULES = 64     # the script's own modules read where it imports them: past it, not judged further


class _Walk:
    """The statements run as the script starts, in order, with what they change and import."""

    def __init__(self, preloaded: set[str], path_counts: set[str], own: list[str]) -> None:
        self.preloaded, self.path_counts, self.own = preloaded, path_counts, own
        self.imported: set[str] = set()
        self.pending: str | None = None          # a variable changed, not yet imported after
        self.path_pending = False                # sys.path changed
        self.read: set[str] = set()

    def statements(self, body: list[ast.stmt]) -> tuple[str, str] | None:
        names = _Names()
        setters = {node.name: var for node in body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                   for inner in ast.walk(node) if (var := names.change(inner)) is not None}
        for statement in top_level(body):
            if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            for node in sorted(ast.walk(statement),
                               key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
                names.learn(node)
                found = self._imports(node)
                if found is not None:
                    return found
                called = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else ""
                changed = names.change(node) or setters.get(called)
                if changed == SYS_PATH:
                    self.path_pending = True
                elif changed is not None:
                    self.pending = self.pending or changed
        return None

    def _imports(self, node: ast.AST) -> tuple[str, str] | None:
        """An import statement's modules in order (`import settings, torch`: its own module runs first)."""
        parts: list[ast.AST] = [ast.Import(names=[alias]) for alias in node.names] \
            if isinstance(node, ast.Import) else [node]
        for part in parts:
            fresh = (preload_keys(part) & self.preloaded) - self.imported
            if fresh and self.pending is not None:
                return self.pending, sorted(fresh)[0]
            if fresh & self.path_counts and self.path_pending:
                return SYS_PATH, sorted(fresh & self.path_counts)[0]
            self.imported |= fresh
            for top in sorted(imported_packages(part) - self.preloaded):    # its own module runs here
                found = self._own(top)
                if found is not None:
                    return found
        return None

    def _own(self, top: str) -> tuple[str, str] | None:
        for path in _own_module(top, self.own):
            if path in self.read or len(self.read) >= MAX_OWN_MODULES:
                continue
            self.read.add(path)
            tree = read_tree(path)
            found = self.statements(tree.body) if tree is not None else None
            if found is not None:
                return found
        return None


def _own_module(top: str, own: list[str]) -> list[str]:
    """The file `import top` runs of the script's own module or package (its __init__), if any."""
    for d in own:
        for path in (os.path.join(d, top + ".py"), os.path.join(d, top, "__init__.py")):
            if os.path.isfile(path):
                return [path]
    return []


def preload_keys(node: ast.AST) -> set[str]:
    """What an import statement brings in, as preloads name it: its top-level packages, and a `from`'s
    `module:name`s."""
    keys = imported_packages(node)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        keys |= {f"{node.module}:{alias.name}" for alias in node.names}
    return keys


class _Names:
    """What the script calls `os`, `os.environ`, `os.putenv`/`unsetenv`, `sys` and `site` (its imports, with
    their aliases)."""

    def __init__(self) -> None:
        self.environ = {"os.environ", "environ"}
        self.putenv = {"os.putenv", "putenv", "os.unsetenv", "unsetenv"}
        self.path = {"sys.path"}
        self.addsitedir = {"site.addsitedir"}

    def learn(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "os" and alias.asname:
                    self.environ.add(f"{alias.asname}.environ")
                    self.putenv |= {f"{alias.asname}.putenv", f"{alias.asname}.unsetenv"}
                elif alias.name == "sys" and alias.asname:
                    self.path.add(f"{alias.asname}.path")
                elif alias.name == "site" and alias.asname:
                    self.addsitedir.add(f"{alias.asname}.addsitedir")
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "sys", "site"):
            for alias in node.names:
                name = alias.asname or alias.name
                if node.module == "os" and alias.name == "environ":
                    self.environ.add(name)
                elif node.module == "os" and alias.name in ("putenv", "unsetenv"):
                    self.putenv.add(name)
                elif node.module == "sys" and alias.name == "path":
                    self.path.add(name)
                elif node.module == "site" and alias.name == "addsitedir":
                    self.addsitedir.add(name)

    def change(self, node: ast.AST) -> str | None:
        """The variable `node` sets or removes in the environment, named, where it counts (not one read only
        later), or SYS_PATH where it changes `sys.path`."""
        try:
            name = self._changed(node)
        except RecursionError:      # an expression nested past what ast.unparse takes: not an environment
            return None
        return None if name is None or name in READ_LATER or name.startswith(READ_LATER_PREFIXES) else name

    def _changed(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) in self.environ:
                    return _name(target.slice)
                if isinstance(node, ast.AugAssign) and ast.unparse(target) in self.environ:    # environ |= {...}
                    return _first_key(node.value) or "os.environ"
                if ast.unparse(target.value if isinstance(target, ast.Subscript) else target) in self.path:
                    return SYS_PATH
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            owner, _, call = func.rpartition(".")
            if func in self.putenv or (owner in self.environ and call in ("__setitem__", "__delitem__",
                                                                          "setdefault", "pop")):
                return _name(node.args[0]) if node.args else func
            if owner in self.environ and call in ("update", "clear", "popitem"):
                keys = [k.arg for k in node.keywords if k.arg] + [k for a in node.args[:1] if (k := _first_key(a))]
                return keys[0] if keys else func
            if owner in self.path or func in self.addsitedir:
                return SYS_PATH
        return None


def _first_key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Dict):
        return next((_name(k) for k in node.keys if k is not None), None)
    return None


def _name(node: ast.AST) -> str:
    """A constant's value; any other expression in brackets (`[key]`: never taken for a variable's name)."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else f"[{ast.unparse(node)}]"
