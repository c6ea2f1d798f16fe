"""examples/demo.py's own logic, without vLLM: its setup's failure and its verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from support.helpers import load_script


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    return load_script("examples/demo.py")


def test_a_failed_venv_build_is_one_message(
    demo: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Venv.sh's own messages, then one line saying it failed (was a
    CalledProcessError traceback)."""
    (tmp_path / "venv.sh").write_text("echo 'venv.sh: no python3.11' >&2\nexit 4\n")
    monkeypatch.setattr(demo, "VLLM_TESTS", tmp_path)
    with pytest.raises(demo.Failed, match=r"venv.sh failed \(exit status 4\)"):
        demo.enter_venv(None)
    err = capsys.readouterr().err
    assert "venv.sh: no python3.11\n" in err


def test_the_verdict_says_what_each_contender_served(demo: ModuleType) -> None:
    """VLLM alone's engine died with requests unserved; raise stopped
    before serving anything wrong; lines of at most 100 columns."""
    counts = {
        "vLLM alone": {"right": 33, "wrong": 7, "unserved": 20},
        "kvqueue raise": {"right": 0, "wrong": 0, "unserved": 60},
        "kvqueue repair": {"right": 60, "wrong": 0, "unserved": 0},
    }
    said = demo.verdict(counts, True, True)
    assert max(map(len, said.splitlines())) <= 100
    flat = " ".join(said.split())
    assert (
        "vLLM alone served 7 of 60 wrong, silently, then its engine died with 20 unserved" in flat
    )
    assert "raise stopped at the fault, before serving anything wrong (0 of 60 served)" in flat
    assert flat.endswith("repair served 60 of 60 right")


def test_help_is_whole(demo: ModuleType) -> None:
    """``--help``: the docstring's whole first paragraph, and what each ``--form`` injects."""
    script = Path(str(demo.__file__))
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, str(script), "--help"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    flat = " ".join(done.stdout.split())
    assert "side by side with vLLM alone, kvqueue under raise, kvqueue under repair." in flat
    for form, what in demo.FORMS.items():
        assert f"{form}: {what}" in flat
    assert all(len(line) <= 100 for line in done.stdout.splitlines())
