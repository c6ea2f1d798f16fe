"""A stand-in for vLLM's ``BlockPool`` of each line, for the pool guard's shared tests.

Not vLLM's code: a model of what each line's guarded methods do to reference counts and
the free list, as ``kvqueue.vllm._lines`` describes the lines (the real classes are
tested in vllm_tests/). Each :func:`pool_class` call makes a new class, defined in this
module as vLLM's is in its own (the guard accepts only such methods, or its own guards),
so that a test can guard it and throw it away.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from kvqueue.vllm import _pool_guard
from kvqueue.vllm._lines import LINES, Line

from support import twins
from support.blocks import VllmStyleBlock, layout


def line(name: str) -> Line:
    return next(each for each in LINES if each.name == name)


# The blocks of the lines before 0.30, which name no pool, field for field as the lines'
# table has them (0.18-0.23's; 0.24-0.29 add ``_block_hash_num_tokens``).
Block023 = layout("Block023", line("0.23").block_fields)
Block024 = layout("Block024", line("0.24").block_fields)
# 0.34+: public hash fields, and ``pool`` a weak reference (the pool's ``_weak_self``).
BlockWeak = layout("BlockWeak", next(each for each in LINES if each.weak_pool).block_fields)


def block_class(of: Line) -> type:
    if of.weak_pool:
        return BlockWeak
    if of.has_pool_field:
        return VllmStyleBlock
    return Block024 if "_block_hash_num_tokens" in of.block_fields else Block023


class _Pool:
    """What every line's pool has: blocks, a free list of them, a null block."""

    block: type | None = None

    def __init__(self, num_gpu_blocks: int, queue_class: type, of: Line) -> None:
        make = self.block or block_class(of)
        if of.weak_pool:
            self._weak_self = weakref.ref(self)
        if of.has_pool_field:
            self.blocks = [make(i, pool=of.pool_ref(self)) for i in range(num_gpu_blocks)]
        else:
            self.blocks = [make(i) for i in range(num_gpu_blocks)]
        self.num_gpu_blocks = num_gpu_blocks
        self.free_block_queue = queue_class(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.on_reuse: dict[int, Callable[[Any], None]] = {}

    def get_num_free_blocks(self) -> int:
        return int(self.free_block_queue.num_free_blocks)


def _get_new_blocks(self: Any, num_blocks: int) -> list[Any]:
    if num_blocks > self.get_num_free_blocks():
        raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
    taken = self.free_block_queue.popleft_n(num_blocks)
    for block in taken:
        assert block.ref_cnt == 0
        block.ref_cnt += 1
    return list(taken)


def _touch(skips_null: bool) -> Callable[..., None]:
    def touch(self: Any, blocks: Any) -> None:
        for block in blocks:
            if skips_null and block.is_null:
                continue
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    return touch


def _free_appending(self: Any, ordered_blocks: Any) -> None:
    # 0.18-0.22: every occurrence released, then every occurrence at 0 appended (the
    # queue has no front insertion).
    every = list(ordered_blocks)
    for block in every:
        block.ref_cnt -= 1
    self.free_block_queue.append_n(
        [block for block in every if block.ref_cnt == 0 and not block.is_null]
    )


def _free_counting_first(self: Any, ordered_blocks: Any, prepend: bool = False) -> None:
    # 0.23: every occurrence released, then every occurrence at 0 queued.
    every = list(ordered_blocks)
    for block in every:
        block.ref_cnt -= 1
    at_zero = [block for block in every if block.ref_cnt == 0 and not block.is_null]
    if prepend:
        self.free_block_queue.prepend_n(at_zero)
    else:
        self.free_block_queue.append_n(at_zero)


def _free(of: Line) -> Callable[..., None]:
    def free_blocks(self: Any, ordered_blocks: Any) -> None:
        first: list[Any] = []
        last: list[Any] = []
        elsewhere: dict[Any, list[Any]] = {}
        for block in ordered_blocks:
            if of.skips_null and block.is_null:
                continue
            if of.has_pool_field and block.pool is not None and block.pool is not self:
                elsewhere.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                (first if block._block_hash is None else last).append(block)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)
        for pool, blocks in elsewhere.items():
            pool.free_blocks(blocks)

    return free_blocks


