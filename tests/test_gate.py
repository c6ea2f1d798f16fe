"""A queue's gate: what admits blocks to the free list, both twins."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.helpers import check_queue, link, raises_said

LINKING = ("append", "append_n", "prepend_n")


def made(queue_mod: ModuleType, n: int) -> tuple[Any, list[Any]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return queue_mod.FreeKVCacheBlockQueue(blocks[:2]), blocks


def test_no_gate_by_default(queue_mod: ModuleType) -> None:
    queue, _ = made(queue_mod, 2)
    assert queue.gate is None


@pytest.mark.parametrize("method", LINKING)
def test_the_gate_sees_each_batch_before_it_is_linked(queue_mod: ModuleType, method: str) -> None:
    queue, blocks = made(queue_mod, 4)
    seen: list[tuple[str, list[int], int]] = []

    def gate(name: str, batch: Any) -> Any:
        seen.append((name, [b.block_id for b in batch], len(queue.get_all_free_blocks())))
        return batch

    queue.gate = gate
    link(queue, method, blocks[2:])
    expected = (
        [("append", [2], 2), ("append", [3], 3)] if method == "append" else [(method, [2, 3], 2)]
    )
    assert seen == expected
    order = blocks[2:] + blocks[:2] if method == "prepend_n" else blocks
    check_queue(queue, order, order)


@pytest.mark.parametrize("method", ["append_n", "prepend_n"])
def test_a_batch_method_links_what_the_gate_returns(queue_mod: ModuleType, method: str) -> None:
    queue, blocks = made(queue_mod, 5)
    queue.gate = lambda name, batch: [b for b in batch if b.block_id != 3]
    getattr(queue, method)(iter(blocks[2:]))
    kept = [blocks[2], blocks[4]]
    order = kept + blocks[:2] if method == "prepend_n" else blocks[:2] + kept
    check_queue(queue, order, order)
    assert blocks[3].prev_free_block is None
    assert blocks[3].next_free_block is None


@pytest.mark.parametrize("method", LINKING)
def test_a_gate_that_admits_nothing_links_nothing(queue_mod: ModuleType, method: str) -> None:
    queue, blocks = made(queue_mod, 3)
    queue.gate = lambda name, batch: []
    link(queue, method, blocks[2:])
    check_queue(queue, blocks[:2], blocks[:2])
    assert queue.num_free_blocks == 2


@pytest.mark.parametrize("method", LINKING)
def test_what_the_gate_raises_leaves_the_queue_as_it_was(
    queue_mod: ModuleType, method: str
) -> None:
    queue, blocks = made(queue_mod, 4)

    def gate(name: str, batch: Any) -> Any:
        raise LookupError(name)

    queue.gate = gate
    with pytest.raises(LookupError, match=method):
        link(queue, method, blocks[2:])
    check_queue(queue, blocks[:2], blocks[:2])


@pytest.mark.parametrize("method", LINKING)
def test_a_gate_may_use_the_queue(queue_mod: ModuleType, method: str) -> None:
    """It runs before the queue reads its list: what it does there is seen whole."""
    queue, blocks = made(queue_mod, 4)

    def gate(name: str, batch: Any) -> Any:
        queue.gate = None
        queue.remove(blocks[0])
        queue.append(blocks[0])
        return batch

    queue.gate = gate
    link(queue, method, blocks[2:])
    moved = [blocks[1], blocks[0]]
    order = blocks[2:] + moved if method == "prepend_n" else moved + blocks[2:]
    check_queue(queue, order, order)


def test_the_queue_checks_what_the_gate_returns(queue_mod: ModuleType) -> None:
    queue, blocks = made(queue_mod, 3)
    queue.gate = lambda name, batch: [blocks[0]]  # linked already
    with raises_said(ValueError, "linked"):
        queue.append_n([blocks[2]])
    queue.gate = lambda name, batch: 7
    with pytest.raises(TypeError):
        queue.prepend_n([blocks[2]])
    check_queue(queue, blocks[:2], blocks[:2])


@pytest.mark.parametrize("value", [3, "gate", object()])
def test_a_gate_is_a_callable_or_none(queue_mod: ModuleType, value: object) -> None:
    queue, _ = made(queue_mod, 2)
    queue.gate = len
    with pytest.raises(TypeError, match="gate"):
        queue.gate = value
    assert queue.gate is len
    queue.gate = None
    assert queue.gate is None
