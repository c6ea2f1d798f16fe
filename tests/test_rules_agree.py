"""The screens and the rules agree: what a screen passes, the slow path would not refuse or
repair, and what it flags, the slow path finds. The screens decide alone
on the fast path, so a case where they miss what the rules would find is a misuse let
through; seeded batches over every line, both twins' screens."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest

from kvqueue.vllm import _rules
from kvqueue.vllm._lines import LINES, Line

from support.fake_pool import make_pool, pool_class, screen_of

SEEDS = range(40)


def _batch(rng: random.Random, pool: Any, other: Any, of: Line) -> list[Any]:
    """Held blocks, free ones, repeats, the null block and (0.30+) another pool's."""
    own = [b for b in pool.blocks if b is not pool.null_block]
    batch = rng.sample(own, rng.randint(1, 5))
    batch += rng.sample(batch, rng.randint(0, len(batch)))  # repeats
    if rng.random() < 0.2:
        batch.append(pool.null_block)
    if of.has_pool_field and rng.random() < 0.3:
        batch.append(rng.choice(other.blocks[1:]))
    rng.shuffle(batch)
    return batch


def _scramble(rng: random.Random, pool: Any) -> None:
    """Counts as vLLM and its misuses leave them: held, free, held and linked."""
    queue = pool.free_block_queue
    for block in pool.get_new_blocks(rng.randint(0, pool.get_num_free_blocks())):
        block.ref_cnt = rng.choice([1, 1, 2, 3])
    for block in rng.sample(queue.get_all_free_blocks(), min(2, queue.num_free_blocks)):
        block.ref_cnt = rng.choice([0, 0, 1, -1])  # 1: held while free; -1: overfreed


@pytest.mark.parametrize("of", LINES, ids=[each.name for each in LINES])
@pytest.mark.parametrize("method", ["free_blocks", "unpin_blocks"])
def test_what_a_screen_passes_the_rules_pass(queue_mod: ModuleType, of: Line, method: str) -> None:
    if method not in of.pool_methods:
        pytest.skip(f"vLLM {of.name} has no {method}")
    screen = screen_of(queue_mod)
    cls = pool_class(of)
    flagged = passed = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        pool = make_pool(cls, queue_mod, 12, "raise")
        other = make_pool(cls, queue_mod, 6, "raise")
        _scramble(rng, pool)
        for _ in range(20):
            batch = _batch(rng, pool, other, of)
            found = screen.first_excess(batch, of.pool_ref(pool))
            plan = _rules.FreePlan(pool, batch, of, method)
            excess = plan.dropped + plan.linked
            if found >= 0:
                flagged += 1
                assert any(block is batch[found] for block in excess), (seed, found)
            else:
                passed += 1
                assert not excess, (seed, [b.block_id for b in excess])
            if found == -1:  # no flag either: nothing to route, stray or queue once
                assert not plan.others, seed
                assert not plan.strays, seed
                counted = [id(b) for b in batch if not b.is_null]
                assert len(set(counted)) == len(counted), seed
    assert flagged  # both verdicts were reached
    assert passed