def _free_weak(self: Any, ordered_blocks: Any, evict_first: bool = False) -> None:
    # 0.34+: another live pool's blocks handed to it, a gone pool's skipped; evict_first
    # queues cached blocks at the front too.
    first: list[Any] = []
    last: list[Any] = []
    elsewhere: dict[Any, list[Any]] = {}
    for block in ordered_blocks:
        if block.is_null:
            continue
        if block.pool is not None and block.pool is not self._weak_self:
            pool = block.pool()
            if pool is not None:
                elsewhere.setdefault(pool, []).append(block)
            continue
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            (first if block.block_hash is None or evict_first else last).append(block)
    self.free_block_queue.prepend_n(first)
    self.free_block_queue.append_n(last)
    for pool, blocks in elsewhere.items():
        pool.free_blocks(blocks, evict_first=evict_first)


def _unpin_blocks(self: Any, blocks: Any, on_reuse: Callable[[Any], None]) -> None:
    released = []
    for block in blocks:
        assert block.ref_cnt > 0
        assert not block.is_null
        block.ref_cnt -= 1
        self.on_reuse[block.block_id] = on_reuse
        if block.ref_cnt == 0:
            released.append(block)
    self.free_block_queue.append_n(released)


def pool_class(
    of: Line, *, module: ModuleType | None = None, metaclass: type = type, block: type | None = None
) -> type:
    """A new ``BlockPool`` class of line ``of``, its methods as vLLM's are named: defined in
    this module, or in ``module`` (a stand-in for vLLM's). ``block``: its blocks' class."""
    methods: dict[str, Any] = {
        "get_new_blocks": _get_new_blocks,
        "touch": _touch(of.skips_null),
        "free_blocks": (
            _free_counting_first if "prepend" in of.pool_methods["free_blocks"] else _free_appending
        )
        if of.counts_first
        else _free_weak
        if of.weak_pool
        else _free(of),
    }
    if "unpin_blocks" in of.pool_methods:
        methods["unpin_blocks"] = _unpin_blocks

    def init(self: Any, num_gpu_blocks: int, queue_class: type) -> None:
        _Pool.__init__(self, num_gpu_blocks, queue_class, of)

    home = module.__name__ if module is not None else __name__
    namespace = {"__init__": init, "__module__": home, "block": block}
    cls: type = metaclass("BlockPool", (_Pool,), namespace)
    for name, function in methods.items():
        # A function of its own per class, named as vLLM's method is, in its module.
        own = type(function)(
            function.__code__,
            vars(module) if module is not None else function.__globals__,
            name,
            function.__defaults__,
            function.__closure__,
        )
        own.__qualname__ = f"BlockPool.{name}"
        setattr(cls, name, own)
    return cls


# Every stand-in pool's queue is kvqueue's, with its own on_misuse: the policy the guard uses.
policy_of = _pool_guard.PoolPolicy()


def screen_of(queue_mod: ModuleType) -> ModuleType:
    return twins.of(queue_mod).screen


@contextmanager
def guarded(queue_mod: ModuleType, of: Line, **kwargs: Any) -> Iterator[type]:
    """A new pool class of line ``of``, guarded with ``queue_mod``'s screens until the end."""
    cls = pool_class(of)
    originals = _pool_guard.guard(
        cls, screen_of(queue_mod), policy_of, wrap_foreign=False, line=of, **kwargs
    )
    try:
        yield cls
    finally:
        _pool_guard.unguard(cls, originals)


def make_pool(cls: type, queue_mod: ModuleType, n: int, policy: str) -> Any:
    def queue_class(blocks: list[Any]) -> Any:
        return queue_mod.FreeKVCacheBlockQueue(blocks, on_misuse=policy)

    return cls(n, queue_class)


def state(pool: Any) -> tuple[Any, ...]:
    """Everything a guarded call may change: counts and the free list, in order."""
    return (
        tuple(block.ref_cnt for block in pool.blocks),
        tuple(block.block_id for block in pool.free_block_queue.get_all_free_blocks()),
        pool.free_block_queue.num_free_blocks,
    )


def consistent(pool: Any) -> None:
    """The count is the list's length, and the list holds exactly the blocks at 0."""
    free = pool.free_block_queue.get_all_free_blocks()
    assert pool.free_block_queue.num_free_blocks == len(free)
    assert all(block.ref_cnt == 0 for block in free), [(b.block_id, b.ref_cnt) for b in free]
    listed = {id(block) for block in free}
    held = [b for b in pool.blocks if not b.is_null and id(b) not in listed]
    assert all(block.ref_cnt > 0 for block in held), [(b.block_id, b.ref_cnt) for b in held]
