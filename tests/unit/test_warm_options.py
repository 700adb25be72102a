"""--warm-workers and --warm-preload, and which launch may start warm (no process is started here)."""
from __future__ import annotations

import os
import sys

import pytest

from node_agent.cli.options import OptionsError, parse_options
from node_agent.settings import DEFAULT_PRELOAD
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.warm.early_env import environment_set_first, preloads_before_a_set
from node_agent.workers.warm.eligible import (
    base_env,
    entry_imports,
    imports_any,
    script_preloads,
    standard_library_only,
    warm_launch,
)
from tests.options_view import flat

ENV = {"PATH": "/usr/bin"}


def parse(*argv: str):
    return flat(parse_options(["--standalone", *argv], ENV))


def test_warm_workers_are_on_for_python_scripts_and_modules_by_default() -> None:
    for opts in (parse("train.py"), parse("-m", "pkg.train")):
        assert opts.warm_workers == "auto" and opts.warm and opts.warm_preload is None   # DEFAULT_PRELOAD and
        # the installed packages the script imports (test_the_script_s_installed_imports_are_preloaded)


@pytest.mark.parametrize("argv", [("--warm-workers", "off", "train.py"), ("--no-python", "prog"),
                                  ("--run-path", "train.py"), ("--warm_workers=off", "-m", "m")])
def test_cold_start_keeps_for_off_no_python_and_run_path(argv) -> None:
    assert not parse(*argv).settings.workers.warm


def test_warm_preload_replaces_the_list() -> None:
    assert parse("--warm-preload", "json, numpy ,json,", "t.py").warm_preload == ("json", "numpy")
    assert parse("--warm-preload", "", "t.py").warm_preload == ()
    assert parse("--warm-preload", "transformers:Trainer", "t.py").warm_preload == ("transformers:Trainer",)


@pytest.mark.parametrize("argv, message", [
    (("--warm-workers", "on", "t.py"), "--warm-workers: expected auto or off, got 'on'"),
    (("--warm-preload", "torch,os.path/x", "t.py"), "--warm-preload: 'os.path/x' is not a module name"),
    (("--warm-preload", "a:b:c", "t.py"), "--warm-preload: 'a:b:c' is not a module name"),
    (("--warm-preload", ",".join(f"m{i}" for i in range(65)), "t.py"), "--warm-preload: at most 64 modules"),
])
def test_bad_warm_flags_are_one_line_naming_the_flag(argv, message) -> None:
    with pytest.raises(OptionsError) as err:
        parse(*argv)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def launch(argv: list[str], **env: str) -> WorkerLaunch:
    return WorkerLaunch(local_rank=0, rank=0, argv=argv, env={**ENV, "RANK": "0", **env}, log_dir=None)


