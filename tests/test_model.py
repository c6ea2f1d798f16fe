"""Seeded random programs against the list oracle, every invariant checked after
every operation (the sortedcontainers way).

Three seeds x 20,000 operations per twin. Invalid calls are mixed in: each must
raise the contract's exception and leave the state untouched.
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from support.mirror import Program

OPERATIONS = 20_000


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_program_matches_the_list_model(queue_mod: ModuleType, seed: int) -> None:
    program = Program(queue_mod, random.Random(seed))
    for _ in range(OPERATIONS):
        program.step()
        program.check()
