"""Python code a queue method runs (a block's ``__repr__``, an ``__index__``, a
generator, a logging handler, a finalizer) can neither change state the method
already read nor make a repair raise; a message never runs a block's code.

The block constructor that re-enters ``__init__`` is a hostile case
(hostile_cases.constructor_reenters_init): it crashed the compiled twin.
"""

from __future__ import annotations

import gc
import itertools
import logging
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.blocks import VllmStyleBlock
from support.fuzz_common import well_formed
from support.helpers import check_queue, raises_said, snapshot

POLICIES = ("raise", "repair")


class RaisingRepr(KVCacheBlock):
    __slots__ = ()

    def __repr__(self) -> str:
        raise KeyError("repr")


def _misuses(queue: Any, linked: Any, other: Any) -> list[tuple[str, Any]]:
    return [
        ("append", lambda: queue.append(linked)),
        ("append_n", lambda: queue.append_n([linked])),
        ("prepend_n", lambda: queue.prepend_n([linked, linked])),
        ("remove", lambda: queue.remove(other)),
    ]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_long_walking_repr_is_never_called(
    queue_mod: ModuleType, policy: str, repair_log: pytest.LogCaptureFixture
) -> None:
    pool, other_pool = object(), object()
    blocks = [VllmStyleBlock(i, pool=pool) for i in range(5_000)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse=policy)
    other = VllmStyleBlock(-7, pool=other_pool)
    for method, call in _misuses(queue, blocks[2_500], other):
        before = snapshot(queue, blocks)
        if policy == "raise":
            with pytest.raises((ValueError, RuntimeError)) as info:
                call()
            assert str(info.value).endswith(("VllmStyleBlock(block_id=2500)", "(block_id=-7)"))
        else:
            call()
        assert snapshot(queue, blocks) == before, method
    if policy == "repair":
        assert sum(queue.repairs.values()) == 5
        assert all("VllmStyleBlock(block_id=" in r.getMessage() for r in repair_log.records)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_raising_repr_is_never_called(
    queue_mod: ModuleType, policy: str, repair_log: pytest.LogCaptureFixture
) -> None:
    pool = object()
    blocks = [RaisingRepr(i, pool=pool) for i in range(4)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse=policy)
    other = RaisingRepr(9, pool=object())
    for method, call in _misuses(queue, blocks[1], other):
        if policy == "raise":
            with raises_said((ValueError, RuntimeError), r"RaisingRepr\(block_id="):
                call()
        else:
            call()
        check_queue(queue, blocks, [*blocks, other])
        del method
    assert sum(queue.repairs.values()) == (5 if policy == "repair" else 0)


def test_a_non_block_is_named_without_its_repr(queue_mod: ModuleType) -> None:
    class Hostile:
        def __repr__(self) -> str:
            raise KeyError("repr")

    queue = queue_mod.FreeKVCacheBlockQueue([KVCacheBlock(0)])
    with raises_said(TypeError, r"^append\(\): expected a KVCacheBlock, got .*Hostile"):
        queue.append(Hostile())
    with raises_said(TypeError, "got int an integer of 20001 bits"):
        queue.remove(1 << 20_000)


def test_a_huge_popleft_n_argument_is_named_in_bounds(queue_mod: ModuleType) -> None:
    queue = queue_mod.FreeKVCacheBlockQueue([KVCacheBlock(0)])
    with raises_said(AssertionError, "popleft_n\\(an integer of 20001 bits\\)"):
        queue.popleft_n(1 << 20_000)


class _Mutating:
    """An ``__index__`` that changes the queue before it answers."""

    def __init__(self, queue: Any, value: int) -> None:
        self.queue, self.value = queue, value

    def __index__(self) -> int:
        self.queue.append(self.queue.popleft())
        self.queue.append(KVCacheBlock(100 + self.value))
        return self.value


def test_an_index_that_mutates_the_queue_runs_before_popleft_n_reads_it(
    queue_mod: ModuleType,
) -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    taken = queue.popleft_n(_Mutating(queue, 3))
    assert [b.block_id for b in taken] == [1, 2, 0]
    assert [b.block_id for b in queue.get_all_free_blocks()] == [103]
    assert well_formed(queue) is None


