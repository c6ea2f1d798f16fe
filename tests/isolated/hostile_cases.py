"""Hostile programs that crashed or corrupted the compiled twin once, kept as
regression cases. Each is a function of the twin's module name, run by
test_hostile.py in its own process (``python -m isolated.hostile_cases CASE TWIN``: a
crash must fail one test, not the run).
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import logging
from contextlib import suppress
from types import ModuleType
from typing import Any

from kvqueue import KVCacheBlock

from support.fuzz_common import well_formed
from support.helpers import isolated_cases, one_line, run_case


class _PopOnCollect:
    """Cyclic garbage whose finalizer pops the queue's first block and drops it."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.me = self

    def __del__(self) -> None:
        self.queue.popleft()


class _Sub(KVCacheBlock):
    """A subclass's block: the pure twin checks it by running Python code."""

    __slots__ = ()


def _collect_inside(mod: ModuleType, method: str, batch: int = 0, subclass: bool = False) -> None:
    # The queue holds the only references to its blocks, so the popped one is
    # freed inside the call. 3.11 collects at the allocation itself (3.12+
    # defers to the next bytecode); the list free list is drained so that the
    # method's list allocation is one the collector counts.
    queue = mod.FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(40)])
    call = getattr(queue, method)  # a bound method is an allocation: make it first
    for i in range(5):
        if batch:
            blocks = queue.popleft_n(batch)
            if subclass:
                blocks[-1] = _Sub(100 + i)
            args: tuple[Any, ...] = (blocks,)
        else:
            args = (2,) if method == "popleft_n" else ()
        gc.set_threshold(0)
        drained: list[Any] = [[] for _ in range(100)]
        _PopOnCollect(queue)
        gc.set_threshold(1)
        try:
            result = call(*args)
        finally:
            gc.set_threshold(700)
        del drained
        assert well_formed(queue) is None, well_formed(queue)
        assert all(b.block_id >= 0 for b in result or ())


def collect_inside_popleft_n(name: str) -> None:
    _collect_inside(importlib.import_module(name), "popleft_n")


def collect_inside_get_all_free_blocks(name: str) -> None:
    _collect_inside(importlib.import_module(name), "get_all_free_blocks")


def collect_inside_append_n(name: str) -> None:
    _collect_inside(importlib.import_module(name), "append_n", batch=3)


def collect_inside_prepend_n(name: str) -> None:
    _collect_inside(importlib.import_module(name), "prepend_n", batch=3)


def collect_inside_a_batch_with_a_subclass_block(name: str) -> None:
    for method in ("append_n", "prepend_n"):
        _collect_inside(importlib.import_module(name), method, batch=3, subclass=True)


def repr_finds_the_half_built_result(name: str) -> None:
    """An error message's repr hunts popleft_n's result list, half filled."""
    mod = importlib.import_module(name)
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = mod.FreeKVCacheBlockQueue(blocks)

    class Hunter:
        def __repr__(self) -> str:
            for obj in gc.get_objects():
                if type(obj) is list and len(obj) == 4 and obj and obj[0] is blocks[0]:
                    [type(item) for item in obj]  # reads every slot
                    obj.clear()
            return "Hunter()"

    blocks[2].next_free_block = Hunter()  # type: ignore[assignment]
    try:
        queue.popleft_n(4)
    except (RuntimeError, AttributeError):
        pass
    else:
        raise AssertionError("popleft_n followed a corrupted link")


def metaclass_lends_a_foreign_slot(name: str) -> None:
    """A block class whose metaclass passes off another class's slots, far
    past the end of its own instances, must be refused."""
    mod = importlib.import_module(name)

    class Yes(type):
        def __subclasscheck__(cls, sub: type) -> bool:
            return True

    class Big(metaclass=Yes):
        __slots__ = tuple(f"s{i}" for i in range(2000))

    class Lender(type):
        def __getattribute__(cls, attr: str) -> Any:
            if attr == "prev_free_block":
                return Big.__dict__["s1998"]
            if attr == "next_free_block":
                return Big.__dict__["s1999"]
            return super().__getattribute__(attr)

    class Small(metaclass=Lender):
        __slots__ = ("block_id",)

        def __init__(self, block_id: int) -> None:
            self.block_id = block_id

    try:
        mod.FreeKVCacheBlockQueue([Small(i) for i in range(3)])
    except TypeError as exc:
        if "Big, not of a base of this class" not in one_line(exc):
            raise
        return
    raise AssertionError("a class with borrowed slots was accepted")