def test_scripts_and_modules_of_the_zygotes_python_may_start_warm(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    script = warm_launch(launch([sys.executable, "-u", "t.py", "a"]), sys.executable)
    assert script is not None and script.script == "t.py" and script.argv == ["t.py", "a"]
    assert script.path0 == str(tmp_path)
    assert script.orig_argv == [sys.executable, "-u", "t.py", "a"] and script.base_env == ENV
    module = warm_launch(launch([sys.executable, "-u", "-m", "pkg.m", "b"]), sys.executable)
    assert module is not None and module.module == "pkg.m" and module.argv == ["-m", "b"]
    assert module.path0 == os.getcwd()


@pytest.mark.parametrize("argv", [
    ["/other/python", "-u", "t.py"],            # not the zygote's interpreter
    [sys.executable, "t.py"],                   # not the cold path's flags
    [sys.executable, "-u", "-c", "print()"],    # --run-path's form
    [sys.executable, "-u", "missing.py"],       # python itself reports it, cold
    [sys.executable, "-u", "-m"],
    ["t.py"],                                   # --no-python
])
def test_other_launches_start_cold(tmp_path, monkeypatch, argv) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    assert warm_launch(launch(argv), sys.executable) is None


def test_a_zip_archive_starts_cold_as_python_runs_its_main(tmp_path, monkeypatch) -> None:
    import zipfile
    monkeypatch.chdir(tmp_path)
    with zipfile.ZipFile(tmp_path / "app.zip", "w") as z:
        z.writestr("__main__.py", "print('hi')\n")
    assert warm_launch(launch([sys.executable, "-u", "app.zip"]), sys.executable) is None


def test_the_launchers_per_worker_variables_are_not_part_of_the_zygotes_environment() -> None:
    env = {**ENV, "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "1", "TORCHELASTIC_ERROR_FILE": "/e",
           "NODE_AGENT_PROGRESS": "/r;/s;40", "OMP_NUM_THREADS": "1"}
    assert base_env(env) == {**ENV, "OMP_NUM_THREADS": "1"}


def uses_preload(entry: str, *, module: bool, cwd: str) -> bool:
    """The rule LocalWorkers applies for its wait (workers/local.py)."""
    return imports_any(entry_imports(entry, module=module, cwd=cwd), DEFAULT_PRELOAD)


@pytest.mark.parametrize("source, uses", [
    ("import torch\n", True),
    ("import os, torch.distributed as dist\n", True),
    ("from torch.nn.parallel import DistributedDataParallel\n", True),
    ("def main():\n    import torch\n", True),                 # imported late, still imported
    ("import json\nimport torchvision\n", False),           # another package whose name starts alike
    ("from . import torch\n", False),                       # a relative import is the script's own module
    ("import os\nprint('no torch here')\n", False),
    ("this is not python (\n", True),                       # unreadable: assume it does (at worst a cold wait)
], ids=["import", "dotted", "from", "nested", "torchvision", "relative", "none", "syntax-error"])
def test_a_round_waits_for_the_zygote_only_when_the_script_imports_what_it_preloads(tmp_path, source, uses) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    assert uses_preload(str(script), module=False, cwd=str(tmp_path)) is uses


def test_a_module_entry_point_is_found_on_the_path_without_importing_it(tmp_path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('the agent must not run this')\n")
    (package / "train.py").write_text("import torch\n")
    (package / "plain.py").write_text("import os\n")
    (package / "__main__.py").write_text("import torch.optim\n")
    cwd = str(tmp_path)
    assert uses_preload("pkg.train", module=True, cwd=cwd)
    assert uses_preload("pkg", module=True, cwd=cwd)            # pkg/__main__.py
    assert not uses_preload("pkg.plain", module=True, cwd=cwd)
    assert uses_preload("pkg.nowhere", module=True, cwd=cwd)    # not found: assume so


SCRIPT = """import os, json
import torch.distributed as dist
import lightning.pytorch as L
from transformers import Trainer
from node_agent.training import protect
import mine
from helpers.data import load
if os.environ.get("X"):
    import accelerate
try:
    import wandb
except ImportError:
    wandb = None
def main():
    import deepspeed
if __name__ == "__main__":
    import datasets
"""


def test_the_script_s_installed_imports_are_preloaded_not_its_own_modules(tmp_path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "mine.py").write_text("")
    (tmp_path / "helpers").mkdir()
    got = script_preloads(str(tmp_path / "train.py"), module=False, cwd="/", path0=str(tmp_path))
    # the names a `from` imports after the modules (a lazy package imports a name's code when it is looked up);
    # none from a module not preloaded (`helpers.data`: the script's own)
    assert got == ("torch.distributed", "lightning.pytorch", "transformers", "node_agent.training", "accelerate",
                   "transformers:Trainer", "node_agent.training:protect")
    assert script_preloads(str(tmp_path / "none.py"), module=False, cwd="/", path0=str(tmp_path)) == ()
    (tmp_path / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from transformers import Trainer\n")     # never run
    assert script_preloads(str(tmp_path / "typed.py"), module=False, cwd="/", path0=str(tmp_path)) == ()


@pytest.mark.parametrize("source, found", [
    ("import os\nos.environ['OMP_NUM_THREADS'] = '2'\nimport torch\n", ("OMP_NUM_THREADS", "torch")),
    ("import os\nos.environ.setdefault('TORCH_LOGS', 'x')\nfrom torch import nn\n", ("TORCH_LOGS", "torch")),
    ("import os\nos.environ.update(MKL_NUM_THREADS='1')\nimport torch.distributed\n", ("MKL_NUM_THREADS", "torch")),
    ("import os\nos.environ.update({'A': '1'})\nimport torch\n", ("A", "torch")),
    ("from os import environ\nenviron['B'] = '1'\nimport torch\n", ("B", "torch")),
    ("import os\nos.putenv('C', '1')\nimport torch\n", ("C", "torch")),
    ("import os\nif __name__ == '__main__':\n    os.environ['D'] = '1'\n    import torch\n", ("D", "torch")),
    ("import os, torch\nos.environ['OMP_NUM_THREADS'] = '2'\n", None),            # after: torch has loaded
    ("import os\nos.environ['X'] = '1'\nimport json\n", None),                     # nothing preloaded after it
    ("import os\ndef main():\n    os.environ['X'] = '1'\nimport torch\n", None),   # a function, not run yet
    ("import os\nprint(os.environ['HOME'])\nimport torch\n", None),               # read, not set
    ("import os, numpy\nos.environ['E'] = '1'\nimport torch\n", ("E", "torch")),   # another preload first
    ("import os as _os\n_os.environ['F'] = '1'\nimport torch\n", ("F", "torch")),
    ("import os\nos.environ |= {'G': '1'}\nimport torch\n", ("G", "torch")),
    ("import os\ndef setup():\n    os.environ['H'] = '1'\nsetup()\nimport torch\n", ("H", "torch")),
    ("import os\nos.environ['MASTER_ADDR'] = 'h'\nos.environ['NCCL_DEBUG'] = 'INFO'\nimport torch\n", None),
    ("import os\nx = {}\nx" + "[0]" * 600 + " = 1\nos.environ['I'] = '1'\nimport torch\n", ("I", "torch")),
    # a review: removing a variable counts as setting one
    ("import os\nos.environ.pop('OMP_NUM_THREADS')\nimport torch\n", ("OMP_NUM_THREADS", "torch")),
    ("import os\ndel os.environ['J']\nimport torch\n", ("J", "torch")),
    ("import os\nos.unsetenv('K')\nimport torch\n", ("K", "torch")),
    ("import os\nos.environ.clear()\nimport torch\n", ("os.environ.clear", "torch")),
    # a change of sys.path is not one of the environment: torch, a base preload, is still preloaded after it
    ("import os, sys\nsys.path.insert(0, 'vendor')\nimport torch\n", None),
], ids=["assign", "setdefault", "update-kw", "update-dict", "environ", "putenv", "main-block", "after", "no-preload",
        "function", "read", "numpy-first", "alias", "or-assign", "setup-function", "read-later", "deep", "pop", "del",
        "unsetenv", "clear", "sys-path"])
def test_a_script_that_sets_a_variable_before_importing_a_preload_is_found(tmp_path, source, found) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    assert environment_set_first(str(script), DEFAULT_PRELOAD, module=False, cwd=str(tmp_path)) == found


@pytest.mark.parametrize("source, kept, left_out, early", [
    # the review's: a name looked up after the variable is set (transformers' Trainer imports accelerate, which
    # reads ACCELERATE_LOG_LEVEL): that name is not preloaded, the rest is
    ("import os, torch, transformers\nos.environ['ACCELERATE_LOG_LEVEL'] = 'INFO'\nfrom transformers import Trainer\n",
     ("transformers",), ("ACCELERATE_LOG_LEVEL", "transformers:Trainer"), None),
    # the package itself first imported after it: none of it
    ("import os, torch\nos.environ['HF_HOME'] = '/x'\nfrom transformers import Trainer\n",
     (), ("HF_HOME", "transformers"), None),
    # a base preload after it: the workers start cold, as before
    ("import os\nos.environ['OMP_NUM_THREADS'] = '2'\nimport torch, transformers\n",
     ("transformers", "transformers:Trainer"), None, ("OMP_NUM_THREADS", "torch")),
    ("import os, torch\nfrom transformers import Trainer\nos.environ['X'] = '1'\n",
     ("transformers", "transformers:Trainer"), None, None),
], ids=["name-after", "package-after", "base-after", "set-last"])
def test_the_script_s_imports_after_it_sets_a_variable_are_not_preloaded(tmp_path, source, kept, left_out,
                                                                         early) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    preload = (*DEFAULT_PRELOAD, "transformers", "transformers:Trainer")
    got = preloads_before_a_set(str(script), preload, DEFAULT_PRELOAD, module=False, cwd=str(tmp_path))
    assert got == ((*DEFAULT_PRELOAD, *kept), left_out, early)


@pytest.mark.parametrize("source, early", [
    # any variable set before torch: a preload may read it as it loads (natively, or looping over os.environ as
    # tqdm does when torch imports it), so the workers start cold, as under torchrun
    ("import os\nos.environ['MY_APP_MODE'] = 'x'\nimport torch\n", ("MY_APP_MODE", "torch")),
    ("import os\nos.environ.setdefault('HF_HOME', '/x')\nos.environ.pop('SEED', None)\nimport torch\n",
     ("HF_HOME", "torch")),
    ("import os\nos.environ['TORCH_LOGS'] = '+dynamo'\nimport torch\n", ("TORCH_LOGS", "torch")),
    ("import os\nos.environ.update({'MY_APP_MODE': 'x', 'OMP_NUM_THREADS': '2'})\nimport torch\n",
     ("MY_APP_MODE", "torch")),
    ("import os\nkey = 'X'\nos.environ[key] = '1'\nimport torch\n", ("[key]", "torch")),
    ("import os\nos.environ.clear()\nimport torch\n", ("os.environ.clear", "torch")),
    ("import os, torch\nos.environ['MY_APP_MODE'] = 'x'\n", None),             # after torch: nothing
], ids=["app-variable", "two", "torch-logs", "update", "dynamic", "clear", "after"])
def test_a_variable_set_before_a_base_preload_starts_the_workers_cold(tmp_path, source, early) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    got = preloads_before_a_set(str(script), DEFAULT_PRELOAD, DEFAULT_PRELOAD, module=False, cwd=str(tmp_path))
    assert got == (DEFAULT_PRELOAD, None, early)


def test_a_variable_set_before_torch_is_said_as_torchs_not_as_the_scripts_torch_names(tmp_path) -> None:
    """`from torch import nn` is torch's: its names go with torch, not left out (said as "not preloading torch")."""
    script = tmp_path / "train.py"
    script.write_text("import os\nos.environ['MY_APP'] = '1'\nimport torch\nfrom torch import nn\n")
    preload = (*DEFAULT_PRELOAD, "torch:nn")
    got = preloads_before_a_set(str(script), preload, DEFAULT_PRELOAD, module=False, cwd=str(tmp_path))
    assert got == (preload, None, ("MY_APP", "torch"))


@pytest.mark.parametrize("own, source, found", [
    # a review: the script's own module sets the variable as it is imported, before the script imports torch
    ("import os\nos.environ['OMP_NUM_THREADS'] = '2'\n", "import settings\nimport torch\n",
     ("OMP_NUM_THREADS", "torch")),
    ("import os\ndef setup():\n    os.environ.pop('X', None)\nsetup()\n", "import settings, torch\n", ("X", "torch")),
    # its own module imports torch before it sets one: torch has loaded as it would have cold
    ("import os, torch\nos.environ['OMP_NUM_THREADS'] = '2'\n", "import settings\nimport torch\n", None),
    # a function of its own module, not called as it is imported
    ("import os\ndef later():\n    os.environ['X'] = '1'\n", "import settings\nimport torch\n", None),
], ids=["sets", "function-called", "torch-first", "not-called"])
def test_a_variable_the_scripts_own_module_sets_as_it_is_imported_is_found(tmp_path, own, source, found) -> None:
    (tmp_path / "settings.py").write_text(own)
    (tmp_path / "train.py").write_text(source)
    assert environment_set_first(str(tmp_path / "train.py"), DEFAULT_PRELOAD, module=False, cwd="/") == found


@pytest.mark.parametrize("source, left_out", [
    # a review: a vendored copy put first on sys.path: the zygote would have preloaded the installed one
    ("import sys, torch\nsys.path.insert(0, 'vendor')\nimport tqdm\n", ("sys.path", "tqdm")),
    ("import sys as s, torch\ns.path[:0] = ['vendor']\nimport tqdm\n", ("sys.path", "tqdm")),
    ("import site, torch\nsite.addsitedir('vendor')\nfrom tqdm import tqdm\n", ("sys.path", "tqdm")),
    ("from sys import path\nimport torch\npath.append('vendor')\nimport tqdm\n", ("sys.path", "tqdm")),
    ("import sys, torch, tqdm\nsys.path.insert(0, 'vendor')\n", None),     # imported before the change
], ids=["insert", "slice-alias", "addsitedir", "from-sys", "before"])
def test_the_scripts_imports_after_it_changes_sys_path_are_not_preloaded(tmp_path, source, left_out) -> None:
    (tmp_path / "train.py").write_text(source)
    preload = (*DEFAULT_PRELOAD, "tqdm", "tqdm:tqdm")
    got = preloads_before_a_set(str(tmp_path / "train.py"), preload, DEFAULT_PRELOAD, module=False, cwd="/")
    assert got == ((*DEFAULT_PRELOAD, *(() if left_out else ("tqdm", "tqdm:tqdm"))), left_out, None)


def test_a_script_and_own_modules_of_the_standard_library_alone_preload_no_torch(tmp_path) -> None:
    """A torch-free script's zygote imported torch and torch._dynamo (3.5 s of CPU) for nothing: only where the
    script and its own modules (read, never run) import the standard library alone; anything else may import
    torch, and keeps the preload."""
    def only_stdlib(source: str) -> bool:
        (tmp_path / "train.py").write_text(source)
        return standard_library_only(str(tmp_path / "train.py"), module=False, cwd="/", path0=str(tmp_path))
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("from . import io\n")
    (tmp_path / "helpers" / "io.py").write_text("import json\n")
    (tmp_path / "model.py").write_text("import helpers\nimport torch\n")
    assert only_stdlib("import os, sys, time\nimport helpers\n")
    assert not only_stdlib("import os\nimport model\n")                 # its own module imports torch
    assert not only_stdlib("import os\nfrom node_agent.training import snapshot\n")     # installed: may
    assert not only_stdlib("import os\nimport runpy\nimport model\n")
    (tmp_path / "helpers" / "io.py").write_text("import numpy\n")       # deeper in its own package
    assert not only_stdlib("import helpers\n")
    assert not standard_library_only(str(tmp_path / "nowhere.py"), module=False, cwd="/", path0=str(tmp_path))
