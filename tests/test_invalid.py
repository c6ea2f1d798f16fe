"""Invalid operations raise the contract's exception and change nothing."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from kvqueue import KVCacheBlock

from support.invalid_ops import CASES, outcome


@pytest.mark.parametrize("name", list(CASES))
def test_invalid_operation(queue_mod: ModuleType, name: str) -> None:
    expected = CASES[name][1]
    exc_name, message, untouched = outcome(queue_mod, name)
    assert exc_name == expected.exc.__name__, message
    if expected.exact:
        assert message == expected.message
    else:
        assert message.startswith(expected.message)
    assert untouched, "the failing call changed the queue or a block"


NEVER_BUILT_CALLS: dict[str, Callable[[Any, KVCacheBlock], object]] = {
    "popleft": lambda q, b: q.popleft(),
    "popleft_n": lambda q, b: q.popleft_n(1),
    "remove": lambda q, b: q.remove(b),
    "append": lambda q, b: q.append(b),
    "append_n": lambda q, b: q.append_n([b]),
    "prepend_n": lambda q, b: q.prepend_n([b]),
    "get_all_free_blocks": lambda q, b: q.get_all_free_blocks(),
    "iter_blocks_after": lambda q, b: next(q.iter_blocks_after(None)),
    "iter": lambda q, b: next(iter(q)),
    "len": lambda q, b: len(q),
    "num_free_blocks": lambda q, b: q.num_free_blocks,
    "set num_free_blocks": lambda q, b: setattr(q, "num_free_blocks", 1),
    "repairs": lambda q, b: q.repairs,
}


@pytest.mark.parametrize("call", list(NEVER_BUILT_CALLS))
def test_a_queue_made_by_new_alone_refuses_every_call(queue_mod: ModuleType, call: str) -> None:
    # The compiled twin checks; the pure one fails at its first read of an
    # unset slot (the deliberate difference listed atop _queue.pyx). The count
    # is an unset member in both.
    pure = queue_mod.__name__.endswith("_py")
    expected = AttributeError if pure or call == "num_free_blocks" else RuntimeError
    cls = queue_mod.FreeKVCacheBlockQueue
    queue = cls.__new__(cls)
    block = KVCacheBlock(0)
    with pytest.raises(expected):
        NEVER_BUILT_CALLS[call](queue, block)
    assert block.prev_free_block is None
    assert block.next_free_block is None
    assert "block_type=uninitialized" in repr(queue)
    queue.__init__([block])  # building it later gives a working queue
    assert queue.popleft() is block
    assert len(queue) == 0
