"""The list model of a queue that the model tests drive: the queue as a plain
list, with one lazy cursor, checked against the queue after every step."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from helpers import snapshot

from kvqueue import KVCacheBlock

POOL = 32


def _index(blocks: list[Any], block: Any) -> int:
    return next(i for i, b in enumerate(blocks) if b is block)


class Model:
    """The queue as a list, plus one lazy cursor with its expected position."""

    def __init__(self, queue_mod: ModuleType, rng: random.Random) -> None:
        self.rng = rng
        self.blocks = [KVCacheBlock(i) for i in range(POOL)]
        self.queue = queue_mod.FreeKVCacheBlockQueue(self.blocks)
        self.free = list(self.blocks)
        self.used: list[Any] = []
        self.new_cursor()

    def new_cursor(self) -> None:
        start = self.rng.choice([None, *self.free[:4]])
        self.cursor: Iterator[Any] = self.queue.iter_blocks_after(start)
        self.cursor_at: Any = start  # None: before the front
        self.cursor_done = False

    def advance_cursor(self) -> None:
        # The iterator reads its block's successor now, from the live list.
        if self.cursor_done:
            expected = None
        elif self.cursor_at is None:
            expected = self.free[0] if self.free else None
        elif any(b is self.cursor_at for b in self.free):
            i = _index(self.free, self.cursor_at)
            expected = self.free[i + 1] if i + 1 < len(self.free) else None
        else:
            expected = None
        got = next(self.cursor, None)
        assert got is expected
        if got is None:
            self.cursor_done = True
        self.cursor_at = got

    def take(self, k: int) -> list[Any]:
        return [self.used.pop(self.rng.randrange(len(self.used))) for _ in range(k)]

    def must_fail(self, exc: type[BaseException], call: Any, *args: Any) -> None:
        before = snapshot(self.queue, self.blocks)
        with pytest.raises(exc):
            call(*args)
        assert snapshot(self.queue, self.blocks) == before

    def step(self) -> None:
        rng, queue, free, used = self.rng, self.queue, self.free, self.used
        op = rng.randrange(14)
        if op == 0:
            if free:
                block = queue.popleft()
                assert block is free.pop(0)
                used.append(block)
            else:
                self.must_fail(ValueError, queue.popleft)
        elif op in (1, 2):
            n = rng.choice([1, 1, 1, 2, 3, 8])
            if n <= len(free):
                popped = queue.popleft_n(n)
                assert all(a is b for a, b in zip(popped, free[:n], strict=True))
                del free[:n]
                used.extend(popped)
            else:
                self.must_fail(AssertionError, queue.popleft_n, n)
        elif op == 3 and free:
            block = free.pop(rng.randrange(len(free)))
            queue.remove(block)
            used.append(block)
        elif op in (4, 5) and used:
            block = self.take(1)[0]
            queue.append(block)
            free.append(block)
        elif op in (6, 7) and used:
            batch = self.take(rng.randint(1, min(4, len(used))))
            queue.append_n(batch)
            free.extend(batch)
        elif op == 8 and used:
            batch = self.take(rng.randint(1, min(4, len(used))))
            queue.prepend_n(batch)
            free[:0] = batch
        elif op == 9:
            self.invalid_call()
        elif op == 10:
            self.new_cursor()
        else:
            self.advance_cursor()

    def invalid_call(self) -> None:
        rng, queue, free, used = self.rng, self.queue, self.free, self.used
        choice = rng.randrange(5)
        if choice == 0 and free:
            self.must_fail(ValueError, queue.append, rng.choice(free))
        elif choice == 1 and used:
            self.must_fail(RuntimeError, queue.remove, rng.choice(used))
        elif choice == 2 and used:
            batch = [*used[:3], used[0]]
            self.must_fail(ValueError, queue.append_n, batch)
        elif choice == 3 and used and free:
            batch = [*used[:2], rng.choice(free)]
            self.must_fail(ValueError, queue.prepend_n, batch)
        else:
            self.must_fail(TypeError, queue.append_n, [*used[:2], None])
