"""The pool guard's screens, pure Python: the twin of ``_screen.pyx``.

Each screen reads blocks and changes nothing: it runs on every guarded call of
vLLM's ``BlockPool`` (kvqueue/_pool_guard.py), before vLLM's own method, and
answers where the first misuse is, or that there is none. A block is whatever
vLLM's pool holds: any object with ``ref_cnt``, ``is_null`` and ``pool``.
"""

from __future__ import annotations

from typing import Any

__all__ = ("first_excess", "first_held_free", "first_negative")


def first_excess(blocks: list[Any], pool: object) -> int:
    """The index of the first occurrence in ``blocks`` of a block of ``pool`` that would
    take its ``ref_cnt`` below 0 if each occurrence released one reference, or that
    releases a block linked in a free list, or -1; O(len(blocks)).

    Only ``pool``'s own blocks are screened: null blocks (vLLM keeps no count for them),
    another pool's blocks (vLLM hands those to their pool, whose guard screens them) and
    blocks of no pool (made outside any pool, as some of vLLM's tests do) keep vLLM's
    handling.
    """
    # Block ids are not unique across pools and vLLM's dataclass blocks are not
    # hashable: a block's remaining references are keyed by identity.
    left: dict[int, int] = {}
    for i, block in enumerate(blocks):
        if block.pool is not pool or block.is_null:
            continue
        key = id(block)
        refs = left.get(key)
        if refs is None:
            # A block in the free list is free, whatever its count says.
            if block.prev_free_block is not None:
                return i
            refs = block.ref_cnt
        if refs < 1:
            return i
        left[key] = refs - 1
    return -1


def first_negative(blocks: list[Any], pool: object) -> int:
    """The index of the first block of ``pool`` (null aside) whose ``ref_cnt`` is
    negative, or -1."""
    for i, block in enumerate(blocks):
        if block.pool is pool and not block.is_null and block.ref_cnt < 0:
            return i
    return -1


def first_held_free(head: Any, n: int) -> Any:
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel)
    whose ``ref_cnt`` is not 0, or None; O(n). A link that is None ends the walk."""
    block = head
    for _ in range(n):
        block = block.next_free_block
        # A count assigned above the list's length (vLLM's tests fake a full cache so)
        # ends the walk at the tail: what vLLM then does is vLLM's.
        if block is None:
            return None
        if block.ref_cnt != 0:
            return block
    return None
