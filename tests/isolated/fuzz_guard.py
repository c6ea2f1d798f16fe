"""Random programs against the pool guard, on stand-in pools of a random vLLM line.

Callers free blocks more often than they hold them, across pools, by keyword, with counts
that are no integers; blocks are taken without touch() or given negative counts behind the
guard's back; a log filter raises or calls back into the pools; finalizers free blocks in
the middle of guarded calls (compiled twin; between them for the pure one); another thread
switches the guard between the twins' screens while this one calls.

What must hold whatever happens: no call crashes or hangs; every free list is well formed
and counted right; no block is handed out while held; under ``raise`` a refused call
changes nothing; under ``repair`` a misuse is repaired, not raised (a count that is no
integer, or links broken outside the queue, raise under both).

Usage: python -m isolated.fuzz_guard TWIN SEED OPS
"""

from __future__ import annotations

import gc
import importlib
import logging
import random
import sys
import threading
import time
from typing import Any

from kvqueue.vllm import _pool_guard
from kvqueue.vllm._lines import LINES

from support.fake_pool import guarded, make_pool, policy_of, screen_of, state
from support.fuzz_common import Stats, main, well_formed
from support.helpers import one_line
from support.twins import twin

RNG = random.Random()
COUNTS = {
    "ops": 0,
    "refused": 0,
    "repairs": 0,
    "log_callbacks": 0,
    "finalizers": 0,
    "switches": 0,
    "shortfalls": 0,
}
POOLS: list[Any] = []
# The collector may run a finalizer on the switching thread (any allocation there): its free
# would race the program's own call on the same pool, two threads between one guard's screen
# and the pool's update, which no guard can see (vLLM calls its pool from one thread). Such a
# finalizer leaves its free here, and the program's thread makes it before its next call.
PROGRAM_THREAD = threading.get_ident()
HANDED_OVER: list[tuple[Any, list[Any]]] = []
# The block the program is unpinning: a finalizer run inside that call must not free another
# of the program's entries for it (a reference the unpin is already giving back).
IN_FLIGHT: set[int] = set()


class Hostile(logging.Filter):
    """Raises, or calls back into a pool, on some of the guard's log records."""

    depth = 0

    def filter(self, record: logging.LogRecord) -> bool:
        roll = RNG.random()
        if roll < 0.2:
            raise RuntimeError("a log filter that raises")
        if roll < 0.4 and Hostile.depth == 0 and POOLS:
            Hostile.depth += 1
            try:
                COUNTS["log_callbacks"] += 1
                pool = RNG.choice(POOLS[1:])
                if pool.get_num_free_blocks() > 0:
                    pool.free_blocks(pool.get_new_blocks(1))
            finally:
                Hostile.depth -= 1
        return False


class Freer:
    """Cyclic garbage whose finalizer frees a held block (twice, sometimes) through the guard."""

    def __init__(self, pool: Any, held: list[Any]) -> None:
        self.pool, self.held, self.me = pool, held, self

    def __del__(self) -> None:
        if threading.get_ident() == PROGRAM_THREAD:
            free_one(self.pool, self.held)
        else:
            HANDED_OVER.append((self.pool, self.held))


def free_one(pool: Any, held: list[Any]) -> None:
    if not held or id(held[-1]) in IN_FLIGHT:
        return
    COUNTS["finalizers"] += 1
    block = held.pop()
    try:
        pool.free_blocks([block] * RNG.choice([1, 1, 2]))
    except TypeError:
        held.append(block)  # its ref_cnt is the program's no-integer, for now


def check(pool: Any) -> None:
    queue = pool.free_block_queue
    # The collector off: a finalizer run mid-check would make a sound list look miscounted.
    enabled = gc.isenabled()
    gc.disable()
    try:
        reason = well_formed(queue)
        assert reason is None, reason
        free = queue.get_all_free_blocks()
        assert queue.num_free_blocks == len(free), (queue.num_free_blocks, len(free))
    finally:
        if enabled:
            gc.enable()


