"""Regression cases for crashes the fuzzers found, each in its own process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hostile_cases import CASES, COMPILED_ONLY

HERE = Path(__file__).parent
TWINS = [
    pytest.param("kvqueue._queue", id="c", marks=pytest.mark.c_extension),
    pytest.param("kvqueue._queue_py", id="py"),
]


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("case", CASES)
def test_hostile_case(case: str, twin: str) -> None:
    if case in COMPILED_ONLY and twin.endswith("_py"):
        pytest.skip("the pure twin is not atomic under re-entrant collection")
    code = f"import hostile_cases; hostile_cases.{case}({twin!r})"
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", code],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr == "", done.stderr[-4000:]
