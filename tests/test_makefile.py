"""The Makefile's choice of interpreter: PYTHON as CONTRIBUTING writes it (PYTHON=python3.13)
works under pyenv when that version is not a selected one, or stops saying what to set."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Make:
    """``make -s`` in the checkout, with a pyenv whose only version, 3.99.1, is this
    interpreter: its python3.99 is on no PATH."""

    def __init__(self, tmp_path: Path) -> None:
        self.pyenv_python = tmp_path / "pyenv" / "versions" / "3.99.1" / "bin" / "python3.99"
        self.pyenv_python.parent.mkdir(parents=True)
        self.pyenv_python.symlink_to(sys.executable)
        tools = tmp_path / "tools"
        tools.mkdir()
        (tools / "pyenv").write_text(f'#!/bin/sh\n[ "$1" = root ] && echo {tmp_path / "pyenv"}\n')
        (tools / "pyenv").chmod(0o755)
        self.env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
        self.env.pop("PYTHON", None)

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["make", "-s", "-C", str(ROOT), *args], env=self.env, capture_output=True, text=True
        )


@pytest.fixture
def make(tmp_path: Path) -> Make:
    if shutil.which("make") is None or not (ROOT / "Makefile").exists():
        pytest.skip("no make, or the suite runs outside the source tree")
    return Make(tmp_path)


def test_a_python_only_pyenv_has_is_found_there(make: Make, tmp_path: Path) -> None:
    done = make("-n", "test", "PYTHON=python3.99", f"VENV={tmp_path / 'venv'}")
    assert done.returncode == 0, done.stderr
    assert f"{make.pyenv_python} -m venv --clear {tmp_path / 'venv'}" in done.stdout


def test_a_python_that_is_nowhere_stops_saying_what_to_set(make: Make, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    done = make("PYTHON=python9.98", f"VENV={venv}", f"{venv}/.ready")
    assert done.returncode != 0
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("make: PYTHON=")]
    assert line == (
        "make: PYTHON=python9.98 does not run (nor does pyenv have it): set PYTHON to an "
        "interpreter's path"
    )
    assert not venv.exists()