def constructor_shrinks_the_batch(name: str) -> None:
    """The sentinels' constructor empties the very list being linked."""
    mod = importlib.import_module(name)
    batch: list[Any] = []

    class Shrinking(KVCacheBlock):
        __slots__ = ()

        def __init__(self, block_id: int, **kwargs: Any) -> None:
            super().__init__(block_id, **kwargs)
            if block_id == -1:
                batch.clear()

    batch += [Shrinking(i) for i in range(3)]
    try:
        queue = mod.FreeKVCacheBlockQueue(batch)
    except IndexError:
        return  # the pure twin may notice the list is gone
    assert well_formed(queue) is None, well_formed(queue)


def dying_cursor_block_advances_the_cursor(name: str) -> None:
    """The block a cursor stands on is its last reference; its finalizer calls
    the same cursor again while the cursor is moving off it."""
    mod = importlib.import_module(name)
    cursor: list[Any] = []

    class Advancing(KVCacheBlock):
        __slots__ = ()

        def __del__(self) -> None:
            # The pure twin's cursor is a generator, which cannot be re-entered.
            with suppress(ValueError):
                for _ in cursor[0]:
                    pass

    queue = mod.FreeKVCacheBlockQueue([Advancing(i) for i in range(4)])
    cursor.append(queue.iter_blocks_after(None))
    next(cursor[0])
    queue.popleft()  # the cursor now holds the first block alone
    assert [b.block_id for b in cursor[0]] in ([1, 2, 3], [])
    assert well_formed(queue) is None


def constructor_reenters_init(name: str) -> None:
    """The sentinels' constructor finds the half-built queue and calls __init__
    on it with a class of other slot offsets (the compiled twin then wrote the
    sentinels' links past the end of the object)."""
    mod = importlib.import_module(name)
    queue_type = mod.FreeKVCacheBlockQueue
    refused: list[str] = []

    class Other:
        __slots__ = (*(f"a{i:02d}" for i in range(10)), "next_free_block", "prev_free_block")
        block_id = -1

        def __init__(self, block_id: int) -> None:
            self.prev_free_block = self.next_free_block = None

    class Evil(KVCacheBlock):
        __slots__ = ()

        def __init__(self, block_id: int, **kwargs: Any) -> None:
            super().__init__(block_id, **kwargs)
            if block_id != -1:
                return
            for obj in gc.get_objects():
                if type(obj) is queue_type and "uninitialized" in repr(obj):
                    try:
                        obj.__init__([Other(0)], block_type=Other)
                    except RuntimeError as exc:
                        refused.append(str(exc))

    blocks = [Evil(0), Evil(1)]
    queue = mod.FreeKVCacheBlockQueue(blocks)
    assert refused, "the nested __init__ never ran"
    assert all("being initialized" in message for message in refused), refused
    assert queue.block_type is Evil
    assert well_formed(queue) is None, well_formed(queue)
    assert queue.get_all_free_blocks() == blocks


def repair_at_a_forgotten_end(name: str) -> None:
    """A repaired batch whose end block forgot its links: the pure twin's repair
    re-screened it forever, waiting for an end that no finalizer would mend."""
    mod = importlib.import_module(name)
    faulthandler.dump_traceback_later(20, exit=True)  # a hang fails with its stack
    logging.getLogger("kvqueue").addHandler(logging.NullHandler())
    for method in ("append_n", "prepend_n"):
        blocks = [KVCacheBlock(i) for i in range(3)]
        queue = mod.FreeKVCacheBlockQueue(blocks, on_misuse="repair")
        end = blocks[2] if method == "append_n" else blocks[0]
        end.prev_free_block = end.next_free_block = None  # the caller's corruption
        getattr(queue, method)([end, end])
        assert queue.repairs["duplicate"] + queue.repairs["linked"] >= 1, queue.repairs
    faulthandler.cancel_dump_traceback_later()


CASES = isolated_cases(globals())

if __name__ == "__main__":
    run_case(globals())
