"""No leaks, on both twins.

Long allocate/free runs and many 10,000-block queues built and dropped must
leave flat: ``sys.getrefcount(KVCacheBlock)`` (every live instance holds one
reference to its class, so a leaked block shows), ``len(gc.get_objects())``
and tracemalloc's traced total. Queues and blocks that only reference each
other must be collected by ``gc.collect()``, checked with weakrefs.

Default sizes keep the file to a few seconds; ``KVQUEUE_CI_FUZZ_LONG=1`` runs the
issue's full sizes (a million cycles, a thousand queues) on both twins.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import tracemalloc
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support import twins
from support.blocks import SubBlock, VllmStyleBlock

LONG = os.environ.get("KVQUEUE_CI_FUZZ_LONG", "") not in ("", "0")

# The allocator's free lists and caches warmed up before the baseline, the
# counts come back exactly; a few objects of slack (gc.get_objects) and 32 KiB
# (tracemalloc) cover interpreter caches filled on first use. A leak of one
# object per cycle, or of one pointer per cycle in the traced run (8 B x 20,000
# cycles = 160 KiB), is far outside them.
OBJECTS_SLACK = 10
TRACED_SLACK = 32 * 1024


def _cycles(twin: str, traced: bool) -> int:
    if LONG:
        return 1_000_000
    if traced:  # tracemalloc makes each allocation several times slower
        return 100_000 if twin == "cython" else 20_000
    return 1_000_000 if twin == "cython" else 200_000


def _expect_failure(call: Callable[[], object]) -> None:
    try:
        call()
    except (AssertionError, ValueError, RuntimeError, TypeError):
        return
    raise AssertionError("the call should have failed")


def _allocate_free(queue: Any, blocks: list[Any], cycles: int) -> None:
    """What a block pool does: allocate (pop) blocks, free (link) them back,
    take cached blocks out of the middle; with a failing call now and then."""
    for i in range(cycles):
        taken = queue.popleft_n(i % 7 + 1)
        if i % 5 == 0:
            queue.prepend_n(taken)
        else:
            queue.append_n(taken)
        if i % 11 == 0:
            block = blocks[i % len(blocks)]
            queue.remove(block)
            queue.append(block)
        if i % 1009 == 0:
            cursor = queue.iter_blocks_after(None)
            next(cursor)
            queue.get_all_free_blocks()
            _expect_failure(lambda: queue.popleft_n(len(queue) + 1))
            _expect_failure(lambda: queue.append_n([blocks[1], blocks[2]]))
            popped = queue.popleft()
            # Fails on the second block, after linking the first: rolled back.
            _expect_failure(partial(queue.append_n, [popped, "not a block"]))
            queue.append(popped)


def _collect() -> None:
    # Garbage whose finalizers touched it (a generator closed, a fixture's finally) is kept by
    # the collection that ran them and freed by the next: collect until one frees nothing,
    # or an earlier test's pool would count as freed by the cycles measured.
    for _ in range(8):
        if not gc.collect():
            return


def _measure() -> tuple[int, int, int]:
    _collect()
    traced = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0
    return sys.getrefcount(KVCacheBlock), len(gc.get_objects()), traced


def _assert_flat(before: tuple[int, int, int], after: tuple[int, int, int]) -> None:
    refs, objects, traced = (a - b for a, b in zip(after, before, strict=True))
    assert refs == 0, f"KVCacheBlock refcount moved by {refs}"
    assert abs(objects) <= OBJECTS_SLACK, f"gc.get_objects() moved by {objects}"
    assert abs(traced) <= TRACED_SLACK, f"tracemalloc total moved by {traced} B"


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def _run_cycles(queue_mod: ModuleType, cycles: int) -> None:
    blocks = [KVCacheBlock(i) for i in range(64)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    _allocate_free(queue, blocks, 2000)  # warm up caches and free lists
    before = _measure()
    _allocate_free(queue, blocks, cycles)
    after = _measure()
    _assert_flat(before, after)
    assert sorted(b.block_id for b in queue.get_all_free_blocks()) == list(range(64))


def test_allocate_free_cycles_leave_counts_flat(queue_mod: ModuleType) -> None:
    _run_cycles(queue_mod, _cycles(twins.of(queue_mod).name, traced=False))


@pytest.mark.usefixtures("traced")
def test_allocate_free_cycles_leave_traced_memory_flat(queue_mod: ModuleType) -> None:
    _run_cycles(queue_mod, _cycles(twins.of(queue_mod).name, traced=True))


class _Formatted(logging.Handler):
    """Formats each repair record (its block's repr included) and drops it."""

    def emit(self, record: logging.LogRecord) -> None:
        self.format(record)


@pytest.fixture
def repair_records_dropped() -> Iterator[None]:
    # Not propagated: the test run's log capture would keep every record.
    logger = logging.getLogger("kvqueue")
    handler = _Formatted()
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def _repair(queue: Any, stranger: Any, cycles: int) -> None:
    """An engine's double-free bug in a hot loop, under "repair": a repair of
    every kind, five a cycle (the log is rate-limited; the counters are not)."""
    head = queue.fake_free_list_head
    for _ in range(cycles):
        freed = queue.popleft()
        queue.remove(freed)  # not linked
        queue.append_n([freed, freed])  # a duplicate
        queue.append(freed)  # a double free
        queue.prepend_n([head])  # a sentinel
        queue.remove(stranger)  # another pool's block


def _run_repairs(queue_mod: ModuleType, cycles: int) -> None:
    pool = object()
    blocks = [KVCacheBlock(i, pool=pool) for i in range(64)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse="repair")
    stranger = KVCacheBlock(99, pool=object())
    _repair(queue, stranger, 2000)  # warm up
    before = _measure()
    _repair(queue, stranger, cycles)
    _assert_flat(before, _measure())
    assert set(queue.repairs.values()) == {2000 + cycles}
    assert sorted(b.block_id for b in queue.get_all_free_blocks()) == list(range(64))


@pytest.mark.usefixtures("repair_records_dropped")
def test_repairs_leave_counts_flat(queue_mod: ModuleType) -> None:
    _run_repairs(queue_mod, 200_000 if LONG else 20_000)  # 100,000 repairs


@pytest.mark.usefixtures("repair_records_dropped", "traced")
def test_repairs_leave_traced_memory_flat(queue_mod: ModuleType) -> None:
    _run_repairs(queue_mod, 200_000 if LONG else 5_000)


def _build_and_drop(queue_mod: ModuleType, count: int) -> None:
    for i in range(count):
        blocks = [KVCacheBlock(j) for j in range(10_000)]
        queue = queue_mod.FreeKVCacheBlockQueue(blocks)
        taken = queue.popleft_n(100 + i % 50)
        queue.remove(blocks[5000])
        queue.append_n(taken)
        next(queue.iter_blocks_after(blocks[7000]))
        # Dropped with every block still linked: the links are reference
        # cycles, left to the collector.
        del blocks, queue, taken


@pytest.mark.usefixtures("traced")
def test_queues_built_and_dropped_leave_everything_flat(queue_mod: ModuleType) -> None:
    _build_and_drop(queue_mod, 2)
    before = _measure()
    _build_and_drop(queue_mod, 1000 if LONG else 15)
    _assert_flat(before, _measure())


# -- cycles the collector must break ---------------------------------------------


def _dead(refs: list[weakref.ref[Any]]) -> bool:
    # A finalizer may link a new block to the dying ones (resurrecting them
    # for one round): collect until nothing more is found.
    while gc.collect():
        pass
    return all(ref() is None for ref in refs)


def _instances(cls: type) -> int:
    return sum(type(obj) is cls for obj in gc.get_objects())


@pytest.mark.parametrize("block_class", [KVCacheBlock, VllmStyleBlock, SubBlock])
def test_queue_and_blocks_pointing_at_each_other_are_collected(
    queue_mod: ModuleType, block_class: type
) -> None:
    # vLLM's slotted dataclass has no __weakref__ slot: its instances are counted.
    gc.collect()
    before = _instances(block_class)
    blocks = [block_class(block_id=i) for i in range(10)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    queue.popleft_n(3)  # some blocks linked, some not, all pointing at the queue
    for block in blocks:
        block.pool = queue
    refs = [weakref.ref(queue)]
    del blocks, queue, block
    assert _dead(refs)
    assert _instances(block_class) == before


def test_a_cursor_in_a_cycle_is_collected(queue_mod: ModuleType) -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    cursor = queue.iter_blocks_after(blocks[1])
    next(cursor)
    blocks[2].pool = cursor  # block -> cursor -> queue -> sentinels -> blocks
    refs = [weakref.ref(queue), *(weakref.ref(b) for b in blocks)]
    del blocks, queue, cursor
    assert _dead(refs)


def test_a_queue_dropped_while_its_blocks_live_is_freed_at_once(queue_mod: ModuleType) -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    ref = weakref.ref(queue)
    del queue  # nothing points back at the queue: no collection needed
    assert ref() is None
    assert blocks[0].prev_free_block is not None  # still linked to the old sentinels


class _Calling(KVCacheBlock):
    """A block whose finalizer calls into its queue while the collector runs."""

    __slots__ = ("calls",)

    def __del__(self) -> None:
        queue = self.pool
        if queue is not None:
            queue.get_all_free_blocks()
            queue.append_n([_Calling(-2)])
            queue.popleft()
            self.calls = len(queue)


def test_finalizers_that_call_the_dying_queue_still_let_it_be_collected(
    queue_mod: ModuleType,
) -> None:
    blocks = [_Calling(i) for i in range(6)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    for block in blocks:
        block.pool = queue
    refs = [weakref.ref(queue), *(weakref.ref(b) for b in blocks)]
    del blocks, queue, block
    assert _dead(refs)
