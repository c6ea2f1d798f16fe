# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""The pool guard's screens, compiled: the twin of ``_screen_py.py``, function for function.

Deliberate differences, none visible in what a screen returns or raises:

* A field its block's class lays out as a plain ``__slots__`` member of that class or a
  base (vLLM's ``@dataclass(slots=True)`` ``KVCacheBlock``) is read from its slot
  (``_screen.h``), where no Python code runs. Any other field, and a slot never set, is
  read with ``getattr`` as the pure twin reads it; since that may run code that changes a
  class or a block's ``__class__``, the layout is learned again after it (``_Layout``),
  and whenever a block's type is not the one learned.
* ``first_excess`` keys the references it has counted in a small open-addressing table
  of block addresses instead of a dict of ``id()``s (no int object per block, one
  allocation per call): with the dict (measured on 177ae23, bench/screens.py --baseline
  --cpu-time) it took 2.57 [2.48, 2.68] times as long on a batch of 1 block, 7.51 [7.20,
  7.93] on 16, 9.05 [8.93, 9.44] on 128. It holds a reference to every block in that
  table, so code a block's attributes run cannot free one and put another object at its
  address.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.object cimport Py_TYPE, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport uintptr_t

from weakref import ReferenceType

__all__ = ("OTHER_POOLS", "REPEATS", "first_excess", "first_held_free", "first_negative")

#: What ``first_excess`` found besides no misuse, as ``-1 - flags``: blocks of other
#: pools, and blocks given more than once (within the references they hold).
OTHER_POOLS = 1
REPEATS = 2


cdef extern from "_screen.h":
    Py_ssize_t kvs_slot(PyTypeObject *tp, object name)
    PyObject *KVS_SLOT(PyObject *o, Py_ssize_t off)
    bint kvs_count(PyObject *v, Py_ssize_t *out)


cdef struct _Seen:
    PyObject *block
    Py_ssize_t left


cdef enum:
    _POOL, _IS_NULL, _REF_CNT, _PREV, _NEXT, _FIELDS


# Where one block class keeps the fields a screen reads (-1: not a slot). ``type`` is
# borrowed and only compared: it is learned from a block the caller holds, and dropped
# (NULL) whenever a read may have run Python code, which could have changed that class,
# let it go, or given a block another ``__class__``.
cdef struct _Layout:
    PyTypeObject *type
    Py_ssize_t off[_FIELDS]


# Out of line: it runs once per class met in a call, and inlined into _field it would keep
# _field itself, which runs at every read, from being inlined.
cdef void _learn(_Layout *lay, object block):
    cdef PyTypeObject *tp = Py_TYPE(block)
    lay.type = tp
    lay.off[_POOL] = kvs_slot(tp, "pool")
    lay.off[_IS_NULL] = kvs_slot(tp, "is_null")
    lay.off[_REF_CNT] = kvs_slot(tp, "ref_cnt")
    lay.off[_PREV] = kvs_slot(tp, "prev_free_block")
    lay.off[_NEXT] = kvs_slot(tp, "next_free_block")


cdef inline object _field(object block, _Layout *lay, int field, str name):
    """``getattr(block, name)``, from the slot when the block's class has one."""
    cdef PyObject *value
    if Py_TYPE(block) != lay.type:
        _learn(lay, block)
    if lay.off[field] >= 0:
        value = KVS_SLOT(<PyObject *>block, lay.off[field])
        if value is not NULL:
            return <object>value
    lay.type = NULL
    return getattr(block, name)


cdef inline bint _is_null(object block, _Layout *lay) except -1:
    value = _field(block, lay, _IS_NULL, "is_null")
    if value is True:
        return True
    if value is False:
        return False
    lay.type = NULL  # its truth may run code
    return bool(value)


cdef inline bint _gone(object owner) except -1:
    """Whether ``owner`` is a weak reference whose pool is gone; calls no code of its own
    (only an exact ``weakref.ref`` is called)."""
    return type(owner) is ReferenceType and owner() is None


def first_excess(list blocks, object pool):
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
    cdef Py_ssize_t cap = 8, mask, i, slot, refs, found = -1
    cdef Py_ssize_t n = len(blocks)
    cdef int flags = 0
    cdef _Seen *seen
    cdef object block, owner
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
        # shrinks the list; what it appends is not screened (nor by the pure twin), and
        # the table holds at most n blocks.
        while i < len(blocks) and i < n:
            block = blocks[i]
            if pool is not None:
                owner = _field(block, &lay, _POOL, "pool")
                if owner is not pool:
                    if owner is not None and not _gone(owner):
                        flags |= OTHER_POOLS
                    i += 1
                    continue
            if _is_null(block, &lay):
                i += 1
                continue
            slot = <Py_ssize_t>((<uintptr_t><PyObject *>block >> 4) & mask)
            while seen[slot].block is not NULL and seen[slot].block != <PyObject *>block:
                slot = (slot + 1) & mask
            if seen[slot].block is NULL:
                # A block in the free list is free, whatever its count says.
                if _field(block, &lay, _PREV, "prev_free_block") is not None:
                    found = i
                    break
                value = _field(block, &lay, _REF_CNT, "ref_cnt")
                if not kvs_count(<PyObject *>value, &refs) or refs < 1:
                    found = i
                    break
                Py_INCREF(block)
                seen[slot].block = <PyObject *>block
                seen[slot].left = min(refs, n + 1)
            else:
                flags |= REPEATS
                if seen[slot].left < 1:
                    found = i
                    break
            seen[slot].left -= 1
            i += 1
    finally:
        for slot in range(cap):
            if seen[slot].block is not NULL:
                Py_DECREF(<object>seen[slot].block)
        PyMem_Free(seen)
    return found if found >= 0 else -1 - flags


def first_negative(list blocks, object pool):
    """The index of the first block of ``pool`` (null aside; ``pool`` None: any block)
    whose ``ref_cnt`` is negative or no int, or -1."""
    cdef Py_ssize_t i = 0, refs
    cdef Py_ssize_t n = len(blocks)
    cdef object block
    cdef _Layout lay
    lay.type = NULL
    while i < len(blocks) and i < n:
        block = blocks[i]
        if (pool is None or _field(block, &lay, _POOL, "pool") is pool) and not _is_null(
            block, &lay
        ):
            value = _field(block, &lay, _REF_CNT, "ref_cnt")
            if not kvs_count(<PyObject *>value, &refs) or refs < 0:
                return i
        i += 1
    return -1


def first_held_free(object head, Py_ssize_t n):
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel)
    whose ``ref_cnt`` is not 0 (or no int), or None; O(n). A link that is None ends
    the walk."""
    cdef object block = head
    cdef Py_ssize_t refs
    cdef _Layout lay
    lay.type = NULL
    for _ in range(n):
        block = _field(block, &lay, _NEXT, "next_free_block")
        # A count assigned above the list's length (vLLM's tests fake a full cache so)
        # ends the walk at the tail: what vLLM then does is vLLM's.
        if block is None:
            return None
        value = _field(block, &lay, _REF_CNT, "ref_cnt")
        if not kvs_count(<PyObject *>value, &refs) or refs != 0:
            return block
    return None
