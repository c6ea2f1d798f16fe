"""Every queue method on valid input, on both twins and both block layouts."""

from __future__ import annotations

import gc
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.blocks import BLOCK_CLASSES, SubBlock
from support.fuzz_common import outcome
from support.helpers import check_queue, raises_said, snapshot
from support.twins import both


@pytest.fixture(params=BLOCK_CLASSES, ids=lambda cls: cls.__name__)
def block_cls(request: pytest.FixtureRequest) -> type[Any]:
    cls: type[Any] = request.param
    return cls


def make(queue_mod: ModuleType, block_cls: type[Any], n: int) -> tuple[Any, list[Any]]:
    blocks = [block_cls(i) for i in range(n)]
    return queue_mod.FreeKVCacheBlockQueue(blocks), blocks


def test_construction_links_blocks_in_order(queue_mod: ModuleType, block_cls: type[Any]) -> None:
    queue, blocks = make(queue_mod, block_cls, 5)
    check_queue(queue, blocks, blocks)
    assert type(queue.fake_free_list_head) is block_cls
    assert type(queue.fake_free_list_tail) is block_cls
    assert queue.fake_free_list_head is not queue.fake_free_list_tail
    assert queue.block_type is block_cls


def test_empty_queue(queue_mod: ModuleType) -> None:
    queue = queue_mod.FreeKVCacheBlockQueue([])
    check_queue(queue, [], [])
    assert queue.block_type is KVCacheBlock
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.get_all_free_blocks() == []
    assert list(queue.iter_blocks_after(None)) == []


def test_block_type_keyword_for_an_empty_queue(queue_mod: ModuleType, block_cls: type[Any]) -> None:
    queue = queue_mod.FreeKVCacheBlockQueue([], block_type=block_cls)
    assert type(queue.fake_free_list_head) is block_cls
    block = block_cls(7)
    queue.append(block)
    check_queue(queue, [block], [block])


def test_construction_from_any_iterable(queue_mod: ModuleType) -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = queue_mod.FreeKVCacheBlockQueue(b for b in blocks)
    check_queue(queue, blocks, blocks)
    blocks2 = tuple(KVCacheBlock(i) for i in range(3))
    check_queue(queue_mod.FreeKVCacheBlockQueue(blocks2), list(blocks2), blocks2)


def test_popleft(queue_mod: ModuleType, block_cls: type[Any]) -> None:
    queue, blocks = make(queue_mod, block_cls, 3)
    assert queue.popleft() is blocks[0]
    check_queue(queue, blocks[1:], blocks)
    assert queue.popleft() is blocks[1]
    assert queue.popleft() is blocks[2]
    check_queue(queue, [], blocks)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 8])
def test_popleft_n(queue_mod: ModuleType, block_cls: type[Any], n: int) -> None:
    queue, blocks = make(queue_mod, block_cls, 8)
    popped = queue.popleft_n(n)
    assert type(popped) is list
    assert len(popped) == n
    assert all(a is b for a, b in zip(popped, blocks[:n], strict=True))
    check_queue(queue, blocks[n:], blocks)


def test_popleft_n_accepts_index_objects(queue_mod: ModuleType) -> None:
    class Two:
        def __index__(self) -> int:
            return 2

    queue, blocks = make(queue_mod, KVCacheBlock, 4)
    assert [b.block_id for b in queue.popleft_n(Two())] == [0, 1]
    assert [b.block_id for b in queue.popleft_n(True)] == [2]
    check_queue(queue, blocks[3:], blocks)


def test_popleft_n_zero_on_an_empty_queue(queue_mod: ModuleType) -> None:
    queue = queue_mod.FreeKVCacheBlockQueue([])
    assert queue.popleft_n(0) == []


@pytest.mark.parametrize("index", [0, 2, 4])
def test_remove(queue_mod: ModuleType, block_cls: type[Any], index: int) -> None:
    queue, blocks = make(queue_mod, block_cls, 5)
    queue.remove(blocks[index])
    check_queue(queue, blocks[:index] + blocks[index + 1 :], blocks)


def test_remove_every_block(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 4)
    for block in (blocks[2], blocks[0], blocks[3], blocks[1]):
        queue.remove(block)
    check_queue(queue, [], blocks)
    queue.append(blocks[1])
    check_queue(queue, [blocks[1]], blocks)


