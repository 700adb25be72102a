"""Does the script set a variable in its environment before it imports a package the zygote preloads? A package
reads some variables as it loads (OMP_NUM_THREADS when torch loads, a cache directory when a hub library does);
a warm interpreter loaded it before the script ran, so what the script set would not reach it: such a script's
workers start cold, as under torchrun (node_agent/workers/local.py says so once).

Read from the script's source, never run: its top-level statements in order (and the bodies of its own functions
it calls there), setting through `os.environ[...] =`, `|=`, `update`, `setdefault`, `os.putenv`, under any name
`os` or `environ` was imported as. Not seen: a variable set by a module of its own, or through another call.
Variables read only later (the rendezvous's, NCCL's, CUDA's at its first use) do not count."""
from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence

from node_agent.workers.warm.eligible import imported_packages, parsed, top_level, top_package

READ_LATER = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TOKENIZERS_PARALLELISM",
              "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF")
READ_LATER_PREFIXES = ("NCCL_", "GLOO_", "WANDB_", "TORCH_NCCL_")


def environment_set_first(entry: str, preload: Iterable[str], *, module: bool, cwd: str) -> tuple[str, str] | None:
    """(the variable, the preloaded package, or `module:name`, the script imports after setting it), or None."""
    tree = parsed(entry, module=module, cwd=cwd)
    if tree is None:
        return None
    entries = list(preload)
    try:
        return _first(tree, {top_package(name) for name in entries} | {name for name in entries if ":" in name})
    except RecursionError:          # a statement nested past what ast's walkers take: not judged
        return None


def preloads_before_a_set(entry: str, preload: Sequence[str], base: Sequence[str], *, module: bool,
                          cwd: str) -> tuple[tuple[str, ...], tuple[str, str] | None, tuple[str, str] | None]:
    """`preload` less the script's own entries (those not in `base`) that it imports after setting a variable in
    its environment: (what is left, the first (variable, entry) left out, or None; a (variable, package) of `base`
    it imports after setting one: its workers start cold, or None). A review: `import transformers`, then a
    variable set, then `from transformers import Trainer` gave warm workers other log levels than cold ones."""
    kept, left_out = list(preload), None
    bases = {top_package(name) for name in base}
    while (early := environment_set_first(entry, kept, module=module, cwd=cwd)) is not None:
        what = early[1]
        if what in bases:
            return tuple(kept), left_out, early
        left_out = left_out or early
        kept = [name for name in kept if name in base or (name != what and top_package(name) != what)]
    return tuple(kept), left_out, None


def _first(tree: ast.Module, preloaded: set[str]) -> tuple[str, str] | None:
    names = _Names()
    setters = {node.name: var for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
               for inner in ast.walk(node) if (var := names.variable_set(inner)) is not None}
    pending: str | None = None
    imported: set[str] = set()
    for statement in top_level(tree.body):
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for node in sorted(ast.walk(statement), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            names.learn(node)
            fresh = (preload_keys(node) & preloaded) - imported
            if fresh and pending is not None:
                return pending, sorted(fresh)[0]
            imported |= fresh
            called = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else ""
            pending = pending or names.variable_set(node) or setters.get(called)
    return None


def preload_keys(node: ast.AST) -> set[str]:
    """What an import statement brings in, as preloads name it: its top-level packages, and a `from`'s
    `module:name`s."""
    keys = imported_packages(node)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        keys |= {f"{node.module}:{alias.name}" for alias in node.names}
    return keys


class _Names:
    """What the script calls `os`, `os.environ` and `os.putenv` (its imports, with their aliases)."""

    def __init__(self) -> None:
        self.environ = {"os.environ", "environ"}
        self.putenv = {"os.putenv", "putenv"}

    def learn(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "os" and alias.asname:
                    self.environ.add(f"{alias.asname}.environ")
                    self.putenv.add(f"{alias.asname}.putenv")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name == "environ" and alias.asname:
                    self.environ.add(alias.asname)
                elif alias.name == "putenv" and alias.asname:
                    self.putenv.add(alias.asname)

    def variable_set(self, node: ast.AST) -> str | None:
        """The variable `node` sets in the environment, named, where it counts (not one read only later)."""
        try:
            name = self._set(node)
        except RecursionError:      # an expression nested past what ast.unparse takes: not an environment
            return None
        return None if name is None or name in READ_LATER or name.startswith(READ_LATER_PREFIXES) else name

    def _set(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) in self.environ:
                    return _name(target.slice)
                if isinstance(node, ast.AugAssign) and ast.unparse(target) in self.environ:    # environ |= {...}
                    return _first_key(node.value) or "os.environ"
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            owner, _, call = func.rpartition(".")
            if func in self.putenv or (owner in self.environ and call in ("__setitem__", "setdefault")):
                return _name(node.args[0]) if node.args else func
            if owner in self.environ and call == "update":
                keys = [k.arg for k in node.keywords if k.arg] + [k for a in node.args[:1] if (k := _first_key(a))]
                return keys[0] if keys else func
        return None


def _first_key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Dict):
        return next((_name(k) for k in node.keys if k is not None), None)
    return None


def _name(node: ast.AST) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ast.unparse(node)
