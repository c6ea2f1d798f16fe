"""The benchmark cases: what one timed cycle does, for a block queue and for the deque.

A case turns a contender's queue class into a :class:`Bench`: ``prepare()`` (untimed) before
every sample, ``run(loops)`` (timed) repeating the cycle, and ``ids()``, the order every
contender of a case must end in after the same cycles. Every contender gets its own blocks (the
queue links live in them); the timed loops bind methods to locals first, so that the harness
adds the same small cost to every contender.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import cycle, islice, repeat
from typing import Any

from kvqueue import KVCacheBlock

SMALL_POOL = 2_048
LARGE_POOL = 100_000
MIX = (1,) * 90 + (2,) * 5 + (8,) * 4 + (32,)
SCAN = 1_000


def _drain(iterable: Iterable[Any]) -> None:
    # A zero-length deque consumes an iterator at C speed: only the iterator is timed.
    deque(iterable, maxlen=0)


@dataclass
class Bench:
    run: Callable[[int], None]
    ids: Callable[[], list[int]]
    prepare: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Case:
    name: str
    pool: int
    cycle: str  # what one timed cycle is, for the table
    build: Callable[[type, int, random.Random], Bench | None]
    # Builds time one construction per sample: no calibration, one cycle each.
    single_shot: bool = False

    @property
    def key(self) -> str:
        return f"{self.name} @{self.pool}"


def _ids(queue: Any) -> list[int]:
    # get_all_free_blocks, not iter_blocks_after: every vLLM line has it (0.23-0.25 lack the other).
    blocks = queue if isinstance(queue, deque) else queue.get_all_free_blocks()
    return [block.block_id for block in blocks]


def _start(queue_class: type, pool: int) -> tuple[Any, Callable[[], list[int]]]:
    """A fresh queue (or deque) over its own ``pool`` blocks, and its ids() reader."""
    queue = queue_class([KVCacheBlock(i) for i in range(pool)])
    return queue, lambda: _ids(queue)


def alloc_free(k: int, lifo: bool = False) -> Callable[[type, int, random.Random], Bench]:
    """Allocate ``k`` blocks from the front and free them to the back (BlockPool's FIFO path)
    or, ``lifo``, back to the front (blocks with nothing to cache)."""

    def build(queue_class: type, pool: int, rng: random.Random) -> Bench:
        queue, ids = _start(queue_class, pool)
        if queue_class is not deque:
            popleft_n, free = queue.popleft_n, queue.prepend_n if lifo else queue.append_n

            def run(loops: int) -> None:
                for _ in repeat(None, loops):
                    free(popleft_n(k))

        elif lifo:
            popleft, extendleft, per_block = queue.popleft, queue.extendleft, range(k)

            def run(loops: int) -> None:
                for _ in repeat(None, loops):
                    extendleft(reversed([popleft() for _ in per_block]))

        else:
            popleft, extend, per_block = queue.popleft, queue.extend, range(k)

            def run(loops: int) -> None:
                for _ in repeat(None, loops):
                    extend([popleft() for _ in per_block])

        return Bench(run, ids)

    return build


def popleft_append(queue_class: type, pool: int, rng: random.Random) -> Bench:
    queue, ids = _start(queue_class, pool)
    popleft, append = queue.popleft, queue.append

    def run(loops: int) -> None:
        for _ in repeat(None, loops):
            append(popleft())

    return Bench(run, ids)


def remove_append(queue_class: type, pool: int, rng: random.Random) -> Bench | None:
    """Take blocks out of the middle (a prefix-cache hit) and free them to the back, in two
    shuffled orders, alternating: memory touched as scattered as an engine's cache hits."""
    if queue_class is deque:
        return None  # deque.remove is a linear search: no equivalent.
    queue, ids = _start(queue_class, pool)
    blocks = queue.get_all_free_blocks()
    walk = cycle(rng.sample(blocks, len(blocks)) + rng.sample(blocks, len(blocks)))
    remove, append = queue.remove, queue.append

    def run(loops: int) -> None:
        for block in islice(walk, loops):
            remove(block)
            append(block)

    return Bench(run, ids)


def mix(queue_class: type, pool: int, rng: random.Random) -> Bench:
    """One pass: the 100 allocations of ``MIX`` in shuffled order, each freed to the back at
    once (holding the blocks would time the caller's bookkeeping as much as the queue)."""
    queue, ids = _start(queue_class, pool)
    sizes = rng.sample(MIX, len(MIX))
    if queue_class is deque:
        popleft, extend = queue.popleft, queue.extend
        ranges = [range(k) for k in sizes]

        def run(loops: int) -> None:
            for _ in repeat(None, loops):
                for per_block in ranges:
                    extend([popleft() for _ in per_block])

    else:
        popleft_n, append_n = queue.popleft_n, queue.append_n

        def run(loops: int) -> None:
            for _ in repeat(None, loops):
                for k in sizes:
                    append_n(popleft_n(k))

    return Bench(run, ids)


def scan(queue_class: type, pool: int, rng: random.Random) -> Bench:
    """Walk the first ``SCAN`` free blocks, as an evictor looking for candidates does."""
    queue, ids = _start(queue_class, pool)
    if queue_class is deque:

        def run(loops: int) -> None:
            for _ in repeat(None, loops):
                _drain(islice(queue, SCAN))

    else:
        iter_blocks_after = queue.iter_blocks_after

        def run(loops: int) -> None:
            for _ in repeat(None, loops):
                _drain(islice(iter_blocks_after(None), SCAN))

    return Bench(run, ids)


def build(queue_class: type, pool: int, rng: random.Random) -> Bench:
    """Construct the queue over ``pool`` fresh blocks (an engine's start-up)."""
    blocks = [KVCacheBlock(i) for i in range(pool)]
    made: list[Any] = [None]

    def prepare() -> None:
        # The previous queue is released and the links cleared outside the timed region.
        made[0] = None
        if queue_class is not deque:
            for block in blocks:
                block.prev_free_block = block.next_free_block = None

    def run(loops: int) -> None:
        for _ in repeat(None, loops):
            made[0] = queue_class(blocks)

    return Bench(run, lambda: _ids(made[0]), prepare)


def all_cases(quick: bool = False) -> list[Case]:
    """Every case; ``quick``: the small pool's and the smaller build, well under a minute."""
    pools = (SMALL_POOL,) if quick else (SMALL_POOL, LARGE_POOL)
    builds = (LARGE_POOL,) if quick else (LARGE_POOL, 1_000_000)
    cases = []
    for pool in pools:
        cases += [
            Case(f"popleft_n({k}) + append_n", pool, f"{k}-block alloc + free", alloc_free(k))
            for k in (1, 2, 8, 32)
        ]
        cases += [
            Case("popleft + append", pool, "1-block alloc + free", popleft_append),
            Case("remove + append", pool, "cache hit + free", remove_append),
            Case("popleft_n(8) + prepend_n", pool, "LIFO alloc + free", alloc_free(8, lifo=True)),
            Case("mix", pool, "100 alloc + free cycles", mix),
            Case(f"iter_blocks_after x{SCAN}", pool, f"scan of {SCAN} blocks", scan),
        ]
    return cases + [Case("build", pool, "construction", build, single_shot=True) for pool in builds]
