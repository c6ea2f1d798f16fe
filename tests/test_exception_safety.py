"""Every failing call leaves both queues and every block exactly as before.

Random valid states: a queue in some order, detached blocks, a second queue
whose blocks are foreign to the first, blocks of another class. On each,
failing calls of every kind, batches failing at every position (after part
of the batch is already linked), and iterables and ``__index__`` methods that
raise; the full snapshot (counts, and both links of every block and sentinel)
must be unchanged, and the queue must still work.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from functools import partial
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.blocks import VllmStyleBlock
from support.helpers import check_queue, snapshot

SEEDS = range(12)


class RaisingIndex:
    def __index__(self) -> int:
        raise OverflowError("no index")


def _raising_after(blocks: list[Any], count: int) -> Iterator[Any]:
    yield from blocks[:count]
    raise LookupError("the iterable failed part-way")


class State:
    def __init__(self, queue_mod: ModuleType, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        self.mod = queue_mod
        self.blocks = [KVCacheBlock(i) for i in range(rng.randint(4, 12))]
        self.queue = queue_mod.FreeKVCacheBlockQueue(self.blocks)
        self.queue.popleft_n(rng.randint(0, len(self.blocks)))
        for _ in range(rng.randint(0, 4)):  # shuffle the order a little
            if len(self.queue) > 1:
                self.queue.append(self.queue.popleft())
        self.other_blocks = [KVCacheBlock(100 + i) for i in range(3)]
        self.other = queue_mod.FreeKVCacheBlockQueue(self.other_blocks)
        self.alien = VllmStyleBlock(block_id=200)

    @property
    def free(self) -> list[Any]:
        return list(self.queue.get_all_free_blocks())

    @property
    def detached(self) -> list[Any]:
        return [b for b in self.blocks if b.prev_free_block is None]

    def snapshot(self) -> Any:
        everything = [*self.blocks, *self.other_blocks, self.alien]
        return snapshot(self.queue, everything), snapshot(self.other, everything)

    def bad_items(self) -> list[Any]:
        """Things a batch must refuse, from this state."""
        queue = self.queue
        bad: list[Any] = [None, 7, "block", self.alien, self.other_blocks[1]]
        bad += [queue.fake_free_list_head, queue.fake_free_list_tail]
        bad += [self.other.fake_free_list_head]
        bad += self.free[:2]
        return bad

    def failing_batches(self) -> Iterator[Callable[[], Any]]:
        """Makers of batches of detached blocks that fail at each position
        (a maker, since an iterator is spent by its first use)."""
        detached = self.detached
        for position in range(len(detached) + 1):
            good, rest = detached[:position], detached[position:]
            yield partial(list, [*good, self.rng.choice(self.bad_items()), *rest])
            if good:
                # A duplicate, found only after its first copy was linked.
                yield partial(tuple, [*good, good[0], *rest])
            yield partial(_raising_after, detached, position)

    def failing_calls(self) -> Iterator[tuple[str, Callable[[], object]]]:
        queue, mod = self.queue, self.mod
        size = len(queue)
        if size == 0:
            yield "popleft empty", queue.popleft
        for n in (size + 1, -1, 2**70, -(2**70), 1.5, None, "1", RaisingIndex()):
            yield f"popleft_n({n!r})", partial(queue.popleft_n, n)
        removable = [*self.detached[:2], queue.fake_free_list_head, queue.fake_free_list_tail]
        for thing in [*removable, None, self.alien]:
            yield f"remove({thing!r:.40})", partial(queue.remove, thing)
        for thing in self.bad_items():
            yield f"append({thing!r:.40})", partial(queue.append, thing)
        for thing in (5, self.alien):
            yield f"iter_blocks_after({thing!r:.40})", partial(queue.iter_blocks_after, thing)
        for make in self.failing_batches():
            for method in (queue.append_n, queue.prepend_n, mod.FreeKVCacheBlockQueue):
                yield f"{method.__name__}({make})", partial(_call_with, method, make)
        yield "constructor, block_type=int", partial(mod.FreeKVCacheBlockQueue, [], block_type=int)
        if self.detached:
            yield (
                "constructor, other class",
                partial(mod.FreeKVCacheBlockQueue, self.detached, block_type=VllmStyleBlock),
            )


def _call_with(method: Callable[[Any], object], make: Callable[[], Any]) -> object:
    return method(make())


@pytest.mark.parametrize("seed", SEEDS)
def test_failing_calls_change_nothing(queue_mod: ModuleType, seed: int) -> None:
    state = State(queue_mod, seed)
    checked = 0
    for name, call in state.failing_calls():
        before = state.snapshot()
        try:
            call()
        except Exception as exc:
            error = exc
        else:
            pytest.fail(f"{name} did not fail")
        assert state.snapshot() == before, f"{name} raised {error!r} and changed the state"
        checked += 1
    expected = state.free
    check_queue(state.queue, expected, state.blocks)
    # And the queue still works: every detached block goes back in.
    state.queue.append_n(state.detached)
    check_queue(state.queue, expected + [b for b in state.blocks if b not in expected], [])
    assert checked > 30
