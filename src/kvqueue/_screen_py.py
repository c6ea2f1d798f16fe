"""The pool guard's screens, pure Python: the twin of ``_screen.pyx``.

Each screen reads blocks and changes nothing: it runs on every guarded call of
vLLM's ``BlockPool`` (kvqueue/_pool_guard.py), before vLLM's own method, and
answers where the first misuse is, or that there is none. A block is whatever
vLLM's pool holds: any object with ``ref_cnt``, ``is_null`` and (vLLM 0.30+)
``pool``, the pool or (0.34+) a weak reference to it.

Both twins read the same fields of the same blocks in the same order, so that
code a block runs (a property, a ``__bool__``) runs alike in both; a list that
such code changes is screened up to its length at the start, or its current
length if shorter. A ``ref_cnt`` that is not an int (or an int subclass, read
by its int value) is a misuse at that block: the guard says what it is.
"""

from __future__ import annotations

from typing import Any
from weakref import ReferenceType

from ._block import is_subtype

__all__ = ("OTHER_POOLS", "REPEATS", "first_excess", "first_held_free", "first_negative")

#: What ``first_excess`` found besides no misuse, as ``-1 - flags``: blocks of other
#: pools, and blocks given more than once (within the references they hold).
OTHER_POOLS = 1
REPEATS = 2

_ZERO = 0


def first_excess(blocks: list[Any], pool: object) -> int:
    """The index of the first occurrence in ``blocks`` of a block of ``pool`` that would
    take its ``ref_cnt`` below 0 if each occurrence released one reference, that releases
    a block linked in a free list, or whose ``ref_cnt`` is no int; else ``-1 - flags``
    (:data:`OTHER_POOLS`, :data:`REPEATS`); O(len(blocks)).

    Only ``pool``'s own blocks are screened: null blocks (vLLM keeps no count for them),
    another pool's blocks (vLLM hands those to their pool, whose guard screens them), blocks
    whose pool is gone (a dead weak reference: vLLM 0.34+ skips them, and they raise no
    flag) and blocks of no pool (made outside any pool, as some of vLLM's tests do) keep
    vLLM's handling. ``pool`` is what the caller's own blocks hold in their ``pool`` field
    (the pool, or from vLLM 0.34 its ``_weak_self``); None: the blocks have no ``pool``
    field (vLLM before 0.30), and every block is the caller's.
    """
    # Block ids are not unique across pools and vLLM's dataclass blocks are not
    # hashable: a block's remaining references are keyed by identity.
    left: dict[int, int] = {}
    flags = 0
    # Up to the length at the start (zip stops at the shorter): what code a block runs
    # appends is not screened, as the compiled twin does not.
    for i, block in zip(range(len(blocks)), blocks, strict=False):
        if pool is not None:
            owner = block.pool
            if owner is not pool:
                if owner is not None and not _gone(owner):
                    flags |= OTHER_POOLS
                continue
        if block.is_null:
            continue
        key = id(block)
        refs = left.get(key)
        if refs is None:
            # A block in the free list is free, whatever its count says.
            if block.prev_free_block is not None:
                return i
            refs = block.ref_cnt
            if type(refs) is not int:
                refs = _count(refs)
                if refs is None:
                    return i
        else:
            flags |= REPEATS
        if refs < 1:
            return i
        left[key] = refs - 1
    return -1 - flags


def first_negative(blocks: list[Any], pool: object) -> int:
    """The index of the first block of ``pool`` (null aside; ``pool`` None: any block)
    whose ``ref_cnt`` is negative or no int, or -1."""
    for i, block in zip(range(len(blocks)), blocks, strict=False):
        if (pool is None or block.pool is pool) and not block.is_null:
            refs = block.ref_cnt
            if type(refs) is not int:
                refs = _count(refs)
                if refs is None:
                    return i
            if refs < 0:
                return i
    return -1


def first_held_free(head: Any, n: int) -> Any:
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel)
    whose ``ref_cnt`` is not 0 (or no int), or None; O(n). A link that is None ends
    the walk."""
    block = head
    for _ in range(n):
        block = block.next_free_block
        # A count assigned above the list's length (vLLM's tests fake a full cache so)
        # ends the walk at the tail: what vLLM then does is vLLM's.
        if block is None:
            return None
        refs = block.ref_cnt
        # A free block's count is the interpreter's one 0 object, the identity test the
        # quick way past it; any other value (an int, a 0 of a subclass or no int) is read.
        if refs is not _ZERO and _count(refs) != 0:
            return block
    return None


def _gone(owner: object) -> bool:
    """Whether ``owner`` is a weak reference whose pool is gone; calls no code of its own
    (only an exact ``weakref.ref`` is called)."""
    return type(owner) is ReferenceType and owner() is None


def _count(value: object) -> int | None:
    """``value`` as the int a ``ref_cnt`` is, or None; runs no code of ``value``'s."""
    if type(value) is int:
        return value
    if is_subtype(type(value), int):
        return int.__index__(value)  # type: ignore[arg-type]
    return None