def test_append(queue_mod: ModuleType, block_cls: type[Any]) -> None:
    queue, blocks = make(queue_mod, block_cls, 3)
    first = queue.popleft()
    queue.append(first)
    check_queue(queue, [blocks[1], blocks[2], first], blocks)


def test_append_to_an_empty_queue(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 1)
    block = queue.popleft()
    queue.append(block)
    check_queue(queue, blocks, blocks)


def test_append_n_and_prepend_n(queue_mod: ModuleType, block_cls: type[Any]) -> None:
    queue, blocks = make(queue_mod, block_cls, 6)
    a = queue.popleft_n(2)
    b = queue.popleft_n(2)
    queue.append_n(a)
    check_queue(queue, [*blocks[4:], *a], blocks)
    queue.prepend_n(b)
    check_queue(queue, [*b, *blocks[4:], *a], blocks)


def test_batches_on_an_empty_queue(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 4)
    taken = queue.popleft_n(4)
    queue.prepend_n(taken[:2])
    check_queue(queue, taken[:2], blocks)
    queue.popleft_n(2)
    queue.append_n(taken[2:])
    check_queue(queue, taken[2:], blocks)


def test_batches_accept_tuples_and_iterables(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 6)
    taken = queue.popleft_n(6)
    queue.append_n(tuple(taken[:2]))
    queue.prepend_n(b for b in taken[2:4])
    queue.append_n(iter(taken[4:]))
    check_queue(queue, [*taken[2:4], *taken[:2], *taken[4:]], blocks)


def test_empty_batches_are_no_ops(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 2)
    queue.append_n([])
    queue.prepend_n(())
    check_queue(queue, blocks, blocks)


def test_iter_blocks_after(queue_mod: ModuleType, block_cls: type[Any]) -> None:
    queue, blocks = make(queue_mod, block_cls, 5)
    assert all(a is b for a, b in zip(queue.iter_blocks_after(None), blocks, strict=True))
    after = list(queue.iter_blocks_after(blocks[2]))
    assert [b.block_id for b in after] == [3, 4]
    assert list(queue.iter_blocks_after(blocks[4])) == []


def test_iter_blocks_after_is_lazy(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 5)
    it = queue.iter_blocks_after(None)
    # Nothing is read until the first next(): the popleft is seen.
    queue.popleft()
    assert next(it) is blocks[1]
    queue.remove(blocks[2])
    assert next(it) is blocks[3]
    queue.append(blocks[2])
    assert [b.block_id for b in it] == [4, 2]
    queue.append(queue.popleft())
    assert list(it) == []


def test_iter_cursor_stops_when_its_block_leaves(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 4)
    it = queue.iter_blocks_after(None)
    assert next(it) is blocks[0]
    queue.remove(blocks[0])
    # vLLM's generator reads the detached block's next link (None) and stops.
    assert list(it) == []
    check_queue(queue, blocks[1:], blocks)


def test_iter_and_len(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 3)
    assert len(queue) == 3
    assert all(a is b for a, b in zip(iter(queue), blocks, strict=True))
    queue.popleft()
    assert len(queue) == 2
    assert isinstance(iter(queue), Iterator)


def test_repr(queue_mod: ModuleType) -> None:
    queue, _ = make(queue_mod, KVCacheBlock, 3)
    assert repr(queue) == "<FreeKVCacheBlockQueue num_free_blocks=3 block_type=KVCacheBlock>"


def test_state_attributes_are_read_only(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 2)
    for name in ("fake_free_list_head", "fake_free_list_tail", "block_type", "on_misuse"):
        with pytest.raises(AttributeError):
            setattr(queue, name, None)
    with pytest.raises(AttributeError):
        queue.other = 1
    check_queue(queue, blocks, blocks)


def test_assigned_count_moves_with_the_queue(queue_mod: ModuleType) -> None:
    # vLLM's own tests fake a full cache this way, then restore the count.
    queue, blocks = make(queue_mod, KVCacheBlock, 4)
    queue.num_free_blocks = 0
    assert queue.num_free_blocks == 0
    queue.append_n([queue.popleft()])
    assert queue.num_free_blocks == 0
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2, 3, 0]
    with raises_said(AssertionError, r"popleft_n\(1\) asked for more"):
        queue.popleft_n(1)
    queue.num_free_blocks = 4
    check_queue(queue, blocks[1:] + blocks[:1], blocks)
    queue.popleft_n(4)
    queue.num_free_blocks = 0
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()


