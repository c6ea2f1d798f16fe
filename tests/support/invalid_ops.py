"""The invalid-operation contract as data: each case builds a queue, maybe
corrupts it as a careless caller would, and names one call that must fail.

``outcome`` runs a case and reports the exception and whether the queue and
every block were left exactly as they were. It uses no ``assert``, so the same
cases can be run under ``python -O`` (see test_optimize.py). Each case also
says what it does under ``on_misuse="repair"`` (run by test_policy.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any, NamedTuple

from kvqueue import KVCacheBlock

from support.blocks import VllmStyleBlock
from support.helpers import one_line, snapshot

Setup = Callable[[ModuleType], tuple[Any, list[Any], Callable[[], object]]]


class Repair(NamedTuple):
    """What a case does under ``on_misuse="repair"``: it returns normally."""

    call: str  # the call the repair log names
    kinds: dict[str, int]  # how much each count of ``queue.repairs`` grows
    # The free list afterwards of the queue the call acted on (the new one for
    # a constructor), as positions in the case's block list.
    free: tuple[int, ...]


class Expected(NamedTuple):
    exc: type[BaseException]
    message: str
    # False where the message ends in a truncated repr: then it is a prefix.
    exact: bool = True
    # None: no safe repair, so "repair" raises exactly as "raise" does.
    repair: Repair | None = None


def _misuse(message: str, kind: str, left: tuple[int, ...], exc: type = ValueError) -> Expected:
    """A misuse that raises ``exc(message)`` under ``"raise"``; under ``"repair"`` the
    method the message names repairs it once, as ``kind``, and the queue holds ``left``."""
    return Expected(exc, message, repair=Repair(message.split("(")[0], {kind: 1}, left))


def _queue(mod: ModuleType, n: int = 3) -> tuple[Any, list[Any]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return mod.FreeKVCacheBlockQueue(blocks), blocks


def _popped(mod: ModuleType, n: int = 4, take: int = 2) -> tuple[Any, list[Any], list[Any]]:
    queue, blocks = _queue(mod, n)
    return queue, blocks, queue.popleft_n(take)


def _repr(block_id: int) -> str:
    """How a message names a block: bounded, never through the block's own repr."""
    return f"KVCacheBlock(block_id={block_id})"


def _vllm_repr(block_id: int, prev_id: int | None = None, next_id: int | None = None) -> str:
    """How vLLM's own message (remove() of an invalid block) names one of kvqueue's blocks:
    as vLLM's KVCacheBlock.__repr__ does, neighbours by block_id."""
    return (
        f"KVCacheBlock(block_id={block_id}, ref_cnt=0, _block_hash=None, "
        f"_block_hash_num_tokens=None, prev_free_block={prev_id}, next_free_block={next_id})"
    )


TAIL_LOST = "prev_free_block of fake_free_list_tail should always exist"
HEAD_LOST = "next_free_block of fake_free_list_head should always exist"
LINKED = "called on a block that is already linked into a free list: "
TWICE = "called on a block that appears more than once in the batch: "
SENTINEL = "called on a block that is a sentinel of this queue: "


def popleft_empty(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 0)
    return queue, blocks, queue.popleft


def popleft_n_too_many(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 2)
    return queue, blocks, lambda: queue.popleft_n(3)


def popleft_n_huge(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 2)
    return queue, blocks, lambda: queue.popleft_n(2**80)


def popleft_n_negative(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 2)
    return queue, blocks, lambda: queue.popleft_n(-1)


def popleft_n_huge_negative(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 2)
    return queue, blocks, lambda: queue.popleft_n(-(2**80))


def popleft_n_float(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 2)
    return queue, blocks, lambda: queue.popleft_n(1.0)


def popleft_n_none(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 2)
    return queue, blocks, lambda: queue.popleft_n(None)


