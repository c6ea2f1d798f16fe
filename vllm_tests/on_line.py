"""A script of ``vllm_tests/`` run in its own process on the installed line's own test files.

The script runs from the root of the line's tests (``sdist.tests_root``), so that it imports
their helpers (``tests/v1/core/utils.py``) as vLLM's tests do, offline against a local hub of
the models' configurations (``hub.py``), with kvqueue's policy left to the script. Its last
line of output is one JSON object: what it found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import hub
import sdist

from kvqueue.vllm._lines import find

HERE = Path(__file__).resolve().parent


def run(script: str, args: list[str], home: Path, timeout: int, **env: str) -> dict[str, Any]:
    """The JSON object ``script`` (a file of this folder) prints last, run with ``args`` and
    ``env`` on the installed line, its hub cache written to ``home``; the script's exit status
    and the tail of its errors are asserted, and that none was ignored."""
    line = find(version("vllm"))
    assert line is not None, f"vLLM {version('vllm')} is not a line kvqueue accepts"
    root = sdist.tests_root(line.release)
    hub.write(home)
    path = [str(root), str(HERE), os.environ.get("PYTHONPATH", "")]
    given = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        HF_HOME=str(home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        **env,
    )
    given.pop("KVQUEUE_ON_MISUSE", None)
    done = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        cwd=root,
        env=given,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # Nothing of kvqueue's may fail where no caller sees it: a weak reference's callback, a
    # finalizer at the interpreter's exit.
    assert "Exception ignored" not in done.stderr, done.stderr[-4000:]
    found: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return found
