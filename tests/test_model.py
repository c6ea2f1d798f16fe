"""Seeded random programs against a plain-list model, every invariant checked
after every operation (the sortedcontainers way).

Three seeds x 20,000 operations per twin. Invalid calls are mixed in: each must
raise the contract's exception and leave the state untouched.
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest
from helpers import check_queue
from model import Model

OPERATIONS = 20_000


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_program_matches_the_list_model(queue_mod: ModuleType, seed: int) -> None:
    model = Model(queue_mod, random.Random(seed))
    for _ in range(OPERATIONS):
        model.step()
        check_queue(model.queue, model.free, model.blocks)
