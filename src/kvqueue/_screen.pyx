# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""The pool guard's screens, compiled: the twin of ``_screen_py.py``, function for function.

One deliberate difference: ``first_excess`` keys the references it has counted in a
small open-addressing table of block addresses instead of a dict of ``id()``s (no
int object per block). It holds a reference to every block in that table, so code a
block's attributes run cannot free one and put another object at its address.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport uintptr_t

__all__ = ("first_excess", "first_held_free", "first_negative")


cdef struct _Seen:
    PyObject *block
    Py_ssize_t left


def first_excess(list blocks, object pool):
    """The index of the first occurrence in ``blocks`` of a block of ``pool`` that would
    take its ``ref_cnt`` below 0 if each occurrence released one reference, or that
    releases a block linked in a free list, or -1; O(len(blocks)).

    Only ``pool``'s own blocks are screened: null blocks (vLLM keeps no count for them),
    another pool's blocks (vLLM hands those to their pool, whose guard screens them) and
    blocks of no pool (made outside any pool, as some of vLLM's tests do) keep vLLM's
    handling.
    """
    cdef Py_ssize_t cap = 8, mask, i, slot, found = -1
    cdef Py_ssize_t n = len(blocks)
    cdef _Seen *seen
    cdef object block
    while cap < 2 * n:
        cap <<= 1
    mask = cap - 1
    seen = <_Seen *>PyMem_Calloc(cap, sizeof(_Seen))
    if seen is NULL:
        raise MemoryError()
    try:
        i = 0
        # The length is read again each turn: an attribute read may run code that
        # shrinks the list (the table holds at most n blocks whatever it grows to).
        while i < len(blocks) and i < n:
            block = blocks[i]
            if block.pool is not pool or block.is_null:
                i += 1
                continue
            slot = <Py_ssize_t>((<uintptr_t><PyObject *>block >> 4) & mask)
            while seen[slot].block is not NULL and seen[slot].block != <PyObject *>block:
                slot = (slot + 1) & mask
            if seen[slot].block is NULL:
                # A block in the free list is free, whatever its count says.
                if block.prev_free_block is not None:
                    found = i
                    break
                refs = block.ref_cnt
                if refs < 1:
                    found = i
                    break
                Py_INCREF(block)
                seen[slot].block = <PyObject *>block
                seen[slot].left = <Py_ssize_t>min(refs, n + 1)
            elif seen[slot].left < 1:
                found = i
                break
            seen[slot].left -= 1
            i += 1
    finally:
        for slot in range(cap):
            if seen[slot].block is not NULL:
                Py_DECREF(<object>seen[slot].block)
        PyMem_Free(seen)
    return found


def first_negative(blocks, object pool):
    """The index of the first block of ``pool`` (null aside) whose ``ref_cnt`` is
    negative, or -1."""
    cdef Py_ssize_t i = 0
    for block in blocks:
        if block.pool is pool and not block.is_null and block.ref_cnt < 0:
            return i
        i += 1
    return -1


def first_held_free(object head, Py_ssize_t n):
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel)
    whose ``ref_cnt`` is not 0, or None; O(n). A link that is None ends the walk."""
    cdef object block = head
    for _ in range(n):
        block = block.next_free_block
        # A count assigned above the list's length (vLLM's tests fake a full cache so)
        # ends the walk at the tail: what vLLM then does is vLLM's.
        if block is None:
            return None
        if block.ref_cnt != 0:
            return block
    return None
