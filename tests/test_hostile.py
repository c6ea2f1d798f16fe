"""Regression cases for crashes the fuzzers found, each in its own process."""

from __future__ import annotations

from types import ModuleType

import pytest

from isolated.hostile_cases import CASES
from support.helpers import run_isolated


@pytest.mark.parametrize("case", CASES)
def test_hostile_case(case: str, queue_mod: ModuleType) -> None:
    done = run_isolated("hostile_cases", case, queue_mod.__name__)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr == "", done.stderr[-4000:]
