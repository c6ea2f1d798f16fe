# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""The pool guard's screens, compiled: the twin of ``_screen_py.py``, function for function.

Deliberate differences, none visible in what a screen returns or raises:

* A field its block's class lays out as a plain ``__slots__`` member of that class or a
  base (vLLM's ``@dataclass(slots=True)`` ``KVCacheBlock``) is read from its slot
  (``_screen.h``), where no Python code runs. Any other field, and a slot never set, is
  read with ``getattr`` as the pure twin reads it; since that may run code that changes a
  class or a block's ``__class__``, the layout is learned again after it (``_Layout``),
  and whenever a block's type is not the one learned. The last class's layout is kept
  from call to call under its version tag, which CPython changes with the class.
* ``first_excess`` keys the references it has counted in a small open-addressing table
  of block addresses instead of a dict of ``id()``s (no int object per block, one
  allocation per call): with the dict it took several times as long, measured side by
  side (why: see bench/README.md, 'The pool guard's screen', and the run in its lab
  notes, 'What the compiled twin's complications buy'). It holds a reference to every
  block in that table, so code a block's attributes run cannot free one and put another
  object at its address.
"""

cimport cython
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Realloc
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE, PyList_SetSlice
from cpython.sequence cimport PySequence_SetItem
from cpython.object cimport Py_TYPE, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport uintptr_t
from libc.string cimport memset

import weakref
from collections import defaultdict
from weakref import ReferenceType

from .. import _errors
from ._own import own_attribute

__all__ = (
    "HOLDER_FAULTS",
    "NO_POOL",
    "OTHER_POOLS",
    "REPEATS",
    "Door",
    "Listed",
    "Table",
    "alloc_guard",
    "count",
    "count_one",
    "first_excess",
    "first_held_free",
    "first_listed",
    "first_listed_free",
    "first_negative",
    "first_under_listed",
    "free_guard",
    "holder_faults",
    "looks_free",
    "passes_free",
    "passes_hand_out",
    "passes_touch",
    "quiet_step",
    "step_guard",
    "suspects",
    "touch_guard",
)

#: What ``first_excess`` found besides no misuse, as ``-1 - flags``: blocks of other
#: pools, blocks given more than once (within the references they hold), and blocks of
#: no pool (which vLLM counts as the caller's, and its queue refuses).
OTHER_POOLS = 1
REPEATS = 2
NO_POOL = 4
#: What :func:`holder_faults` finds, in the order it looks: a block a holder lists that is
#: in the free list; one listed twice by one holder of one manager; one listed by two
#: managers; one listed more times than its ``ref_cnt``; one whose ``ref_cnt`` is no int.
HOLDER_FAULTS = ("listed_free", "listed_twice", "two_managers", "under_counted", "bad_count")

# The same flags as C constants, for the loop: a module global read there is a dict lookup
# and a conversion per use, code that made first_excess measurably slower once a third one
# was added (bench-screens against a2b730f; why: see bench/README.md, 'The pool guard's
# screen').
cdef enum:
    _OTHER_POOLS = 1
    _REPEATS = 2
    _NO_POOL = 4


cdef extern from "_screen.h":
    Py_ssize_t kvs_slot(PyTypeObject *tp, object name)
    unsigned int kvs_version(PyTypeObject *tp)
    PyObject *KVS_SLOT(PyObject *o, Py_ssize_t off)
    void kvs_hint_blocks(object blocks, Py_ssize_t i)
    void kvs_hint_entries(
        object blocks, Py_ssize_t i, PyTypeObject *tp, Py_ssize_t off, object counts,
        object pool_blocks,
    )
    bint kvs_count(PyObject *v, Py_ssize_t *out)
    bint kvs_refers_to(object ref, object obj)


cdef struct _Seen:
    PyObject *block
    Py_ssize_t left


cdef enum:
    _POOL, _IS_NULL, _REF_CNT, _PREV, _NEXT, _BLOCK_ID, _FIELDS


# Where one block class keeps the fields a screen reads (-1: not a slot). ``type`` is
# borrowed and only compared: it is learned from a block the caller holds, and dropped
# (NULL) whenever a read may have run Python code, which could have changed that class,
# let it go, or given a block another ``__class__``.
cdef struct _Layout:
    PyTypeObject *type
    Py_ssize_t off[_FIELDS]


# The last class learned, kept between calls by its version tag (0: none): CPython gives a
# class another tag whenever it or a base changes, and never gives a freed class's tag to
# another, so a layout kept under a tag is the class's as it is. Each call would otherwise
# look its six fields up again, a cost larger than a one-block screen's reads.
cdef _Layout _last
cdef unsigned int _last_version = 0
_last.type = NULL


# Out of line: it runs once per class met in a call, and inlined into _field it would keep
# _field itself, which runs at every read, from being inlined.
cdef void _learn(_Layout *lay, object block):
    global _last, _last_version
    cdef PyTypeObject *tp = Py_TYPE(block)
    cdef unsigned int version = kvs_version(tp)
    if version != 0 and tp == _last.type and version == _last_version:
        lay[0] = _last
        return
    lay.type = tp
    lay.off[_POOL] = kvs_slot(tp, "pool")
    lay.off[_IS_NULL] = kvs_slot(tp, "is_null")
    lay.off[_REF_CNT] = kvs_slot(tp, "ref_cnt")
    lay.off[_PREV] = kvs_slot(tp, "prev_free_block")
    lay.off[_NEXT] = kvs_slot(tp, "next_free_block")
    lay.off[_BLOCK_ID] = kvs_slot(tp, "block_id")
    # The look-ups above give the class a tag if it had none.
    version = kvs_version(tp)
    if version != 0:
        _last = lay[0]
        _last_version = version


cdef inline object _field(
    object block, _Layout *lay, int field, str name, bint optional=False
):
    """``getattr(block, name)`` (``optional``: None for a block without it), from the slot
    when the block's class has one."""
    cdef PyObject *value
    if Py_TYPE(block) != lay.type:
        _learn(lay, block)
    if lay.off[field] >= 0:
        value = KVS_SLOT(<PyObject *>block, lay.off[field])
        if value is not NULL:
            return <object>value
    lay.type = NULL
    if optional:
        return getattr(block, name, None)
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
    (:data:`OTHER_POOLS`, :data:`REPEATS`, :data:`NO_POOL`); O(len(blocks)).

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
                    flags |= _NO_POOL if owner is None or _gone(owner) else _OTHER_POOLS
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
                flags |= _REPEATS
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


cdef inline bint _listed(object block, _Layout *lay, list counts, list pool_blocks) except -1:
    """Whether ``block`` is ``pool_blocks[block_id]`` and ``counts[block_id]`` (the holder
    index's) is not 0."""
    cdef Py_ssize_t block_id, listed
    value = _field(block, lay, _BLOCK_ID, "block_id")
    if not kvs_count(<PyObject *>value, &block_id) or block_id < 0:
        return False
    # Both lengths read at each block: a read above may have run Python code.
    if block_id >= PyList_GET_SIZE(counts) or block_id >= PyList_GET_SIZE(pool_blocks):
        return False
    if not kvs_count(PyList_GET_ITEM(counts, block_id), &listed) or listed == 0:
        return False
    return PyList_GET_ITEM(pool_blocks, block_id) == <PyObject *>block


def first_listed_free(list blocks, list counts, list pool_blocks):
    """The index of the first block whose ``ref_cnt`` is 0 (in the free list, as vLLM's
    ``touch`` reads it) while a live request lists it (``counts[block_id]`` not 0, the holder
    index's, and the block is ``pool_blocks[block_id]``), null blocks aside, or -1;
    O(len(blocks))."""
    cdef Py_ssize_t i = 0, refs
    cdef Py_ssize_t n = len(blocks)
    cdef object block
    cdef _Layout lay
    lay.type = NULL
    while i < len(blocks) and i < n:
        block = blocks[i]
        i += 1
        value = _field(block, &lay, _REF_CNT, "ref_cnt")
        if not kvs_count(<PyObject *>value, &refs) or refs != 0:
            continue
        if _listed(block, &lay, counts, pool_blocks) and not _is_null(block, &lay):
            return i - 1
    return -1


def first_held_free(object head, Py_ssize_t n):
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel)
    whose ``ref_cnt`` is not 0 (or no int), or None; O(n). A link that is None ends
    the walk."""
    return _first_unfit(head, n, None, None)


cdef object _first_unfit(object head, Py_ssize_t n, list counts, list pool_blocks):
    """The first of the ``n`` blocks after ``head`` that is held (a ``ref_cnt`` not 0, or
    no int) or, ``counts`` given, listed; None if none is. Fields are read in the order
    ``next_free_block``, ``ref_cnt``, ``block_id`` (``counts`` given), block by block."""
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
        if counts is not None and _listed(block, &lay, counts, pool_blocks):
            return block
    return None


def first_listed(object head, Py_ssize_t n, list counts, list pool_blocks):
    """The first of the ``n`` blocks after ``head`` (a free list's head sentinel) that a
    live request lists (``counts[block_id]`` not 0, the holder index's, and the block is
    ``pool_blocks[block_id]``), or None; O(n). A link that is None ends the walk."""
    cdef object block = head
    cdef _Layout lay
    lay.type = NULL
    for _ in range(n):
        block = _field(block, &lay, _NEXT, "next_free_block")
        if block is None:
            return None
        if _listed(block, &lay, counts, pool_blocks):
            return block
    return None


# A free's blocks given more than once are found in a table of their addresses; up to this
# many slots it is on the stack (a free of up to half as many blocks: most of vLLM's), above
# it allocated, as first_excess's is.
cdef enum:
    _STACK_SLOTS = 64


def passes_free(list blocks, object pool, list counts, list pool_blocks):
    """Whether :func:`first_excess` finds nothing in ``blocks``, and no flag, and (``counts``
    given: the holder index's, with ``pool_blocks``) :func:`first_under_listed` finds nothing;
    in one pass, the free guard's passing path. False too at a ``ref_cnt`` that is no int
    exactly, which the full guard reads. O(len(blocks)).

    Fields are read in the order ``pool``, ``is_null``, ``prev_free_block``, ``ref_cnt``,
    ``block_id`` (``counts`` given; a read that raises AttributeError reads as none), up to
    the first block that fails; a count of no int fails too."""
    return _passes_free(blocks, pool, counts, pool_blocks)


cdef bint _passes_free(list blocks, object pool, list counts, list pool_blocks) except -1:
    cdef Py_ssize_t n = len(blocks), i = 0, cap = 8, mask, slot, refs
    cdef PyObject *stack[_STACK_SLOTS]
    cdef PyObject **seen = stack
    cdef bint passes = True
    cdef object block
    cdef _Layout lay
    lay.type = NULL
    while cap < 2 * n:
        cap <<= 1
    mask = cap - 1
    if cap > _STACK_SLOTS:
        seen = <PyObject **>PyMem_Calloc(cap, sizeof(PyObject *))
        if seen is NULL:
            raise MemoryError()
    else:
        memset(stack, 0, cap * sizeof(PyObject *))
    try:
        # The length is read again each turn, as first_excess does; the table holds each
        # block it names (a read may run code that frees one and reuses its address).
        while i < len(blocks) and i < n:
            kvs_hint_blocks(blocks, i)
            if counts is not None:
                kvs_hint_entries(blocks, i, lay.type, lay.off[_BLOCK_ID], counts, pool_blocks)
            block = blocks[i]
            i += 1
            if pool is not None and _field(block, &lay, _POOL, "pool") is not pool:
                passes = False
                break
            if _is_null(block, &lay):
                continue
            slot = <Py_ssize_t>((<uintptr_t><PyObject *>block >> 4) & mask)
            while seen[slot] is not NULL and seen[slot] != <PyObject *>block:
                slot = (slot + 1) & mask
            if seen[slot] is not NULL:
                passes = False
                break
            Py_INCREF(block)
            seen[slot] = <PyObject *>block
            if _field(block, &lay, _PREV, "prev_free_block") is not None:
                passes = False
                break
            value = _field(block, &lay, _REF_CNT, "ref_cnt")
            if type(value) is not int or not kvs_count(<PyObject *>value, &refs) or refs < 1:
                passes = False
                break
            if counts is not None and _short(block, &lay, refs, counts, pool_blocks):
                passes = False
                break
    finally:
        for slot in range(cap):
            if seen[slot] is not NULL:
                Py_DECREF(<object>seen[slot])
        if seen != stack:
            PyMem_Free(seen)
    return passes


cdef inline bint _short(
    object block, _Layout *lay, Py_ssize_t refs, list counts, list pool_blocks
) except -1:
    """Whether ``block``, which holds ``refs`` references, is ``pool_blocks[block_id]`` and
    listed (``counts[block_id]``, the holder index's) ``refs`` times or more, or by a count
    of no int; its ``block_id`` (read as ``getattr(block, "block_id", None)``) an int exactly
    within both lists, else it is not."""
    cdef Py_ssize_t block_id, listed
    value = _field(block, lay, _BLOCK_ID, "block_id", True)
    if type(value) is not int or not kvs_count(<PyObject *>value, &block_id):
        return False
    # Both lengths read after the block's read, which may run code that changes them; the
    # count first: a count below the references (most blocks a free releases are listed by
    # none) passes whoever's block it is, and the pool's list is not read.
    if block_id < 0 or block_id >= PyList_GET_SIZE(counts):
        return False
    if kvs_count(PyList_GET_ITEM(counts, block_id), &listed) and listed < refs:
        return False
    if block_id >= PyList_GET_SIZE(pool_blocks):
        return False
    return PyList_GET_ITEM(pool_blocks, block_id) == <PyObject *>block


def passes_touch(list blocks, object pool, list counts, list pool_blocks):
    """Whether :func:`first_negative` finds nothing in ``blocks`` and (``counts`` given: the
    holder index's, with ``pool_blocks``) :func:`first_listed_free` finds nothing; in one
    pass, the touch guard's passing path. False too at a block of no pool or another
    (``pool`` not None), or a ``ref_cnt`` that is no int exactly, which the full guard
    reads. O(len(blocks)).

    Fields are read in the order ``pool``, ``is_null``, ``ref_cnt``, and for a ``ref_cnt``
    of 0 ``block_id`` (``counts`` given), up to the first block that fails."""
    return _passes_touch(blocks, pool, counts, pool_blocks)


cdef bint _passes_touch(list blocks, object pool, list counts, list pool_blocks) except -1:
    cdef Py_ssize_t n = len(blocks), i = 0, refs
    cdef object block
    cdef _Layout lay
    lay.type = NULL
    while i < len(blocks) and i < n:
        kvs_hint_blocks(blocks, i)
        block = blocks[i]
        i += 1
        if pool is not None and _field(block, &lay, _POOL, "pool") is not pool:
            return False
        if _is_null(block, &lay):
            continue
        value = _field(block, &lay, _REF_CNT, "ref_cnt")
        if type(value) is not int or not kvs_count(<PyObject *>value, &refs) or refs < 0:
            return False
        if refs == 0 and counts is not None and _listed(block, &lay, counts, pool_blocks):
            return False
    return True


def passes_hand_out(object head, Py_ssize_t n, list counts, list pool_blocks):
    """Whether :func:`first_held_free` finds none of the ``n`` blocks after ``head`` and
    (``counts`` given: the holder index's, with ``pool_blocks``) :func:`first_listed` finds
    none; in one walk, the allocation guard's passing path. O(n).

    Fields are read in the order ``next_free_block``, ``ref_cnt``, ``block_id`` (``counts``
    given), block by block, up to the first that fails; a link that is None ends the walk."""
    return _first_unfit(head, n, counts, pool_blocks) is None


@cython.final
@cython.auto_pickle(False)
cdef class Door:
    """The free list's entry of one pool with a holder index (its queue's ``gate``): a
    block that holds a reference, or that a live request lists (``index``'s counts), is
    not let in, but while ``freeing`` (the pool's guarded frees under way, which checked
    their blocks). ``pool``: a weak reference to the pool; ``stopped(door, method, blocks)``
    decides a batch the door stops and returns what is linked. O(len(blocks)) a batch.

    Fields are read as ``getattr(block, name, default)``: ``block_id`` (None), and for a
    block of the pool (``index.blocks[block_id]``, its ``block_id`` an int exactly within
    both of the index's lists) ``ref_cnt`` (0), block by block, up to the first that is
    stopped."""

    # C fields: the guards read them at every call, and move freeing twice a free.
    cdef public object pool
    cdef public object index
    cdef public object stopped
    cdef public Py_ssize_t freeing

    def __init__(self, pool, index, stopped):
        self.pool = pool
        self.index = index
        self.stopped = stopped
        self.freeing = 0

    def __reduce_ex__(self, protocol, /):
        """Refuse: copy, deepcopy and pickle raise TypeError."""
        raise TypeError(_errors.DOOR_UNCOPYABLE)

    # The index's lists are read by position after code a block runs (a property), which may
    # have shortened them: each read is checked, and raises as the pure twin's does.
    @cython.boundscheck(True)
    def __call__(self, method, blocks):
        cdef Py_ssize_t block_id, refs
        cdef _IdLayout lay
        if self.freeing:
            return blocks
        index = self.index
        counts = index.counts
        pool_blocks = index.blocks
        lay.type = NULL
        for block in blocks:
            value = _id_only(block, &lay)
            # Both lengths read after the block's read, which may run code that changes them.
            if type(value) is not int or not kvs_count(<PyObject *>value, &block_id):
                continue  # not the pool's: the queue's own checks
            if block_id < 0 or block_id >= len(counts) or block_id >= len(pool_blocks):
                continue
            if pool_blocks[block_id] is not block:
                continue
            value = getattr(block, "ref_cnt", 0)
            if counts[block_id] or (
                type(value) is int and kvs_count(<PyObject *>value, &refs) and refs > 0
            ):
                return self.stopped(self, method, blocks)
        return blocks


# Not a value a caller passes: a call without the first argument.
cdef object _MISSING = object()
# A pool's counts and blocks where it has no holder index: its passing paths check no listing.
cdef tuple _NO_INDEX = (None, None)


cdef tuple _exit_index(object pool, object queue, dict indexes):
    """What a block leaving ``pool``'s free list is checked against: the holder index's counts
    and blocks, or ``_NO_INDEX`` when no listed block can be in the list. Behind a door (its
    queue's :class:`Door` of ``pool``, which holds the index; its weak reference, a
    ``weakref.ref`` exactly, read as the pool's, not called), the entry lets no listed block
    in, and a block listed while it looked free is kept in the index's ``loose``: the counts
    are read only while one of those is still listed and free (``Index.prune``). Else the
    index in ``indexes`` (``id(pool)`` -> (weak reference, index)), whose counts are read
    whatever the list holds."""
    door = getattr(queue, "gate", None)
    if type(door) is Door and kvs_refers_to((<Door>door).pool, pool):
        held = (<Door>door).index
        if held.loose and held.prune():
            return (held.counts, held.blocks)
        return _NO_INDEX
    entry = indexes.get(id(pool))
    held = entry[1] if entry is not None and entry[0]() is pool else None
    return _NO_INDEX if held is None else (held.counts, held.blocks)


def alloc_guard(object original, object slow, dict indexes):
    """``get_new_blocks`` guarded on the path vLLM takes: a count given by position alone, an
    int exactly, whose blocks :func:`passes_hand_out` passes (against the pool's holder index:
    its queue's :class:`Door`'s, else the one in ``indexes``: ``id(pool)`` -> (weak
    reference, index)), goes to vLLM's ``original`` as it is; every other call goes to
    ``slow`` (the guard in full, which screens again and says what it finds). O(blocks asked
    for)."""

    def get_new_blocks(self, num_blocks=_MISSING, /, *args, **kwargs):
        if type(num_blocks) is not int or args or kwargs:
            if num_blocks is _MISSING:
                return slow(self, *args, **kwargs)
            return slow(self, num_blocks, *args, **kwargs)
        queue = self.free_block_queue
        # Asked for more than is free, or for none: vLLM's own answer, from vLLM.
        if 0 < num_blocks <= queue.num_free_blocks:
            # The free list's exit: a block a live request lists is never handed out.
            counts, blocks = _exit_index(self, queue, indexes)
            if _first_unfit(queue.fake_free_list_head, num_blocks, counts, blocks) is not None:
                return slow(self, num_blocks)
        return original(self, num_blocks)

    return get_new_blocks


def free_guard(
    object original, object slow, object freed, bint own, bint weak, bint releases
):
    """``free_blocks`` or ``unpin_blocks`` guarded on the path vLLM takes: blocks given by
    position alone (iterated once, into a list, which is what vLLM is given) to a pool whose
    queue's ``gate`` is a :class:`Door` (the free list's entry, with the holder index), that
    :func:`passes_free` passes (against that index when ``releases``): the free is kept
    (``freed(blocks, depth)``) unless the index checked it, and vLLM's ``original`` runs with
    the door open to it. Every other call goes to ``slow`` (the guard in full) with that list.
    ``own``, ``weak``: as :func:`touch_guard`'s. O(len(blocks))."""

    def free_blocks(self, blocks=_MISSING, /, *args, **kwargs):
        if blocks is _MISSING:
            return slow(self, *args, **kwargs)
        if args or kwargs:
            return slow(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        gate = getattr(self.free_block_queue, "gate", None)
        if type(gate) is not Door:
            return slow(self, blocks)
        cdef Door door = <Door>gate
        held = door.index if releases else None
        counts, pool_blocks = _NO_INDEX if held is None else (held.counts, held.blocks)
        pool = self._weak_self if weak else self if own else None
        if not _passes_free(blocks, pool, counts, pool_blocks):
            return slow(self, blocks)
        if not releases:  # a release the index checked is named as it is made
            freed(blocks, 1)  # no frame of this one's: the caller's
        door.freeing += 1
        try:
            return original(self, blocks)
        finally:
            door.freeing -= 1

    return free_blocks


def touch_guard(object original, object slow, dict indexes, bint own, bint weak):
    """``touch`` guarded on the path vLLM takes: blocks given by position alone (iterated
    once, into a list, which is what vLLM is given) that :func:`passes_touch` passes (against
    the pool's holder index, found as :func:`alloc_guard` finds it) go to vLLM's ``original``;
    every other call goes to ``slow`` (the guard in full) with that list. ``own``: the blocks
    name their pool (vLLM 0.30+); ``weak``: by the pool's ``_weak_self`` (0.34+).
    O(len(blocks))."""

    def touch(self, blocks=_MISSING, /, *args, **kwargs):
        if blocks is _MISSING:
            return slow(self, *args, **kwargs)
        if args or kwargs:
            return slow(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        # A prefix hit takes a block out of the free list's middle: not one a live request
        # lists. The queue read as vLLM's touch may never read it (only for a free block).
        queue = getattr(self, "free_block_queue", None)
        counts, pool_blocks = _exit_index(self, queue, indexes)
        pool = self._weak_self if weak else self if own else None
        if _passes_touch(blocks, pool, counts, pool_blocks):
            return original(self, blocks)
        return slow(self, blocks)

    return touch


def quiet_step(object manager, dict places, list tally, object every):
    """Count a step of ``manager``'s holder audit (``tally[0]``), and whether nothing is to be
    read at it: ``manager``'s place in ``places`` (``id`` -> (a weak reference to it, [the
    guarded frees no index checked made by its last audit, the steps since its last full
    read])) shows no full read due (``every`` 0, or more than those steps) and no such free
    made since (``tally[1]``, their count); then the step is counted in that place. False
    for a manager without one. O(1): this runs at every step."""
    return _quiet_step(manager, places, tally, every)


cdef bint _quiet_step(object manager, dict places, list tally, object every) except -1:
    tally[0] += 1
    entry = places.get(id(manager))
    if entry is None:
        return False
    ref, place = entry
    # The reference read, not called (kvs_refers_to): a step starts with it out of the cache.
    if not kvs_refers_to(ref, manager):
        return False
    steps = place[1] + 1
    if (every and steps >= every) or place[0] != tally[1]:
        return False
    place[1] = steps
    return True


def step_guard(
    object original, object read, object guard, object policy, dict places, list tally
):
    """``new_step_starts`` guarded: the holder audit, then vLLM's ``original``. Unless
    ``guard`` is retired, a step :func:`quiet_step` does not pass (against ``places`` and
    ``tally``, ``policy.every``'s cadence) is read: ``read(manager, every)``. O(1) a quiet
    step."""

    def new_step_starts(self, *args, **kwargs):
        if not guard.retired:
            every = policy.every
            if not _quiet_step(self, places, tally, every):
                read(self, every)
        # vLLM calls it with no argument: a call that passes none is the interpreter's
        # quick one (no tuple or dict built for them).
        if args or kwargs:
            return original(self, *args, **kwargs)
        return original(self)

    return new_step_starts


# Where one block class keeps its block_id, for the counts, which read no other field: the
# one lookup in the class, not _learn's six, at each call (most move one block or a few).
cdef struct _IdLayout:
    PyTypeObject *type
    Py_ssize_t off


# The last class whose block_id was looked up, kept as _last is.
cdef _IdLayout _last_id
cdef unsigned int _last_id_version = 0
_last_id.type = NULL


cdef void _learn_id(_IdLayout *lay, object block):
    global _last_id, _last_id_version
    cdef PyTypeObject *tp = Py_TYPE(block)
    cdef unsigned int version = kvs_version(tp)
    if version != 0 and tp == _last_id.type and version == _last_id_version:
        lay[0] = _last_id
        return
    lay.type = tp
    lay.off = kvs_slot(tp, "block_id")
    version = kvs_version(tp)
    if version != 0:
        _last_id = lay[0]
        _last_id_version = version


cdef inline object _id_only(object block, _IdLayout *lay):
    """``getattr(block, "block_id", None)``, from the slot when the block's class has one."""
    cdef PyObject *value
    if Py_TYPE(block) != lay.type:
        _learn_id(lay, block)
    if lay.off >= 0:
        value = KVS_SLOT(<PyObject *>block, lay.off)
        if value is not NULL:
            return <object>value
    lay.type = NULL
    return getattr(block, "block_id", None)


cdef inline Py_ssize_t _own_id(
    object block, object value, list pool_blocks, list counts
) noexcept:
    """``value`` (``block``'s ``block_id``) when it is an int (exactly) within both lists
    and ``block`` is ``pool_blocks[value]``; else -1."""
    cdef Py_ssize_t block_id
    if type(value) is not int or not kvs_count(<PyObject *>value, &block_id) or block_id < 0:
        return -1
    # Both lengths read after the block's read, which may run code that changes them.
    if block_id >= PyList_GET_SIZE(counts) or block_id >= PyList_GET_SIZE(pool_blocks):
        return -1
    if PyList_GET_ITEM(pool_blocks, block_id) != <PyObject *>block:
        return -1
    return block_id


cdef inline int _add(list counts, Py_ssize_t block_id, object step) except -1:
    """``counts[block_id] += step``; ``block_id`` within ``counts``."""
    total = <object>PyList_GET_ITEM(counts, block_id)
    total += step
    # Set as list's own item assignment does, its index checked: an addition of objects
    # other than ints may have run code that shrank the list.
    PySequence_SetItem(counts, block_id, total)
    return 0


def count(object blocks, list pool_blocks, list counts, object step, list loose=None):
    """Add ``step`` to ``counts[block_id]`` (the holder index's) for each of ``blocks`` (any
    iterable, iterated once) that is ``pool_blocks[block_id]``, its ``block_id`` an int
    (exactly) within both lists; anything else passes uncounted. With ``loose`` (a list) and
    a positive ``step``, each block counted from 0 that :func:`looks_free` is appended to it.
    O(len(blocks)).

    A ``block_id`` read that raises AttributeError reads as none; any other exception raises
    through, the blocks before it counted."""
    _count(blocks, pool_blocks, counts, step, loose)


def count_one(object block, list pool_blocks, list counts, object step, list loose=None):
    """:func:`count` of the one block ``block``; O(1)."""
    _count_one(block, pool_blocks, counts, step, loose)


def looks_free(object block):
    """Whether ``block`` may be in a free list: not null, and it holds no reference (its
    ``ref_cnt`` no int above 0, exactly) or is linked (its ``prev_free_block`` not None).
    Each field read as ``getattr(block, name, None)``, in that order; O(1)."""
    cdef _Layout lay
    lay.type = NULL
    return _looks_free(block, &lay)


cdef bint _looks_free(object block, _Layout *lay) except -1:
    cdef Py_ssize_t refs
    if _field(block, lay, _IS_NULL, "is_null", True) is True:
        return False
    value = _field(block, lay, _REF_CNT, "ref_cnt", True)
    if type(value) is not int or not kvs_count(<PyObject *>value, &refs) or refs < 1:
        return True
    return _field(block, lay, _PREV, "prev_free_block", True) is not None


cdef inline bint _was_zero(list counts, Py_ssize_t block_id) noexcept:
    cdef Py_ssize_t before
    return kvs_count(PyList_GET_ITEM(counts, block_id), &before) and before == 0


# count and count_one as C calls, for the tables' lists below, which count at every change.
cdef int _count(
    object blocks, list pool_blocks, list counts, object step, list loose
) except -1:
    cdef Py_ssize_t block_id, i = 0
    cdef _IdLayout lay
    cdef _Layout free_lay
    cdef bint listed = isinstance(blocks, list)  # a request's blocks, read ahead
    cdef bint up = loose is not None and step > 0
    cdef bint first
    lay.type = NULL
    free_lay.type = NULL
    for block in blocks:
        if listed:
            kvs_hint_blocks(blocks, i)
            kvs_hint_entries(blocks, i, lay.type, lay.off, counts, pool_blocks)
            i += 1
        block_id = _own_id(block, _id_only(block, &lay), pool_blocks, counts)
        if block_id >= 0:
            first = up and _was_zero(counts, block_id)
            _add(counts, block_id, step)
            if first and _looks_free(block, &free_lay):
                loose.append(block)
    return 0


cdef int _count_one(
    object block, list pool_blocks, list counts, object step, list loose
) except -1:
    cdef Py_ssize_t block_id
    cdef _IdLayout lay
    cdef _Layout free_lay
    cdef bint first
    lay.type = NULL
    free_lay.type = NULL
    block_id = _own_id(block, _id_only(block, &lay), pool_blocks, counts)
    if block_id >= 0:
        first = loose is not None and step > 0 and _was_zero(counts, block_id)
        _add(counts, block_id, step)
        if first and _looks_free(block, &free_lay):
            loose.append(block)
    return 0


def first_under_listed(list blocks, list counts, list pool_blocks):
    """The index of the first block that a live request lists (``counts[block_id]`` not 0,
    the holder index's, the block ``pool_blocks[block_id]``, its ``block_id`` an int
    exactly), not null, whose ``ref_cnt`` is at most its listings (one release would leave
    it fewer references than listings) or no int, exactly; else -1. O(len(blocks)).

    Fields are read in the order ``block_id``, ``is_null``, ``ref_cnt``; a ``block_id`` read
    that raises AttributeError reads as none."""
    cdef Py_ssize_t i = 0, block_id
    cdef Py_ssize_t n = len(blocks)
    cdef object block
    cdef _Layout lay
    lay.type = NULL
    while i < len(blocks) and i < n:
        block = blocks[i]
        i += 1
        value = _field(block, &lay, _BLOCK_ID, "block_id", True)
        block_id = _own_id(block, value, pool_blocks, counts)
        if block_id < 0:
            continue
        listed = <object>PyList_GET_ITEM(counts, block_id)
        if not listed or _is_null(block, &lay):
            continue
        refs = _field(block, &lay, _REF_CNT, "ref_cnt")
        if type(refs) is not int or refs <= listed:
            return i - 1
    return -1


def suspects(list freed, list counts, list pool_blocks):
    """Of the blocks of the batches ``freed``, in order, those a live request lists
    (``counts[block_id]`` not 0, the holder index's, the block ``pool_blocks[block_id]``,
    its ``block_id`` an int exactly) that are not null and are in a free list or hold fewer
    references than listings (or a ``ref_cnt`` that is no int, exactly); O(blocks freed).

    Fields are read in the order ``block_id``, ``is_null``, ``ref_cnt``,
    ``prev_free_block``; a ``block_id`` read that raises AttributeError reads as none."""
    cdef Py_ssize_t block_id
    cdef _Layout lay
    cdef list found = []
    lay.type = NULL
    for batch in freed:
        for block in batch:
            value = _field(block, &lay, _BLOCK_ID, "block_id", True)
            block_id = _own_id(block, value, pool_blocks, counts)
            if block_id < 0:
                continue
            listed = <object>PyList_GET_ITEM(counts, block_id)
            if not listed or _is_null(block, &lay):
                continue
            refs = _field(block, &lay, _REF_CNT, "ref_cnt")
            if (
                _field(block, &lay, _PREV, "prev_free_block") is not None
                or type(refs) is not int
                or refs < listed
            ):
                found.append(block)
    return found


# holder_faults' table: one entry per block id of the pool audited, kept between calls and
# told apart by a generation number, so that a call costs what it lists, not the pool's
# size. ``block`` is a strong reference while the entry is of the current generation (the
# ids of the entries holding one are in ``_touched``): no code a read runs can free a
# block and put another at its address. A call that code run inside another makes (a
# property of a block that audits) gets a table of its own.
cdef struct _Held:
    PyObject *block
    size_t gen
    Py_ssize_t listed
    Py_ssize_t group
    Py_ssize_t stamp
    bint reported


cdef _Held *_held = NULL
cdef Py_ssize_t *_touched = NULL
cdef Py_ssize_t _held_len = 0
cdef size_t _gen = 0
cdef bint _busy = False


cdef int _grow(Py_ssize_t n) except -1:
    """``_held`` and ``_touched`` for at least ``n`` block ids, new entries of no
    generation."""
    global _held, _touched, _held_len
    cdef _Held *held
    cdef Py_ssize_t *touched
    if n <= _held_len:
        return 0
    held = <_Held *>PyMem_Realloc(_held, n * sizeof(_Held))
    if held is NULL:
        raise MemoryError()
    _held = held
    touched = <Py_ssize_t *>PyMem_Realloc(_touched, n * sizeof(Py_ssize_t))
    if touched is NULL:
        raise MemoryError()
    _touched = touched
    memset(&_held[_held_len], 0, (n - _held_len) * sizeof(_Held))
    _held_len = n
    return 0


cdef inline bint _wanted(PyObject **only, Py_ssize_t mask, PyObject *block) noexcept:
    """Whether ``block`` is in the pointer set ``only`` (open addressing, NULL: empty)."""
    cdef Py_ssize_t slot = <Py_ssize_t>((<uintptr_t>block >> 4) & mask)
    while only[slot] is not NULL:
        if only[slot] == block:
            return True
        slot = (slot + 1) & mask
    return False


cdef PyObject **_pointer_set(list only, Py_ssize_t *mask) except NULL:
    """The identities of the blocks of the batches ``only``, as a set of addresses. No
    reference is held: an address is only compared, never followed."""
    cdef Py_ssize_t cap = 8, total = 0, slot
    cdef PyObject **found
    cdef list batch
    for batch in only:
        total += len(batch)
    while cap < 2 * total:
        cap <<= 1
    found = <PyObject **>PyMem_Calloc(cap, sizeof(PyObject *))
    if found is NULL:
        raise MemoryError()
    mask[0] = cap - 1
    for batch in only:
        for block in batch:
            slot = <Py_ssize_t>((<uintptr_t><PyObject *>block >> 4) & mask[0])
            while found[slot] is not NULL and found[slot] != <PyObject *>block:
                slot = (slot + 1) & mask[0]
            found[slot] = <PyObject *>block
    return found


def holder_faults(list pool_blocks, list tables, list only=None):
    """What the holders of ``pool_blocks`` list against what the blocks say: a list of
    ``(kind, block)`` (kinds: :data:`HOLDER_FAULTS`), each block once, at its first fault
    in listing order; empty when every holder's blocks are held. O(listed blocks).

    ``tables``: one mapping per manager (vLLM's ``req_to_blocks``), holder -> its blocks.
    Only ``pool_blocks``'s own blocks are counted (``pool_blocks[block.block_id] is
    block``); null blocks are skipped. A block's count is checked at each listing against
    the listings so far, so its first fault is found where it shows. ``only``: lists of
    blocks (the batches freed since the last audit); a listing of any other object is
    passed over unread, by identity alone.
    """
    global _busy, _gen
    cdef Py_ssize_t n = len(pool_blocks), touched = 0, stamp = 0, group = 0
    cdef Py_ssize_t i, size, block_id, refs
    cdef _Held *held
    cdef Py_ssize_t *ids
    cdef _Held *entry
    cdef size_t gen
    cdef bint own = not _busy
    cdef object block, blocks, kind
    cdef list listed
    cdef PyObject *item
    cdef _Layout lay
    cdef list found = []
    cdef PyObject **wanted = NULL
    cdef Py_ssize_t wanted_mask = 0
    lay.type = NULL
    if only is not None:
        wanted = _pointer_set(only, &wanted_mask)
    if own:
        _grow(n)
        _gen += 1
        held, ids, gen = _held, _touched, _gen
        _busy = True
    else:
        held = <_Held *>PyMem_Calloc(n if n else 1, sizeof(_Held))
        ids = <Py_ssize_t *>PyMem_Calloc(n if n else 1, sizeof(Py_ssize_t))
        gen = 1
        if held is NULL or ids is NULL:
            PyMem_Free(held)
            PyMem_Free(ids)
            PyMem_Free(wanted)
            raise MemoryError()
    try:
        for table in tables:
            for blocks in table.values():
                stamp += 1
                if type(blocks) is not list:
                    blocks = list(blocks)
                listed = <list>blocks
                size = PyList_GET_SIZE(listed)
                i = 0
                # The length is read again each turn, as first_excess does.
                while i < PyList_GET_SIZE(listed) and i < size:
                    item = PyList_GET_ITEM(listed, i)
                    i += 1
                    if wanted is not NULL and not _wanted(wanted, wanted_mask, item):
                        continue
                    block = <object>item
                    if _is_null(block, &lay):
                        continue
                    value = _field(block, &lay, _BLOCK_ID, "block_id")
                    if not kvs_count(<PyObject *>value, &block_id):
                        continue
                    if block_id < 0 or block_id >= n or block_id >= len(pool_blocks):
                        continue
                    if pool_blocks[block_id] is not block:
                        continue
                    entry = &held[block_id]
                    kind = None
                    if entry.gen != gen or entry.block != <PyObject *>block:
                        if entry.gen != gen:
                            ids[touched] = block_id
                            touched += 1
                        Py_INCREF(block)
                        if entry.gen == gen:
                            Py_DECREF(<object>entry.block)
                        entry.block = <PyObject *>block
                        entry.gen = gen
                        entry.listed = 0
                        entry.group = group
                        entry.reported = False
                        if _field(block, &lay, _PREV, "prev_free_block") is not None:
                            kind = "listed_free"
                    elif entry.stamp == stamp:
                        kind = "listed_twice"
                    elif entry.group != group:
                        kind = "two_managers"
                    entry.stamp = stamp
                    entry.listed += 1
                    if kind is None and not entry.reported:
                        value = _field(block, &lay, _REF_CNT, "ref_cnt")
                        if not kvs_count(<PyObject *>value, &refs):
                            kind = "bad_count"
                        elif entry.listed > refs:
                            kind = "under_counted"
                    if kind is not None and not entry.reported:
                        entry.reported = True
                        found.append((kind, block))
            group += 1
    finally:
        for i in range(touched):
            entry = &held[ids[i]]
            Py_DECREF(<object>entry.block)
            entry.block = NULL
        if own:
            _busy = False
        else:
            PyMem_Free(held)
            PyMem_Free(ids)
        PyMem_Free(wanted)
    return found


# The holder index's tables and lists, as C types: vLLM reads them several times a request
# at every step (a request's list by its id, a block by its place), and a Python subclass of
# dict or list reads its items through a Python-level __getitem__ lookup, about twice a
# plain read. These inherit dict's and list's own reads; what they add runs only at a change.
#
# Cython compiles a call such as list.pop(self, i) or self.update(x) on a list or dict it
# knows as a call to CPython's own function for an exact list or dict, and for a subclass
# as a call of the method by name: here, the override that made the call (endless
# recursion), or a C function that bypasses the override (self[k] = v). So list's and
# dict's methods are called through these objects, and self's own through an object.
cdef object _list_pop = list.pop
cdef object _list_insert = list.insert
cdef object _list_index = list.index
cdef object _list_clear = list.clear
cdef object _list_imul = list.__imul__
cdef object _list_getitem = list.__getitem__
cdef object _list_setitem = list.__setitem__
cdef object _list_delitem = list.__delitem__
cdef object _dict_get = dict.get
cdef object _dict_setitem = dict.__setitem__
cdef object _dict_pop = dict.pop
cdef object _dict_popitem = dict.popitem
cdef object _dict_clear = dict.clear
cdef object _dict_getitem = dict.__getitem__
cdef object _dict_items = dict.items

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void *op)


@cython.auto_pickle(False)
cdef class Listed(list):
    """A request's blocks in one manager's table: a list that moves its index as it changes
    (O(1) a block), until it leaves its table (``tally`` None: a list like any other)."""

    cdef public object tally

    def __init__(self, index, blocks=()):
        PyList_SetSlice(self, 0, PyList_GET_SIZE(self), list(blocks))
        self.tally = index
        if index is not None:
            _count(self, index.blocks, index.counts, 1, index.loose)

    def __reduce_ex__(self, protocol):
        # A copy (copy, deepcopy, pickle) is in no table: a plain list.
        return (list, (list(self),))

    def detach(self):
        """Out of its table: its blocks are listed no more, and it counts nothing again."""
        tally = self.tally
        if tally is not None:
            _count(self, tally.blocks, tally.counts, -1, None)
            self.tally = None

    def append(self, block):
        PyList_Append(self, block)
        tally = self.tally
        if tally is not None:
            _count_one(block, tally.blocks, tally.counts, 1, tally.loose)

    def extend(self, blocks):
        blocks = list(blocks)
        cdef Py_ssize_t end = PyList_GET_SIZE(self)
        PyList_SetSlice(self, end, end, blocks)
        tally = self.tally
        if tally is not None:
            _count(blocks, tally.blocks, tally.counts, 1, tally.loose)

    def __iadd__(self, blocks):
        (<object>self).extend(blocks)
        return self

    def __imul__(self, times):
        before = list(self)
        _list_imul(self, times)
        if self.tally is not None:
            self.tally.add(before, -1)
            self.tally.add(self)
        return self

    def insert(self, where, block):
        _list_insert(self, where, block)
        if self.tally is not None:
            self.tally.add_one(block)

    def pop(self, where=-1):
        block = _list_pop(self, where)
        if self.tally is not None:
            self.tally.add_one(block, -1)
        return block

    def remove(self, block):
        # The element list.remove would take (the first equal one), by its place.
        (<object>self).pop(_list_index(self, block))

    def clear(self):
        before = list(self)
        _list_clear(self)
        if self.tally is not None:
            self.tally.add(before, -1)

    def __setitem__(self, where, value):
        before = _list_getitem(self, where)
        if type(where) is slice:
            value = list(value)
            _list_setitem(self, where, value)
            if self.tally is not None:
                self.tally.add(before, -1)
                self.tally.add(value)
        else:
            _list_setitem(self, where, value)
            if self.tally is not None:
                self.tally.add_one(before, -1)
                self.tally.add_one(value)

    def __delitem__(self, where):
        before = _list_getitem(self, where)
        _list_delitem(self, where)
        if self.tally is not None:
            self.tally.add(before if type(where) is slice else [before], -1)


cdef object _ABSENT = object()


@cython.auto_pickle(False)
cdef class Table(dict):
    """One manager's ``req_to_blocks``: a dict whose lists (made as a request is first
    looked up, as vLLM's ``defaultdict`` makes them) are :class:`Listed` of one index; a
    list taken out is detached. A list put in by hand is kept as it is, the very object
    (vLLM's tests hold it), and uncounted: the full read still reads it. ``untracked``: its
    lists are kept out of the cyclic collector's sight, as vLLM's (0.34+) are."""

    cdef object __weakref__
    cdef public object manager
    cdef public object name
    cdef public object tally
    cdef public bint untracked

    def __init__(self, index, manager, untracked):
        self.tally = index
        self.manager = weakref.ref(manager)
        self.name = type(manager).__name__
        self.untracked = untracked

    def __missing__(self, request):
        listed = Listed(self.tally)
        if self.untracked:
            PyObject_GC_UnTrack(<void *>listed)
        _dict_setitem(self, request, listed)
        return listed

    def __reduce_ex__(self, protocol):
        # A copy (copy, deepcopy, pickle) is no manager's table: a plain defaultdict of
        # plain lists, as vLLM's own would copy.
        return (_plain, (list(_dict_items(self)),))

    def copy(self):
        return _plain(list(_dict_items(self)))

    def __copy__(self):
        return (<object>self).copy()

    def in_place(self):
        manager = self.manager()
        return manager is not None and own_attribute(manager, "req_to_blocks") is self

    def __setitem__(self, request, blocks):
        if type(blocks) is Listed and blocks.tally is None:  # detached: counted again
            blocks.tally = self.tally
            self.tally.add(blocks)
        old = _dict_get(self, request)
        _dict_setitem(self, request, blocks)
        if old is not None and old is not blocks:
            _detach(old)

    def __delitem__(self, request):
        old = _dict_pop(self, request)
        _detach(old)

    def pop(self, request, *default):
        # One look-up where the request is listed: every finished request's removal.
        old = _dict_pop(self, request, _ABSENT)
        if old is _ABSENT:
            return _dict_pop(self, request, *default)
        if type(old) is Listed:
            old.detach()
        return old

    def popitem(self):
        request, old = _dict_popitem(self)
        _detach(old)
        return request, old

    def clear(self):
        old = list(dict.values(self))
        _dict_clear(self)
        for each in old:
            _detach(each)

    def setdefault(self, request, default=None):
        if request not in self:
            (<object>self)[request] = [] if default is None else default
        return _dict_getitem(self, request)

    def update(self, *args, **kwargs):
        for request, blocks in dict(*args, **kwargs).items():
            (<object>self)[request] = blocks

    def __ior__(self, other):
        (<object>self).update(other)
        return self


def _plain(items):
    return defaultdict(list, ((request, list(blocks)) for request, blocks in items))


cdef inline int _detach(object blocks) except -1:
    if type(blocks) is Listed:
        blocks.detach()
    return 0
