"""The folders are layers, and this test keeps them so: each package may import only the layers below
it (every import counts, module-level or inside a function). The rules are the ones each package's
`__init__` docstring states; a new sub-package must be given its rule here."""
from __future__ import annotations

import ast

from tests.packages import modules

# package prefix -> the prefixes it may import (its own is always allowed). The most specific prefix wins.
ALLOWED: dict[str, tuple[str, ...]] = {
    "protocol": (),
    "rdzv_server.core": ("protocol",),
    "rdzv_server.store": ("protocol", "rdzv_server.core"),
    # delivery: the nodes waiting for news (the hub, its subscribers); below the coordinator that drives it
    "rdzv_server.delivery": ("protocol", "rdzv_server.core", "rdzv_server.serving"),
    # the shell: coordinator, serving, lag probe, logs, heap, and serve/cli that put it together
    "rdzv_server": ("protocol", "rdzv_server.core", "rdzv_server.store", "rdzv_server.delivery", "rdzv_server.web"),
    "rdzv_server.web": ("protocol", "rdzv_server.core", "rdzv_server.coordinator", "rdzv_server.serving",
                        "rdzv_server.looplag", "rdzv_server.logs", "rdzv_server.store.api",
                        "rdzv_server.store.persistence", "rdzv_server.delivery.subscriber",
                        "rdzv_server.delivery.connection", "rdzv_server.tcp_info"),
    "rdzv_ctl": ("protocol",),
    "node_agent.core": ("protocol", "node_agent.client.replies"),
    "node_agent.client": ("protocol", "rdzv_server.coordinator", "rdzv_server.core"),   # local: in-process server
    "node_agent.gpu": ("protocol",),
    "node_agent.workers": ("protocol", "node_agent.core", "node_agent.settings", "node_agent.training.probe",
                           "node_agent.gpu", "node_agent.training.snapshot", "node_agent.sources",
                           "node_agent.workers.warm"),
    # the warm zygote's agent side; the zygote itself (zygote.py) imports nothing of ours
    "node_agent.workers.warm": ("node_agent.training.probe", "node_agent.workers.deathsig",
                                "node_agent.workers.environment"),
    # the zygote and the modules it loads by path run under any interpreter: the standard library alone
    "node_agent.workers.warm.zygote": (),
    "node_agent.workers.warm.fast_exit": (),
    "node_agent.workers.warm.import_output": (),
    "node_agent.workers.warm.fork_state": (),
    # the peer-copy wire and store: the standard library, the snapshot files' helpers (torch-free), and the one
    # keepalive rule of every agent connection
    "node_agent.copies": ("node_agent.training.snapshot", "node_agent.training.headroom", "protocol.keepalive",
                          "protocol.tokens"),
    # the agent's side of peer copies: the wire and store, the listener, the memory dirs, the snapshot files
    "node_agent.copies.peers": ("protocol", "node_agent.copies", "node_agent.client.listener",
                                "node_agent.training.snapshot", "node_agent.workers.memory"),
    # inside the training process: the probe (loaded by file path) and its boot import nothing of ours; the rest
    # only its own package. The agent may import the torch-free snapshot and heartbeat, never protect & co.
    "node_agent.training": (),
    "node_agent.training.probe": (),
    "node_agent.training.boot": (),
    # the command line: read into settings; the composition root (node_agent/main.py) builds the rest
    "node_agent.cli": ("protocol", "node_agent.settings", "node_agent.gpu.topology"),
    # (and the store host's rule for where a c10d store listens: the plugin hosts one too; and the progress probe,
    # put in torch's workers and read as the agent reads it, for which failed at start)
    "node_agent.plugin": ("protocol", "node_agent.client", "node_agent.cli.job_identity", "node_agent.cli.rdzv_conf",
                          "node_agent.cli.values", "node_agent.workers.script_check", "node_agent.settings",
                          "node_agent.workers.warm.store_host", "node_agent.core.steps", "node_agent.training.probe",
                          "node_agent.workers.probes", "node_agent.workers.environment"),
    "node_agent": ("protocol", "node_agent.core", "node_agent.client", "node_agent.workers", "node_agent.cli",
                   "node_agent.gpu", "node_agent.copies", "node_agent.training.snapshot",
                   "node_agent.training.heartbeat"),
}
OURS = ("protocol", "rdzv_server", "node_agent", "rdzv_ctl")


def rule_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in ALLOWED:
            return prefix
    raise AssertionError(f"{module}: no layer rule for its package; add one to tests/test_layers.py")


def imported(path: str, module: str) -> set[str]:
    """Every module of ours that `path` imports, anywhere in it."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out: set[str] = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:          # relative: from the package up `level - 1` steps
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.update(f"{base}.{a.name}" for a in node.names)
            out.add(base)
    return {m for m in out if m.split(".")[0] in OURS}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, deps in sorted(graph.items()):
        layer = rule_of(module)
        for dep in sorted(deps):
            if within(dep, layer) or any(within(dep, ok) for ok in ALLOWED[layer]):
                continue
            if dep in (layer.rpartition(".")[0], layer.split(".")[0]) or any(d.startswith(dep + ".") for d in deps):
                continue          # `from pkg import sub`: the package itself, named on the way to a module
            found.append(f"{module} imports {dep} ({layer} may import only {', '.join(ALLOWED[layer]) or 'itself'})")
    return found


def graph() -> dict[str, set[str]]:
    return {m: imported(p, m) - {m} for m, p in modules().items()}


def test_every_package_imports_only_the_layers_below_it():
    g = graph()
    assert "rdzv_server.core.job_rules" in g and "node_agent.core.policy" in g
    assert violations(g) == []


def test_a_planted_violation_is_named():
    g = graph()
    g["rdzv_server.core.job_rules"].add("rdzv_server.web.views")       # the core reaching into the web layer
    g["node_agent.core.policy"].add("node_agent.workers.process")      # the pure policy starting processes
    g["rdzv_ctl.cli"].add("rdzv_server.coordinator")                   # the operator's client importing the server
    found = violations(g)
    assert [v.split(" (")[0] for v in found] == [
        "node_agent.core.policy imports node_agent.workers.process",
        "rdzv_ctl.cli imports rdzv_server.coordinator",
        "rdzv_server.core.job_rules imports rdzv_server.web.views",
    ]


def test_only_the_composition_root_and_the_plugin_read_the_command_line_package():
    """The agent's parts get their settings (node_agent/settings.py), never the CLI's options: only
    main.py (which builds them) and the plugin (which shares the CLI's rules for ids and --rdzv-conf)
    import node_agent.cli."""
    def cli(module: str) -> bool:
        return module == "node_agent.cli" or module.startswith("node_agent.cli.")
    readers = {m for m, path in modules().items() if m.startswith("node_agent.") and not cli(m)
               and not m.startswith("node_agent.plugin") and any(cli(i) for i in imported(path, m))}
    assert readers == {"node_agent.main"}, readers
