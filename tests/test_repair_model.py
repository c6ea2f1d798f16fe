"""Seeded random programs under ``on_misuse="repair"`` with a stream of injected
misuse: double frees, duplicates in batches, sentinels, blocks of another
queue, removes of unlinked blocks and of another pool's blocks.

The valid operations and cursors are test_model.py's. After every operation
the queue must hold exactly the oracle's free blocks in the oracle's order
(every invariant of helpers.check_queue), the other queue must be untouched,
and ``queue.repairs`` must equal the oracle's count of the misuses skipped,
per kind. Misuse with no safe repair (popleft beyond the count, a non-block in
a batch) must still raise and change nothing.
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.mirror import Mirror, Program

OPERATIONS = 20_000


class RepairProgram(Program):
    """test_model's program on a queue bound to a pool, with misuse injected."""

    def __init__(self, queue_mod: ModuleType, rng: random.Random) -> None:
        super().__init__(queue_mod, rng, on_misuse="repair", pool="this pool")
        # Linked in another queue, of another pool.
        self.foreign = [KVCacheBlock(100 + i, pool="another pool") for i in range(4)]
        self.other = Mirror(queue_mod, self.oracle, self.foreign, on_misuse="repair")

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
        """A batch of freed blocks (none, some) with misuse mixed in: duplicates of
        them, free blocks, another queue's block, a sentinel."""
        rng = self.rng
        fresh = self.take(0, 4)
        batch = [*fresh, *rng.sample(fresh, rng.randint(0, len(fresh)))]
        batch += rng.sample(self.free, min(len(self.free), rng.randint(0, 2)))
        if rng.random() < 0.3:
            batch.append(rng.choice(self.foreign))
        if rng.random() < 0.3:
            batch.append(self.sentinel())
        rng.shuffle(batch)
        self.call("prepend_n" if front else "append_n", batch)

    def single_misuse(self) -> None:
        rng, call = self.rng, self.call
        choice = rng.randrange(6)
        if choice == 0 and self.free:
            call("append", rng.choice(self.free))  # a double free
        elif choice == 1:
            call("append", rng.choice(self.foreign))
        elif choice == 2:
            call("append", self.sentinel())
        elif choice == 3 and self.used:
            call("remove", rng.choice(self.used))
        elif choice == 4:
            call("remove", rng.choice(self.foreign))
        elif self.used:
            # No safe repair: refused whole, even after a repairable misuse.
            batch = [*self.used[:2], rng.choice((None, 7, "block"))]
            if rng.random() < 0.5 and self.free:
                batch.insert(0, rng.choice(self.free))
            call("append_n", batch, raises=TypeError)

    def invalid_call(self) -> None:
        # test_model's misuse raises under "raise": here it is single_misuse's.
        self.single_misuse()

    def check(self) -> None:
        super().check()
        self.other.check()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_repaired_misuse_matches_the_list_model(queue_mod: ModuleType, seed: int) -> None:
    program = RepairProgram(queue_mod, random.Random(seed))
    for _ in range(OPERATIONS):
        program.step()
        program.check()
    repairs = program.mirror.expected.repairs
    assert all(count > 0 for count in repairs.values()), repairs
    assert program.other.expected.repairs == dict.fromkeys(repairs, 0)
