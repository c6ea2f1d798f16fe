# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""The pool guard's screens, compiled: the twin of ``_screen_py.py``, function for function.

Deliberate differences, none visible in what a screen returns or raises:

* A block whose class lays out ``pool``, ``is_null``, ``ref_cnt`` and the links as plain
  ``__slots__`` members (vLLM's ``KVCacheBlock``) is read from its slots (``_screen.h``),
  where no Python code runs. Any other block, and a slot never set, is read with
  ``getattr`` as the pure twin reads it; since that may run code that changes a class,
  the layout is learned again after it (``_Layout``), and at every call.
* ``first_excess`` keys the references it has counted in a small open-addressing table
  of block addresses instead of a dict of ``id()``s (no int object per block). It holds
  a reference to every block in that table, so code a block's attributes run cannot
  free one and put another object at its address.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.object cimport Py_TYPE, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport uintptr_t

__all__ = ("first_excess", "first_held_free", "first_negative")


cdef extern from "_screen.h":
    Py_ssize_t kvs_slot(PyTypeObject *tp, object name)
    PyObject *KVS_SLOT(PyObject *o, Py_ssize_t off)


cdef struct _Seen:
    PyObject *block
    Py_ssize_t left


# Where one block class keeps the fields a screen reads. ``type`` is borrowed: it is
# learned from a block the caller holds, and dropped (NULL) whenever a read may have run
# Python code, which could have changed that class or let it go.
cdef struct _Layout:
    PyTypeObject *type
    bint fast
    Py_ssize_t pool, is_null, ref_cnt, prev, next


cdef inline void _learn(_Layout *lay, object block):
    cdef PyTypeObject *tp = Py_TYPE(block)
    lay.type = tp
    lay.pool = kvs_slot(tp, "pool")
    lay.is_null = kvs_slot(tp, "is_null")
    lay.ref_cnt = kvs_slot(tp, "ref_cnt")
    lay.prev = kvs_slot(tp, "prev_free_block")
    lay.next = kvs_slot(tp, "next_free_block")
    lay.fast = (
        lay.pool >= 0 and lay.is_null >= 0 and lay.ref_cnt >= 0 and lay.prev >= 0
        and lay.next >= 0
    )


cdef inline object _field(object block, _Layout *lay, Py_ssize_t off, str name):
    """``getattr(block, name)``, from the slot when the layout allows."""
    cdef PyObject *value
    if lay.fast:
        value = KVS_SLOT(<PyObject *>block, off)
        if value is not NULL:
            return <object>value
    lay.type = NULL
    return getattr(block, name)


cdef inline bint _is_null(object block, _Layout *lay) except -1:
    value = _field(block, lay, lay.is_null, "is_null")
    if type(value) is not bool:
        lay.type = NULL  # its truth may run code
    return bool(value)


cdef inline object _ref_cnt(object block, _Layout *lay):
    value = _field(block, lay, lay.ref_cnt, "ref_cnt")
    if type(value) is not int:
        lay.type = NULL  # comparing it may run code
    return value


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
    cdef _Layout lay
    lay.type = NULL
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
            if Py_TYPE(block) != lay.type:
                _learn(&lay, block)
            if _field(block, &lay, lay.pool, "pool") is not pool or _is_null(block, &lay):
                i += 1
                continue
            slot = <Py_ssize_t>((<uintptr_t><PyObject *>block >> 4) & mask)
            while seen[slot].block is not NULL and seen[slot].block != <PyObject *>block:
                slot = (slot + 1) & mask
            if seen[slot].block is NULL:
                # A block in the free list is free, whatever its count says.
                if _field(block, &lay, lay.prev, "prev_free_block") is not None:
                    found = i
                    break
                refs = _ref_cnt(block, &lay)
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
    cdef _Layout lay
    lay.type = NULL
    for block in blocks:
        if Py_TYPE(block) != lay.type:
            _learn(&lay, block)
        if (
            _field(block, &lay, lay.pool, "pool") is pool
            and not _is_null(block, &lay)
            and _ref_cnt(block, &lay) < 0
        ):
            return i
        i += 1
    return -1


def first_held_free(object head, Py_ssize_t n):
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel)
    whose ``ref_cnt`` is not 0, or None; O(n). A link that is None ends the walk."""
    cdef object block = head
    cdef _Layout lay
    lay.type = NULL
    for _ in range(n):
        if Py_TYPE(block) != lay.type:
            _learn(&lay, block)
        block = _field(block, &lay, lay.next, "next_free_block")
        # A count assigned above the list's length (vLLM's tests fake a full cache so)
        # ends the walk at the tail: what vLLM then does is vLLM's.
        if block is None:
            return None
        if Py_TYPE(block) != lay.type:
            _learn(&lay, block)
        if _ref_cnt(block, &lay) != 0:
            return block
    return None
