"""Pool-guard programs that crashed or hung once, each a function of the twin's module
name, run by test_pool_guard.py in its own process (``python -m isolated.guard_cases CASE
TWIN``: a crash or a hang fails one test)."""

from __future__ import annotations

import faulthandler
import importlib
import logging
from collections.abc import Callable
from typing import Any

from kvqueue.vllm._lines import LINES

from support.fake_pool import consistent, guarded, make_pool, screen_of
from support.helpers import isolated_cases, one_line, run_case

NEWEST = LINES[-1]


class _Lender:
    """A class whose third slot lies, in a bytearray subclass's instances, over the
    bytearray's buffer pointer."""

    __slots__ = ("a", "b", "ref_cnt")


class _Borrower(bytearray):
    """Borrows _Lender's ``ref_cnt`` descriptor: its offset means nothing here."""

    __slots__ = ("is_null", "next_free_block", "pool", "prev_free_block")


_Borrower.ref_cnt = _Lender.__dict__["ref_cnt"]  # type: ignore[attr-defined]


def _raises(call: Callable[[], object], kind: type[Exception], text: str) -> None:
    """That ``call`` raises ``kind`` saying ``text`` (no pytest in this process)."""
    try:
        call()
    except kind as exc:
        message = one_line(exc)
    else:
        raise AssertionError(f"no {kind.__name__}: {text}")
    if text not in message:
        raise AssertionError(message)


def borrowed_slot_descriptor(name: str) -> None:
    """The compiled screen read a borrowed descriptor's offset in another class's
    instances (a pointer into a bytearray's buffer, taken for an object): a crash."""
    mod = importlib.import_module(name)
    block: Any = _Borrower(b"not an object" * 4)
    block.is_null, block.prev_free_block, block.next_free_block = False, None, None
    screen = screen_of(mod)
    with guarded(mod, NEWEST) as cls:
        pool = make_pool(cls, mod, 4, "raise")
        block.pool = NEWEST.pool_ref(pool)
        calls = (
            lambda: screen.first_excess([block], block.pool),
            lambda: screen.first_negative([block], block.pool),
            lambda: pool.free_blocks([block]),
            lambda: pool.touch([block]),
        )
        for call in calls:
            _raises(call, TypeError, "doesn't apply to a '_Borrower' object")


def _held_and_unremovable(name: str, corrupt: str) -> None:
    mod = importlib.import_module(name)
    faulthandler.dump_traceback_later(20, exit=True)  # a hang fails with its stack
    logging.getLogger("kvqueue").addHandler(logging.NullHandler())
    with guarded(mod, NEWEST) as cls:
        pool = make_pool(cls, mod, 8, "repair")
        other = make_pool(cls, mod, 2, "repair")
        held = pool.free_block_queue.get_all_free_blocks()[1]
        held.ref_cnt = 1  # a reference taken without touch()
        if corrupt == "pool":
            held.pool = NEWEST.pool_ref(other)
        else:
            held.prev_free_block = None
        before = pool.free_block_queue.num_free_blocks
        _raises(lambda: pool.get_new_blocks(3), RuntimeError, "the queue cannot unlink it")
        assert pool.free_block_queue.num_free_blocks == before
    faulthandler.cancel_dump_traceback_later()


def held_block_of_a_reassigned_pool(name: str) -> None:
    """Its ``pool`` reassigned while linked: the queue skips its removal as another pool's
    block, and the repair took it out again and again."""
    _held_and_unremovable(name, "pool")


def held_block_with_a_cleared_link(name: str) -> None:
    """Its ``prev_free_block`` cleared while linked: the queue skips it as not linked."""
    _held_and_unremovable(name, "prev")


def finalizer_frees_during_a_repair(name: str) -> None:
    """A finalizer run by the collector in the middle of a repaired call frees blocks
    through the guard: every call ends, and the pool stays consistent."""
    import gc

    mod = importlib.import_module(name)
    logging.getLogger("kvqueue").addHandler(logging.NullHandler())
    with guarded(mod, NEWEST) as cls:
        pool = make_pool(cls, mod, 40, "repair")
        held = pool.get_new_blocks(30)

        class Freer:
            def __init__(self) -> None:
                self.me = self

            def __del__(self) -> None:
                if held:
                    block = held.pop()
                    pool.free_blocks([block, block])

        for _ in range(10):
            gc.set_threshold(1)
            Freer()
            block = held.pop()
            pool.free_blocks([block, block, block])
            gc.set_threshold(700)
        gc.collect()
        consistent(pool)


CASES = isolated_cases(globals())

if __name__ == "__main__":
    run_case(globals())