def remove_detached(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.remove(popped[0])


def remove_head(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 1)
    return queue, blocks, lambda: queue.remove(queue.fake_free_list_head)


def remove_tail(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 1)
    return queue, blocks, lambda: queue.remove(queue.fake_free_list_tail)


def remove_none(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: queue.remove(None)


def append_linked(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: queue.append(blocks[1])


def append_block_of_another_queue(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    _, others = _queue(mod)
    return queue, blocks + others, lambda: queue.append(others[0])


def append_head(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: queue.append(queue.fake_free_list_head)


def append_tail(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: queue.append(queue.fake_free_list_tail)


def append_sentinel_of_another_queue(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    other, others = _queue(mod)
    return queue, blocks + others, lambda: queue.append(other.fake_free_list_tail)


def append_int(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: queue.append(5)


def append_other_block_class(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: queue.append(VllmStyleBlock(9))


def append_n_duplicate(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.append_n([popped[0], popped[1], popped[0]])


def append_n_duplicate_first(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.append_n([popped[0], popped[0]])


def append_n_none_in_batch(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.append_n([popped[0], None, popped[1]])


def append_n_linked_in_batch(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.append_n([popped[0], popped[1], blocks[3]])


def append_n_sentinel(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.append_n([popped[0], queue.fake_free_list_tail])


def append_n_not_iterable(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: queue.append_n(5)


def prepend_n_duplicate(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.prepend_n([popped[1], popped[0], popped[1]])


def prepend_n_str_in_batch(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.prepend_n([popped[0], popped[1], "block"])


def prepend_n_linked_first(mod: ModuleType) -> Any:
    queue, blocks, popped = _popped(mod)
    return queue, blocks, lambda: queue.prepend_n([blocks[2], popped[0]])


def remove_block_of_another_pool(mod: ModuleType) -> Any:
    mine = [KVCacheBlock(i, pool="pool A") for i in range(3)]
    theirs = [KVCacheBlock(i, pool="pool B") for i in range(3)]
    queue = mod.FreeKVCacheBlockQueue(mine)
    mod.FreeKVCacheBlockQueue(theirs)
    return queue, mine + theirs, lambda: queue.remove(theirs[1])


def iter_blocks_after_int(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: queue.iter_blocks_after(3)


def _lost_tail(mod: ModuleType) -> tuple[Any, list[Any]]:
    queue, blocks = _queue(mod)
    queue.fake_free_list_tail.prev_free_block = None
    return queue, blocks


def _lost_head(mod: ModuleType) -> tuple[Any, list[Any]]:
    queue, blocks = _queue(mod)
    queue.fake_free_list_head.next_free_block = None
    return queue, blocks


def append_lost_tail(mod: ModuleType) -> Any:
    queue, blocks = _lost_tail(mod)
    block = KVCacheBlock(9)
    return queue, [*blocks, block], lambda: queue.append(block)


def append_n_lost_tail(mod: ModuleType) -> Any:
    queue, blocks = _lost_tail(mod)
    block = KVCacheBlock(9)
    return queue, [*blocks, block], lambda: queue.append_n([block])


def prepend_n_lost_head(mod: ModuleType) -> Any:
    queue, blocks = _lost_head(mod)
    block = KVCacheBlock(9)
    return queue, [*blocks, block], lambda: queue.prepend_n([block])


def get_all_free_blocks_lost_head(mod: ModuleType) -> Any:
    queue, blocks = _lost_head(mod)
    return queue, blocks, queue.get_all_free_blocks


def popleft_lost_head(mod: ModuleType) -> Any:
    queue, blocks = _lost_head(mod)
    return queue, blocks, queue.popleft


def popleft_n_lost_head(mod: ModuleType) -> Any:
    queue, blocks = _lost_head(mod)
    return queue, blocks, lambda: queue.popleft_n(1)


def popleft_broken_first(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    blocks[0].next_free_block = None
    return queue, blocks, queue.popleft


def popleft_n_broken_first(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    blocks[0].next_free_block = None
    return queue, blocks, lambda: queue.popleft_n(1)


def popleft_n_broken_middle(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 4)
    blocks[1].next_free_block = None
    return queue, blocks, lambda: queue.popleft_n(3)


def popleft_n_broken_after(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod, 4)
    blocks[1].next_free_block = None
    return queue, blocks, lambda: queue.popleft_n(2)


def construct_over_linked_block(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    fresh = KVCacheBlock(7)
    return queue, [*blocks, fresh], lambda: mod.FreeKVCacheBlockQueue([fresh, blocks[0]])


def construct_with_duplicate(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    fresh = [KVCacheBlock(7), KVCacheBlock(8)]
    return queue, blocks + fresh, lambda: mod.FreeKVCacheBlockQueue([*fresh, fresh[0]])


def construct_with_mixed_classes(mod: ModuleType) -> Any:
    queue, _ = _queue(mod)
    fresh = KVCacheBlock(7)
    return queue, [fresh], lambda: mod.FreeKVCacheBlockQueue([fresh, VllmStyleBlock(8)])


def construct_unslotted_class(mod: ModuleType) -> Any:
    class Loose:
        def __init__(self, block_id: int) -> None:
            self.block_id = block_id
            self.prev_free_block = self.next_free_block = None

    queue, blocks = _queue(mod)
    return queue, blocks, lambda: mod.FreeKVCacheBlockQueue([Loose(1)])


def construct_block_type_not_a_class(mod: ModuleType) -> Any:
    queue, blocks = _queue(mod)
    return queue, blocks, lambda: mod.FreeKVCacheBlockQueue([], block_type=KVCacheBlock(1))


CASES: dict[str, tuple[Setup, Expected]] = {
    "popleft_empty": (popleft_empty, Expected(ValueError, "No free blocks available")),
    "popleft_n_too_many": (
        popleft_n_too_many,
        Expected(AssertionError, "popleft_n(3) asked for more blocks than the 2 free ones"),
    ),
    "popleft_n_huge": (
        popleft_n_huge,
        Expected(AssertionError, f"popleft_n({2**80}) asked for more blocks than the 2 free ones"),
    ),
    "popleft_n_negative": (
        popleft_n_negative,
        Expected(ValueError, "popleft_n() needs n >= 0, got -1"),
    ),
    "popleft_n_huge_negative": (
        popleft_n_huge_negative,
        Expected(ValueError, f"popleft_n() needs n >= 0, got {-(2**80)}"),
    ),
    "popleft_n_float": (
        popleft_n_float,
        Expected(TypeError, "'float' object cannot be interpreted as an integer"),
    ),
    "popleft_n_none": (
        popleft_n_none,
        Expected(TypeError, "'NoneType' object cannot be interpreted as an integer"),
    ),
    "remove_detached": (
        remove_detached,
        _misuse(
            "remove() called on an invalid block: " + _vllm_repr(0),
            "not_linked",
            (2, 3),
            RuntimeError,
        ),
    ),
    "remove_head": (
        remove_head,
        _misuse(
            "remove() called on an invalid block: " + _vllm_repr(-1, None, 0),
            "not_linked",
            (0,),
            RuntimeError,
        ),
    ),
    "remove_tail": (
        remove_tail,
        _misuse(
            "remove() called on an invalid block: " + _vllm_repr(-1, 0, None),
            "not_linked",
            (0,),
            RuntimeError,
        ),
    ),
    "remove_none": (
        remove_none,
        Expected(TypeError, "remove(): expected a KVCacheBlock, got NoneType None"),
    ),
    "append_linked": (
        append_linked,
        _misuse("append() " + LINKED + _repr(1), "linked", (0, 1, 2)),
    ),
    "append_block_of_another_queue": (
        append_block_of_another_queue,
        _misuse("append() " + LINKED + _repr(0), "linked", (0, 1, 2)),
    ),
    "append_head": (
        append_head,
        _misuse("append() " + SENTINEL + _repr(-1), "sentinel", (0, 1, 2)),
    ),
    "append_tail": (
        append_tail,
        _misuse("append() " + SENTINEL + _repr(-1), "sentinel", (0, 1, 2)),
    ),
    "append_sentinel_of_another_queue": (
        append_sentinel_of_another_queue,
        _misuse("append() " + LINKED + _repr(-1), "linked", (0, 1, 2)),
    ),
    "append_int": (append_int, Expected(TypeError, "append(): expected a KVCacheBlock, got int 5")),
    "append_other_block_class": (
        append_other_block_class,
        Expected(
            TypeError,
            "append(): expected a KVCacheBlock, got VllmStyleBlock(block_id=9)",
        ),
    ),
    "append_n_duplicate": (
        append_n_duplicate,
        _misuse("append_n() " + TWICE + _repr(0), "duplicate", (2, 3, 0, 1)),
    ),
    "append_n_duplicate_first": (
        append_n_duplicate_first,
        _misuse("append_n() " + TWICE + _repr(0), "duplicate", (2, 3, 0)),
    ),
    "append_n_none_in_batch": (
        append_n_none_in_batch,
        Expected(TypeError, "append_n(): expected a KVCacheBlock, got NoneType None"),
    ),
    "append_n_linked_in_batch": (
        append_n_linked_in_batch,
        _misuse("append_n() " + LINKED + _repr(3), "linked", (2, 3, 0, 1)),
    ),
    "append_n_sentinel": (
        append_n_sentinel,
        _misuse("append_n() " + SENTINEL + _repr(-1), "sentinel", (2, 3, 0)),
    ),
    "append_n_not_iterable": (
        append_n_not_iterable,
        Expected(TypeError, "append_n() needs an iterable of blocks"),
    ),
    "prepend_n_duplicate": (
        prepend_n_duplicate,
        _misuse("prepend_n() " + TWICE + _repr(1), "duplicate", (1, 0, 2, 3)),
    ),
    "prepend_n_str_in_batch": (
        prepend_n_str_in_batch,
        Expected(TypeError, "prepend_n(): expected a KVCacheBlock, got str 'block'"),
    ),
    "prepend_n_linked_first": (
        prepend_n_linked_first,
        _misuse("prepend_n() " + LINKED + _repr(2), "linked", (0, 2, 3)),
    ),
    "remove_block_of_another_pool": (
        remove_block_of_another_pool,
        _misuse(
            "remove() called on a block of another pool's queue: " + _repr(1),
            "other_pool",
            (0, 1, 2),
        ),
    ),
    "iter_blocks_after_int": (
        iter_blocks_after_int,
        Expected(TypeError, "iter_blocks_after(): expected a KVCacheBlock, got int 3"),
    ),
    "append_lost_tail": (append_lost_tail, Expected(RuntimeError, TAIL_LOST)),
    "append_n_lost_tail": (append_n_lost_tail, Expected(AssertionError, TAIL_LOST)),
    "prepend_n_lost_head": (prepend_n_lost_head, Expected(AssertionError, HEAD_LOST)),
    "get_all_free_blocks_lost_head": (
        get_all_free_blocks_lost_head,
        Expected(RuntimeError, HEAD_LOST),
    ),
    "popleft_lost_head": (
        popleft_lost_head,
        Expected(AssertionError, "num_free_blocks (3) is out of sync with the free list."),
    ),
    "popleft_n_lost_head": (
        popleft_n_lost_head,
        Expected(AssertionError, "num_free_blocks (3) is out of sync with the free list."),
    ),
    "popleft_broken_first": (
        popleft_broken_first,
        Expected(
            RuntimeError,
            "Invalid block found in popleft() which doesn't have a valid next_free_block",
        ),
    ),
    "popleft_n_broken_first": (
        popleft_n_broken_first,
        Expected(
            RuntimeError,
            "Invalid block found in popleft_n() which doesn't have a valid next_free_block",
        ),
    ),
    "popleft_n_broken_middle": (
        popleft_n_broken_middle,
        Expected(AssertionError, "num_free_blocks (4) is out of sync with the free list."),
    ),
    "popleft_n_broken_after": (
        popleft_n_broken_after,
        Expected(
            RuntimeError,
            "Invalid block found in popleft_n() which doesn't have a valid next_free_block",
        ),
    ),
    "construct_over_linked_block": (
        construct_over_linked_block,
        _misuse("FreeKVCacheBlockQueue() " + LINKED + _repr(0), "linked", (3,)),
    ),
    "construct_with_duplicate": (
        construct_with_duplicate,
        _misuse("FreeKVCacheBlockQueue() " + TWICE + _repr(7), "duplicate", (3, 4)),
    ),
    "construct_with_mixed_classes": (
        construct_with_mixed_classes,
        Expected(
            TypeError,
            "FreeKVCacheBlockQueue(): expected a KVCacheBlock, got VllmStyleBlock",
            exact=False,
        ),
    ),
    "construct_unslotted_class": (
        construct_unslotted_class,
        Expected(
            TypeError,
            "FreeKVCacheBlockQueue(): blocks[0] has type construct_unslotted_class.<locals>.Loose"
            ", which the queue cannot thread: construct_unslotted_class.<locals>.Loose."
            "prev_free_block must be a __slots__ member (e.g. a @dataclass(slots=True) field), "
            "not NoneType",
        ),
    ),
    "construct_block_type_not_a_class": (
        construct_block_type_not_a_class,
        Expected(TypeError, "block_type must be a class, not KVCacheBlock"),
    ),
}


def with_policy(mod: ModuleType, on_misuse: str | None) -> ModuleType:
    """``mod`` as a case sees it, its queues built with ``on_misuse`` (None: as ``mod``'s)."""
    if on_misuse is None:
        return mod
    twin = ModuleType(mod.__name__)
    vars(twin)["FreeKVCacheBlockQueue"] = partial(mod.FreeKVCacheBlockQueue, on_misuse=on_misuse)
    return twin


def outcome(mod: ModuleType, name: str, on_misuse: str | None = None) -> tuple[str, str, bool]:
    """(exception type name, message, state untouched) of one case on one twin."""
    setup, _ = CASES[name]
    queue, blocks, call = setup(with_policy(mod, on_misuse))
    before = snapshot(queue, blocks)
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, one_line(exc), snapshot(queue, blocks) == before
    return "no exception", "", snapshot(queue, blocks) == before
