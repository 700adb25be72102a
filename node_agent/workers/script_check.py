"""Is the workers' Python script there, and does it compile? Asked once, before the node joins, by node-agent
and the torchrun plugin: a typo or syntax error would fail every round alike and use up the restarts. A
directory or zip archive need only exist. Compiled by the workers' interpreter (a child of it when not ours),
so a syntax only another Python version accepts is not refused.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from string import Template

_COMPILE = ("import json, sys\n"
            "try:\n"
            "    compile(open(sys.argv[1], 'rb').read(), sys.argv[1], 'exec', dont_inherit=True)\n"
            "except SyntaxError as e:\n"
            "    print(json.dumps([e.msg, e.lineno, e.text]))\n"
            "except ValueError as e:\n"
            "    print(json.dumps([str(e), None, None]))\n")
CHILD_TIMEOUT_S = 20.0


def script_problem(script: str, python: str | None = None, local_ranks: int = 1) -> str | None:
    """One line saying why `script` cannot run under `python` (default: this one), or None. torchrun's
    `${local_rank}` in the path becomes each of `local_ranks` local ranks' own, as it does in the workers' command
    (`train_${local_rank}.py`): each such script is checked."""
    for each in dict.fromkeys(Template(script).safe_substitute(local_rank=str(r)) for r in range(max(1, local_ranks))):
        if problem := _problem(each, python):
            return problem
    return None


def _problem(script: str, python: str | None) -> str | None:
    path = os.path.abspath(script)
    if not os.path.exists(path):
        return f"the script {script!r} does not exist (looked for {path})"
    if os.path.isdir(path) or zipfile.is_zipfile(path):
        return None
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        return f"cannot read the script {script!r}: {exc.strerror or exc}"
    ours = python is None or os.path.realpath(python) == os.path.realpath(sys.executable)
    error = _compile_here(source, path) if ours else _compile_in(python or sys.executable, path)
    if error is None:
        return None
    message, line, text = error
    where = f", line {line}" if line else ""
    code = f": {text.strip()[:120]}" if text and text.strip() else ""
    return f"the script {script!r} does not compile{where}: {message}{code}"


def _compile_here(source: bytes, path: str) -> tuple[str, int | None, str | None] | None:
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return str(exc.msg), exc.lineno, exc.text
    except ValueError as exc:       # a null byte in the source
        return str(exc), None, None
    return None


def _compile_in(python: str, path: str) -> tuple[str, int | None, str | None] | None:
    """Compiled by the workers' own interpreter; when it cannot be asked, the workers will say why."""
    try:
        done = subprocess.run([python, "-c", _COMPILE, path], capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, check=False)
        found = json.loads(done.stdout) if done.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    if not isinstance(found, list) or len(found) != 3:
        return None
    message, line, text = found
    return str(message), line if isinstance(line, int) else None, text if isinstance(text, str) else None
