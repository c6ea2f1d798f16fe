"""Random programs whose blocks' finalizers call back into the queues.

Blocks are a ``KVCacheBlock`` subclass whose ``__del__`` calls a random method
of a random queue (popping blocks whose own finalizers then run, linking fresh
blocks, putting itself back, keeping its dying queue alive). Some blocks sit in
reference cycles and the collector runs at nearly every allocation, so on 3.11
the finalizers also run from inside the queue's own methods, in the middle of
a batch; queues are dropped with their blocks still linked.

The compiled twin never runs Python code in the middle of an update, so each of
its queues must be well formed after every call (an exception is fine: a
finalizer may have taken the block a call was about to use). The pure twin can
be re-entered anywhere, like vLLM's own queue: it must only not crash.

Usage: python -m isolated.fuzz_reentrant TWIN SEED OPS
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from itertools import islice
from typing import Any

from kvqueue import KVCacheBlock

from support.fuzz_common import Stats, main, well_formed
from support.twins import twin

QUEUES: list[Any] = []  # the live queues the program and the finalizers use
TARGET: list[Any] = [None]  # the queue the program is calling: finalizers favour it
KEPT: list[Any] = []  # queues a finalizer kept alive as it died
COUNTS = {"finalizers": 0, "finalizer_raised": 0, "finalizers_inside": 0}
INSIDE = [False]  # True while the program's own call runs
DEPTH = [0]
RNG = random.Random()


class Reentrant(KVCacheBlock):
    """A block whose finalizer calls into a queue; ``me`` makes it a cycle."""

    __slots__ = ("home", "me")

    def __init__(self, block_id: int, **kwargs: Any) -> None:
        super().__init__(block_id, **kwargs)
        self.home: Any = None
        self.me: Any = None

    def __del__(self) -> None:
        COUNTS["finalizers"] += 1
        COUNTS["finalizers_inside"] += INSIDE[0]
        if DEPTH[0] > 2 or not QUEUES:
            return
        DEPTH[0] += 1
        try:
            _finalizer_action(self)
        except Exception:
            COUNTS["finalizer_raised"] += 1
        finally:
            DEPTH[0] -= 1


def fresh(home: Any = None) -> Reentrant:
    block = Reentrant(RNG.randrange(1000))
    block.home = home
    if RNG.random() < 0.5:
        block.me = block
    return block


def _finalizer_action(dying: Reentrant) -> None:
    queue = TARGET[0] if RNG.random() < 0.7 else RNG.choice(QUEUES)
    roll = RNG.random()
    if roll < 0.2:
        queue.popleft()
    elif roll < 0.35:
        queue.popleft_n(RNG.randint(0, 3))
    elif roll < 0.5:
        queue.append_n([fresh() for _ in range(RNG.randint(1, 3))])
    elif roll < 0.6:
        queue.prepend_n([fresh()])
    elif roll < 0.7:
        blocks = queue.get_all_free_blocks()
        if blocks:
            queue.remove(RNG.choice(blocks))
    elif roll < 0.8:
        # Put itself back, as a pool that recycles blocks on deletion would.
        if dying.prev_free_block is None and dying.next_free_block is None:
            queue.append(dying)
    elif roll < 0.9 and dying.home is not None:
        KEPT.append(dying.home)
        dying.home.popleft()
    else:
        sum(1 for _ in queue)


def _drop_cycle() -> None:
    block = Reentrant(-2)
    block.me = block


def _arm(cycles: int) -> list[Any]:
    """Leave cyclic garbage with finalizers, and make the collector run at the
    next allocation it counts.

    On 3.11 a new list counts only when the list free list is empty, so it is
    drained first (the caller holds the lists returned until its call is done).
    Calling a lambda allocates nothing that counts, so the collection lands
    inside the queue's method, as it may in a busy engine.
    """
    gc.set_threshold(0)  # no collection until armed
    drained: list[Any] = [[] for _ in range(100)]
    for _ in range(cycles):
        _drop_cycle()
    gc.set_threshold(1)
    return drained


def program(twin_name: str, seed: int, ops: int) -> Stats:
    RNG.seed(seed)
    mod = twin(twin_name)
    strict = twin_name == "cython"
    rng = random.Random(seed + 1)
    pool: list[Any] = []
    cursors: list[Any] = []
    stats = {"ops": 0, "raised": 0, "malformed": 0}

    def new_queue() -> Any:
        queue = mod.FreeKVCacheBlockQueue([], block_type=Reentrant)
        queue.append_n([fresh(queue) for _ in range(rng.randint(0, 8))])
        return queue

    QUEUES[:] = [new_queue() for _ in range(3)]
    for _ in range(ops):
        gc.set_threshold(rng.choice((1, 2, 3, 10, 700)))
        queue = TARGET[0] = rng.choice(QUEUES)
        call = _operation(rng, queue, pool, cursors, new_queue)
        drained = None  # not a list: freeing one would refill the free list
        if rng.random() < 0.5:
            drained = _arm(rng.randint(1, 3))
        INSIDE[0] = True
        try:
            call()
        except Exception:
            stats["raised"] += 1
        INSIDE[0] = False
        del drained
        stats["ops"] += 1
        for q in (*QUEUES, *KEPT[-3:]):
            why = well_formed(q)
            if why is not None:
                assert not strict, f"seed {seed}: {why}"
                stats["malformed"] += 1
                QUEUES[:] = [new_queue() if x is q else x for x in QUEUES]
                KEPT[:] = [x for x in KEPT if x is not q]
        del KEPT[:-3]
    gc.set_threshold(700)
    QUEUES.clear()
    KEPT.clear()
    del pool[:], cursors[:]
    gc.collect()
    stats.update(COUNTS)
    return stats


def _operation(
    rng: random.Random, queue: Any, pool: list[Any], cursors: list[Any], new_queue: Any
) -> Callable[[], object]:
    roll = rng.random()
    size = len(queue)
    if roll < 0.15:
        return lambda: pool.append(queue.popleft())
    if roll < 0.3:
        n = rng.randint(0, size)
        return lambda: pool.extend(queue.popleft_n(n))
    if roll < 0.37:
        return lambda: queue.get_all_free_blocks()
    if roll < 0.47:
        batch = [pool.pop() for _ in range(min(len(pool), rng.randint(0, 4)))]
        batch += [fresh(queue) for _ in range(rng.randint(0, 2))]
        link = rng.choice((queue.append_n, queue.prepend_n))
        return lambda: link(batch)
    if roll < 0.57 and pool:
        block = pool.pop()
        return lambda: queue.append(block)
    if roll < 0.65 and size:
        # A collection inside the snapshot may shrink the queue below `size`.
        free = queue.get_all_free_blocks()
        if free:
            block = free[rng.randrange(len(free))]
            return lambda: queue.remove(block)
    if roll < 0.72:
        start = rng.choice([None, *queue.get_all_free_blocks()[:2]])
        cursors.append(queue.iter_blocks_after(start))
        del cursors[:-4]
        return lambda: None
    if roll < 0.82 and cursors:
        cursor = rng.choice(cursors)
        return lambda: list(islice(cursor, 3))
    if roll < 0.9:
        # Drop detached blocks: their finalizers run now, or at a collection.
        return lambda: pool.clear()
    if roll < 0.95:
        # Drop a whole queue with its blocks still linked (maybe held by a cursor).
        index = rng.randrange(len(QUEUES))
        return lambda: QUEUES.__setitem__(index, new_queue())
    return gc.collect


if __name__ == "__main__":
    main(program)