@pytest.mark.parametrize("count", [2, 5])
def test_an_empty_list_with_a_count_is_out_of_sync_for_both_pops(
    queue_mod: ModuleType, count: int
) -> None:
    # vLLM's popleft() asserts num_free_blocks == 0 before its ValueError, and
    # its popleft_n() asserts on the list: the same AssertionError from both.
    queue = queue_mod.FreeKVCacheBlockQueue([])
    queue.num_free_blocks = count
    message = rf"^num_free_blocks \({count}\) is out of sync with the free list\.$"
    with pytest.raises(AssertionError, match=message):
        queue.popleft()
    with pytest.raises(AssertionError, match=message):
        queue.popleft_n(1)
    assert queue.num_free_blocks == count
    queue.num_free_blocks = 0
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()


@pytest.mark.parametrize(
    ("value", "exc", "message"),
    [
        (None, TypeError, "num_free_blocks must be an integer, not NoneType"),
        (1.0, TypeError, "num_free_blocks must be an integer, not float"),
        (-1, ValueError, "num_free_blocks must be from 0 to sys.maxsize, not -1"),
        (2**80, ValueError, f"num_free_blocks must be from 0 to sys.maxsize, not {2**80}"),
    ],
)
def test_bad_count_assignment_changes_nothing(
    queue_mod: ModuleType, value: object, exc: type[Exception], message: str
) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 2)
    with pytest.raises(exc) as info:
        queue.num_free_blocks = value
    assert str(info.value) == message
    with pytest.raises(AttributeError, match="num_free_blocks cannot be deleted"):
        del queue.num_free_blocks
    check_queue(queue, blocks, blocks)


def test_queue_is_not_subclassable(queue_mod: ModuleType) -> None:
    with pytest.raises(TypeError):
        type("Sub", (queue_mod.FreeKVCacheBlockQueue,), {})


def test_subclass_blocks_mix_with_their_base(queue_mod: ModuleType) -> None:
    plain = [KVCacheBlock(0), KVCacheBlock(1)]
    queue = queue_mod.FreeKVCacheBlockQueue(plain)
    sub = SubBlock(2)
    queue.append(sub)
    queue.append_n([SubBlock(3)])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3]
    queue.remove(sub)
    assert [b.block_id for b in queue] == [0, 1, 3]


class _Impostor:
    """Not a block, though it has the links and the pool a bound queue reads."""

    def __init__(self, pool: object) -> None:
        self.pool = pool
        self.prev_free_block = self.next_free_block = None


@pytest.mark.parametrize("method", ["append_n", "prepend_n"])
@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_a_batch_with_a_subclass_block_still_refuses_a_non_block(
    queue_mod: ModuleType, method: str, bound: bool
) -> None:
    # A subclass's block sends the batch through a pass of its own: it too checks classes.
    pool = object() if bound else None
    blocks = [KVCacheBlock(i, pool=pool) for i in range(3)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    sub, impostor = SubBlock(3, pool=pool), _Impostor(pool)
    before = snapshot(queue, [*blocks, sub])
    with raises_said(TypeError, "_Impostor"):
        getattr(queue, method)([sub, impostor])
    assert snapshot(queue, [*blocks, sub]) == before
    assert impostor.prev_free_block is impostor.next_free_block is None


def test_queue_of_subclass_rejects_base_blocks(queue_mod: ModuleType) -> None:
    queue = queue_mod.FreeKVCacheBlockQueue([SubBlock(0)])
    assert queue.block_type is SubBlock
    with pytest.raises(TypeError):
        queue.append(KVCacheBlock(1))


def test_queue_and_blocks_are_collected(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 10)
    refs = [weakref.ref(queue), weakref.ref(blocks[0]), weakref.ref(queue.fake_free_list_head)]
    del queue, blocks
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_a_long_queue_is_freed_without_recursion(queue_mod: ModuleType) -> None:
    # Freeing a long chain must not recurse once per block in C.
    queue = queue_mod.FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(200_000)])
    assert len(queue) == 200_000
    del queue
    gc.collect()


def test_a_queue_cannot_be_initialized_twice(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 3)
    with pytest.raises(RuntimeError, match="the queue is already initialized"):
        queue.__init__([KVCacheBlock(9)])
    check_queue(queue, blocks, blocks)


