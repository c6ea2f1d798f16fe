"""Regression cases for crashes the fuzzers found, each in its own process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hostile_cases import CASES

ISOLATED = Path(__file__).parent / "isolated"


@pytest.mark.parametrize("case", CASES)
def test_hostile_case(case: str, queue_mod: ModuleType) -> None:
    twin = queue_mod.__name__
    code = f"import hostile_cases; hostile_cases.{case}({twin!r})"
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", code],
        cwd=ISOLATED,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr == "", done.stderr[-4000:]