def test_an_index_that_mutates_the_queue_runs_before_the_count_is_assigned(
    queue_mod: ModuleType,
) -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    queue.num_free_blocks = _Mutating(queue, 0)
    assert queue.num_free_blocks == 0
    queue.num_free_blocks = 4  # the true length: the assignment kept them in step
    assert well_formed(queue) is None
    assert len(queue.get_all_free_blocks()) == 4


@pytest.mark.parametrize("method", ["append_n", "prepend_n"])
def test_a_generator_that_mutates_the_queue_is_consumed_first(
    queue_mod: ModuleType, method: str
) -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks[:2])

    def batch() -> Iterator[Any]:
        yield blocks[2]
        queue.append(blocks[3])
        queue.popleft()
        yield blocks[0]  # popped just above: free again

    getattr(queue, method)(batch())
    assert well_formed(queue) is None
    assert sorted(b.block_id for b in queue.get_all_free_blocks()) == [0, 1, 2, 3]


def test_a_logging_handler_that_calls_the_queue_sees_it_whole(
    queue_mod: ModuleType, repair_log: pytest.LogCaptureFixture
) -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse="repair")
    seen: list[str | None] = []

    class Reentering(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(well_formed(queue))
            queue.append(queue.popleft())

    handler = Reentering()
    logging.getLogger("kvqueue").addHandler(handler)
    try:
        freed = queue.popleft_n(2)
        queue.append_n([freed[0], blocks[4], freed[0], freed[1]])
        queue.remove(freed[0])
        queue.append(blocks[5])
    finally:
        logging.getLogger("kvqueue").removeHandler(handler)
    assert seen == [None] * 3  # the linked block 4, the duplicate, the linked block 5
    assert well_formed(queue) is None
    assert sorted(b.block_id for b in queue.get_all_free_blocks()) == [1, 2, 3, 4, 5]


class _FreeOnCollect:
    """Cyclic garbage whose finalizer frees ``block`` into ``queue``."""

    def __init__(self, queue: Any, block: Any) -> None:
        self.queue, self.block, self.me = queue, block, self

    def __del__(self) -> None:
        if self.block.prev_free_block is None:
            self.queue.append(self.block)


def _free_at_collection(
    number: int, queue: Any, block: Any
) -> tuple[Callable[[str, dict[str, int]], None], list[int]]:
    """A gc callback that makes ``block`` free itself into ``queue`` at the
    ``number``-th collection outside a pure link pass; and its count of those."""
    collections = [0]

    def countdown(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and not _in_link_pass():
            collections[0] += 1
            if collections[0] == number:
                _FreeOnCollect(queue, block)

    return countdown, collections


class _Allocation:
    """A fresh object the collector counts."""


def _in_link_pass() -> bool:
    """Whether the pure twin's innermost running method is a link pass."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith("_queue_py.py"):
            return frame.f_code.co_name in ("_link", "_undo")
        frame = frame.f_back  # type: ignore[assignment]
    return False


@pytest.mark.parametrize("method", ["append_n", "prepend_n"])
def test_a_finalizer_freeing_a_block_of_a_repaired_batch_makes_no_error(
    queue_mod: ModuleType, method: str, repair_log: pytest.LogCaptureFixture
) -> None:
    """A collection between the repair's screening and its linking frees one of
    the blocks it screened as free: the repair screens again, and never raises
    for the misuse it repairs. Tried at every collection of the call, but, for
    the pure twin, those inside a link pass (between two of whose bytecodes a
    collection can re-enter the pure twin, as it can vLLM's queue)."""
    threshold = gc.get_threshold()
    # A collection starts at every other allocation: shift by one for the rest.
    for shift in (0, 1):
        for collect_after in itertools.count(1):
            blocks = [KVCacheBlock(i) for i in range(6)]
            queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse="repair")
            x, y = queue.popleft_n(2)
            call = getattr(queue, method)
            batch = [x, y, y]
            countdown, collections = _free_at_collection(collect_after, queue, y)
            gc.collect()
            gc.callbacks.append(countdown)
            gc.set_threshold(1)
            try:
                if shift:
                    _Allocation()
                call(batch)
            finally:
                gc.set_threshold(*threshold)
                gc.callbacks.remove(countdown)
            gc.collect()
            assert well_formed(queue) is None
            listed = queue.get_all_free_blocks()
            assert sorted(b.block_id for b in listed) == list(range(6))
            assert queue.num_free_blocks == len(listed) == 6
            if collections[0] < collect_after:
                break  # every collection of the call was tried
