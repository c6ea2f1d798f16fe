"""Which blocks a queue threads: its block class, and subclasses that keep the
class's link and pool slots and its attribute access. Both twins accept exactly
the same blocks, wherever they appear, and refuse the rest with one TypeError."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.helpers import check_queue, one_line, raises_said, snapshot
from support.twins import both


class ShadowsPrev(KVCacheBlock):
    __slots__ = ("prev_free_block",)  # a slot of its own, hiding the base's


class PropertyNext(KVCacheBlock):
    __slots__ = ()

    @property
    def next_free_block(self) -> Any:
        return None

    @next_free_block.setter
    def next_free_block(self, value: Any) -> None:
        pass


class LyingGetattribute(KVCacheBlock):
    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        if name in ("prev_free_block", "next_free_block"):
            return None
        return super().__getattribute__(name)


class PropertyPool(KVCacheBlock):
    __slots__ = ()

    @property
    def pool(self) -> Any:
        return None

    @pool.setter
    def pool(self, value: Any) -> None:
        pass


class Plain(KVCacheBlock):
    __slots__ = ("extra",)


OVERRIDES: dict[type, str] = {
    ShadowsPrev: "prev_free_block",
    PropertyNext: "next_free_block",
    LyingGetattribute: "__getattribute__",
    PropertyPool: "pool",
}

CALLS: dict[str, Callable[[Any, Any], object]] = {
    "append": lambda queue, block: queue.append(block),
    "append_n": lambda queue, block: queue.append_n([KVCacheBlock(50), block]),
    "prepend_n": lambda queue, block: queue.prepend_n([block]),
    "remove": lambda queue, block: queue.remove(block),
    "iter_blocks_after": lambda queue, block: queue.iter_blocks_after(block),
    "constructor": lambda queue, block: type(queue)([KVCacheBlock(60), block]),
}


@pytest.mark.parametrize("policy", ["raise", "repair"])
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("cls", OVERRIDES, ids=lambda cls: cls.__name__)
def test_a_later_block_whose_class_overrides_the_layout_is_refused(
    queue_mod: ModuleType, cls: type, call: str, policy: str
) -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse=policy)
    block = cls(9)
    before = snapshot(queue, blocks)
    with pytest.raises(TypeError) as info:
        CALLS[call](queue, block)
    said = one_line(info.value)
    assert f"expected a KVCacheBlock, got {cls.__qualname__}(block_id=9), whose class " in said
    assert f"redefines {OVERRIDES[cls]} " in said
    assert snapshot(queue, blocks) == before
    check_queue(queue, blocks, blocks)


@pytest.mark.cython
@pytest.mark.parametrize("cls", OVERRIDES, ids=lambda cls: cls.__name__)
def test_both_twins_refuse_a_subclass_in_the_same_words(cls: type) -> None:
    messages = []
    for mod in both():
        queue = mod.FreeKVCacheBlockQueue([KVCacheBlock(0)])
        with pytest.raises(TypeError) as info:
            queue.append(cls(1))
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_a_subclass_that_keeps_the_layout_is_threaded(queue_mod: ModuleType) -> None:
    blocks = [KVCacheBlock(0), Plain(1), KVCacheBlock(2)]
    queue = queue_mod.FreeKVCacheBlockQueue(blocks)
    extra = Plain(3)
    queue.append(extra)
    queue.remove(blocks[1])
    check_queue(queue, [blocks[0], blocks[2], extra], [*blocks, extra])


@pytest.mark.parametrize("cls", [LyingGetattribute], ids=lambda cls: cls.__name__)
def test_a_block_class_that_overrides_attribute_access_is_refused(
    queue_mod: ModuleType, cls: type
) -> None:
    with raises_said(TypeError, "overrides __getattribute__"):
        queue_mod.FreeKVCacheBlockQueue([cls(0)])
    with raises_said(TypeError, "overrides __getattribute__"):
        queue_mod.FreeKVCacheBlockQueue([], block_type=cls)
