"""The progress probe's one loader: it loads the probe into an interpreter at its start-up, a cold worker before
its script runs or the warm zygote before any fork (the agent puts this directory first on its PYTHONPATH). It
takes itself off the path again, so the worker's children and imports see the path as the user set it, then runs
the user's own sitecustomize, if any."""
import importlib.util
import os
import sys


def _start() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    # an empty entry is the user's (the current directory, for the worker's own children): kept
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if not p or os.path.abspath(p) != here]
    if any(rest):
        os.environ["PYTHONPATH"] = os.pathsep.join(rest)
    else:
        os.environ.pop("PYTHONPATH", None)
    spec = importlib.util.spec_from_file_location("_node_agent_probe", os.path.join(os.path.dirname(here), "probe.py"))
    if spec is not None and spec.loader is not None:
        probe = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(probe)
            sys.modules[probe.NAME] = probe     # its name is its own (probe.NAME): what beat() looks up
            probe.install(os.environ)
        except Exception:   # noqa: BLE001 - the worker runs without a probe rather than not at all
            sys.modules.pop(getattr(probe, "NAME", ""), None)
    ours = sys.modules.pop("sitecustomize")
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the user's (or the distribution's) own, now first on the path
    except ImportError as exc:
        sys.modules["sitecustomize"] = ours     # the import system looks its module up once it has run
        if exc.name != "sitecustomize":
            raise


if __name__ == "sitecustomize":     # run by Python's start-up, not imported by name
    _start()