def test_an_assigned_count_moves_past_sys_maxsize_without_wrapping(queue_mod: ModuleType) -> None:
    queue, _ = make(queue_mod, KVCacheBlock, 4)
    queue.num_free_blocks = sys.maxsize
    queue.append(queue.popleft())
    queue.append_n(queue.popleft_n(2))
    assert queue.num_free_blocks == sys.maxsize
    extra = KVCacheBlock(9)
    queue.append(extra)
    assert queue.num_free_blocks == sys.maxsize + 1
    with pytest.raises(OverflowError, match="cannot fit 'int' into an index-sized integer"):
        len(queue)
    assert [b.block_id for b in queue.popleft_n(3)] == [3, 0, 1]
    assert queue.num_free_blocks == sys.maxsize - 2
    assert repr(queue).startswith(f"<FreeKVCacheBlockQueue num_free_blocks={sys.maxsize - 2} ")
    assert len(queue.get_all_free_blocks()) == 2


@pytest.mark.parametrize("count", [10**9, 10**10, sys.maxsize])
def test_popleft_n_beyond_the_true_length_fails_at_once(queue_mod: ModuleType, count: int) -> None:
    # Sized from the list, never from an assigned count: no stall, no MemoryError.
    queue, blocks = make(queue_mod, KVCacheBlock, 3)
    queue.num_free_blocks = count
    started = time.perf_counter()
    with pytest.raises(AssertionError, match=rf"^num_free_blocks \({count}\) is out of sync"):
        queue.popleft_n(count)
    assert time.perf_counter() - started < 0.5
    assert queue.num_free_blocks == count
    queue.num_free_blocks = 3
    check_queue(queue, blocks, blocks)


# -- num_free_blocks assignment -----------------------------------------------------


def _assigned_count_story(mod: ModuleType) -> list[object]:
    """What a queue reports after ``num_free_blocks`` is assigned and then moved by every call."""
    queue, blocks = make(mod, KVCacheBlock, 6)
    seen: list[object] = []

    def note(call: Callable[[], object]) -> None:
        seen.append((outcome(call), queue.num_free_blocks, len(queue)))

    note(lambda: setattr(queue, "num_free_blocks", 100))
    note(queue.popleft)
    note(lambda: queue.popleft_n(2))
    note(lambda: queue.append(blocks[0]))
    note(lambda: queue.append_n(blocks[1:3]))
    note(lambda: queue.remove(blocks[5]))
    note(lambda: queue.prepend_n([blocks[5]]))
    note(lambda: queue.popleft_n(0))
    note(lambda: queue.popleft_n(7))  # beyond the 6 real blocks
    note(queue.get_all_free_blocks)
    for value in (0, -3, 2**70, True, 3, "3", 1.5, None, [1]):
        note(partial(setattr, queue, "num_free_blocks", value))
    note(lambda: delattr(queue, "num_free_blocks"))
    note(lambda: queue.popleft_n(6))
    note(queue.popleft)
    note(lambda: queue.append_n(blocks))
    return seen


def test_num_free_blocks_can_be_assigned_and_later_calls_move_it(queue_mod: ModuleType) -> None:
    queue, blocks = make(queue_mod, KVCacheBlock, 6)
    queue.num_free_blocks = 100
    assert queue.num_free_blocks == 100
    popped = queue.popleft()
    assert queue.num_free_blocks == 99
    popped_n = queue.popleft_n(2)
    assert queue.num_free_blocks == 97
    queue.append_n([*popped_n, popped])
    assert queue.num_free_blocks == 100
    queue.remove(blocks[4])
    assert queue.num_free_blocks == 99
    queue.prepend_n([blocks[4]])
    assert queue.num_free_blocks == 100
    # The queue's own checks still know the 6 real blocks.
    assert queue.get_all_free_blocks() == [blocks[4], blocks[3], blocks[5], *blocks[1:3], blocks[0]]
    before = snapshot(queue, blocks)
    with pytest.raises(AssertionError):
        queue.popleft_n(7)
    assert snapshot(queue, blocks) == before


@pytest.mark.parametrize("bad", ["3", 1.5, None, [1]], ids=repr)
def test_num_free_blocks_refuses_a_non_integer(queue_mod: ModuleType, bad: object) -> None:
    queue, _ = make(queue_mod, KVCacheBlock, 3)
    with pytest.raises(TypeError):
        queue.num_free_blocks = bad
    assert queue.num_free_blocks == 3


@pytest.mark.cython
def test_both_twins_treat_an_assigned_count_the_same() -> None:
    compiled, pure = both()
    assert _assigned_count_story(compiled) == _assigned_count_story(pure)