def run(name: str, seed: int, ops: int) -> Stats:
    RNG.seed(seed)
    mod = twin(name)
    # Each queue twin meets the other screen twin too; an install without the compiled
    # twin (KVQUEUE_PURE=1, no compiler) has the pure screen only.
    try:
        other = importlib.import_module(
            "kvqueue.vllm._screen_py"
            if mod.__name__ == "kvqueue._queue"
            else "kvqueue.vllm._screen"
        )
    except ModuleNotFoundError:
        other = importlib.import_module("kvqueue.vllm._screen_py")
    of = RNG.choice(LINES)
    COUNTS["line"] = LINES.index(of)
    logger = logging.getLogger("kvqueue")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
    logger.addFilter(Hostile())
    # The compiled queue runs no Python code inside an update, so there finalizers may run
    # anywhere, inside the guard's calls included. The pure queue, like vLLM's, can be
    # re-entered mid-update (fuzz_reentrant.py): there they run between the program's calls.
    inside = mod.__name__ == "kvqueue._queue"
    if inside:
        gc.set_threshold(50, 5, 5)
    else:
        gc.disable()
    with guarded(mod, of) as cls:
        pools = [make_pool(cls, mod, 24, policy) for policy in ("raise", "repair", "repair")]
        POOLS.extend(pools)
        held: dict[int, list[Any]] = {id(pool): [] for pool in pools}
        stop = threading.Event()

        def switch() -> None:
            # The guard re-made with either twin's screens while calls run: none unguarded.
            screens = [screen_of(mod), other]
            choose = random.Random(seed)
            while not stop.is_set():
                _pool_guard.guard(
                    cls, choose.choice(screens), policy_of, wrap_foreign=False, line=of
                )
                COUNTS["switches"] += 1
                time.sleep(0.001)

        # Threads take turns often, so that switches land inside calls.
        sys.setswitchinterval(1e-5)
        switcher = threading.Thread(target=switch)
        switcher.start()
        try:
            for _ in range(ops):
                COUNTS["ops"] += 1
                while HANDED_OVER:
                    free_one(*HANDED_OVER.pop())
                pool = RNG.choice(pools)
                step(pool, pools, held, of)
                if not inside:
                    gc.collect()
                for each in pools:
                    check(each)
        finally:
            stop.set()
            switcher.join()
        POOLS.clear()
        COUNTS["repairs"] = sum(sum(_pool_guard.pool_repairs(each).values()) for each in pools)
    return COUNTS


def step(pool: Any, pools: list[Any], held: dict[int, list[Any]], of: Any) -> None:
    mine = held[id(pool)]
    strict = pools[0]  # the one pool under "raise"
    roll = RNG.random()
    before = state(strict)
    try:
        if roll < 0.25:
            n = RNG.choice([1, 1, 2, 3, True])
            if int(n) <= pool.get_num_free_blocks():
                got = pool.get_new_blocks(n)
                assert all(block.ref_cnt == 1 for block in got), "a held block was handed out"
                mine.extend(got)
        elif roll < 0.5 and mine:
            # A snapshot first: a finalizer may take blocks out of ``mine`` at any allocation.
            snapshot = list(mine)
            batch = RNG.sample(snapshot, RNG.randint(1, min(3, len(snapshot))))
            batch += RNG.sample(batch, RNG.randint(0, len(batch)))  # double frees
            if of.has_pool_field and RNG.random() < 0.2:
                there = held[id(RNG.choice(pools))]
                if there:
                    batch.append(there[-1])
            if RNG.random() < 0.5:
                pool.free_blocks(**{of.pool_methods["free_blocks"][0]: batch})
            else:
                pool.free_blocks(iter(batch))
            for each in held.values():
                each[:] = [block for block in each if block.ref_cnt > 0]
        elif roll < 0.6:
            free = pool.free_block_queue.get_all_free_blocks()
            if free:
                block = RNG.choice(free)
                pool.touch([block])
                mine.append(block)
        elif roll < 0.65:
            free = pool.free_block_queue.get_all_free_blocks()
            if free:
                RNG.choice(free).ref_cnt = RNG.choice([-1, 1])  # behind the guard's back
        elif roll < 0.7 and mine:
            block = RNG.choice(list(mine))
            saved = block.ref_cnt
            block.ref_cnt = RNG.choice([0.5, "1", None])
            try:
                pool.free_blocks([block])
                raise AssertionError("a ref_cnt that is no integer was freed")
            except TypeError:
                COUNTS["refused"] += 1
            finally:
                block.ref_cnt = saved
        elif roll < 0.8 and "unpin_blocks" in of.pool_methods and mine:
            # pop(), not a copy then remove(): a copy allocates, and a finalizer run by that
            # allocation may take the same block out of ``mine`` first.
            block = mine.pop()
            IN_FLIGHT.add(id(block))
            try:
                pool.unpin_blocks([block] * RNG.choice([1, 2]), on_reuse=lambda block: None)
            finally:
                IN_FLIGHT.discard(id(block))
        elif mine and pool is not strict:
            Freer(pool, mine)
            block = RNG.choice(list(mine) or [None])
            if block is None:
                return
            pool.touch([block])
            mine.append(block)
    except ValueError as exc:
        message = one_line(exc)
        if message.startswith("Cannot get"):
            COUNTS["shortfalls"] += 1  # a shortfall is vLLM's own error, the guard's none
            return
        # Only the "raise" pool refuses a misuse, be it this pool or the one it hands to.
        assert f"BlockPool at {id(strict):#x}" in message, message
        COUNTS["refused"] += 1
        assert state(strict) == before, message


if __name__ == "__main__":
    main(run)
