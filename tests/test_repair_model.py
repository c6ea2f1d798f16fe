"""Seeded random programs under ``on_misuse="repair"`` with a stream of injected
misuse: double frees, duplicates in batches, sentinels, blocks of another
queue, removes of unlinked blocks and of another pool's blocks.

The valid operations and cursors are test_model.py's. After every operation
the queue must hold exactly the model's free blocks in the model's order
(every invariant of helpers.check_queue), the other queue must be untouched,
and ``queue.repairs`` must equal the model's count of the misuses injected,
per kind. Misuse with no safe repair (popleft beyond the count, a non-block in
a batch) must still raise and change nothing.
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest
from helpers import check_queue
from model import Model

from kvqueue import KVCacheBlock

POOL = 32
OPERATIONS = 20_000
KINDS = ("duplicate", "linked", "sentinel", "not_linked", "other_pool")


class RepairModel(Model):
    """test_model's list model, and the repairs the queue must have counted."""

    def __init__(self, queue_mod: ModuleType, rng: random.Random) -> None:
        self.rng = rng
        self.blocks = [KVCacheBlock(i, pool="this pool") for i in range(POOL)]
        self.queue = queue_mod.FreeKVCacheBlockQueue(self.blocks, on_misuse="repair")
        self.free = list(self.blocks)
        self.used: list[Any] = []
        self.new_cursor()
        # Linked in another queue, of another pool.
        self.foreign = [KVCacheBlock(100 + i, pool="another pool") for i in range(4)]
        self.other = queue_mod.FreeKVCacheBlockQueue(self.foreign, on_misuse="repair")
        self.repairs = dict.fromkeys(KINDS, 0)

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.15:
            self.batch(front=roll < 0.05)
        elif roll < 0.3:
            self.single_misuse()
        else:
            super().step()

    def sentinel(self) -> Any:
        return self.rng.choice((self.queue.fake_free_list_head, self.queue.fake_free_list_tail))

    def batch(self, front: bool) -> None:
        """A batch of freed blocks with misuse mixed in; the model links each
        freed block once, in order of first appearance."""
        rng = self.rng
        fresh = self.take(rng.randint(0, min(4, len(self.used))))
        batch = list(fresh)
        for block in rng.sample(fresh, rng.randint(0, len(fresh))):
            batch.append(block)
            self.repairs["duplicate"] += 1
        for block in rng.sample(self.free, min(len(self.free), rng.randint(0, 2))):
            batch.append(block)
            self.repairs["linked"] += 1
        if rng.random() < 0.3:
            batch.append(rng.choice(self.foreign))
            self.repairs["linked"] += 1
        if rng.random() < 0.3:
            batch.append(self.sentinel())
            self.repairs["sentinel"] += 1
        rng.shuffle(batch)
        if not batch:
            return
        linked = list({id(b): b for b in batch if any(b is f for f in fresh)}.values())
        if front:
            self.queue.prepend_n(batch)
            self.free[:0] = linked
        else:
            self.queue.append_n(batch)
            self.free.extend(linked)

    def single_misuse(self) -> None:
        rng, queue = self.rng, self.queue
        choice = rng.randrange(6)
        if choice == 0 and self.free:
            queue.append(rng.choice(self.free))  # a double free
            self.repairs["linked"] += 1
        elif choice == 1:
            queue.append(rng.choice(self.foreign))
            self.repairs["linked"] += 1
        elif choice == 2:
            queue.append(self.sentinel())
            self.repairs["sentinel"] += 1
        elif choice == 3 and self.used:
            queue.remove(rng.choice(self.used))
            self.repairs["not_linked"] += 1
        elif choice == 4:
            queue.remove(rng.choice(self.foreign))
            self.repairs["other_pool"] += 1
        elif self.used:
            # No safe repair: refused whole, even after a repairable misuse.
            batch = [*self.used[:2], rng.choice((None, 7, "block"))]
            if rng.random() < 0.5 and self.free:
                batch.insert(0, rng.choice(self.free))
            self.must_fail(TypeError, queue.append_n, batch)

    def invalid_call(self) -> None:
        # test_model's misuse raises under "raise": here it is single_misuse's.
        self.single_misuse()

    def check(self) -> None:
        check_queue(self.queue, self.free, self.blocks)
        check_queue(self.other, self.foreign, self.foreign)
        assert self.queue.repairs == self.repairs
        assert self.other.repairs == dict.fromkeys(KINDS, 0)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_repaired_misuse_matches_the_list_model(queue_mod: ModuleType, seed: int) -> None:
    model = RepairModel(queue_mod, random.Random(seed))
    for _ in range(OPERATIONS):
        model.step()
        model.check()
    assert all(count > 0 for count in model.repairs.values()), model.repairs
