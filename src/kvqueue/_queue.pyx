# cython: language_level=3, binding=False, always_allow_keywords=False, auto_pickle=False
# cython: embedsignature=True, embedsignature.format=clinic
"""The compiled free-block queue: the twin of ``_queue_py``, same contract.

The blocks stay instances of a plain ``__slots__`` class (fast for the engine's
own Python code); this module reads and writes their two link slots directly
through the offsets their member descriptors publish, with no attribute lookup.
That makes every object the queue follows a raw memory access, so each one is
type-checked against the queue's block class first: whatever a caller assigns
to a link, the result is an exception, never a crash.

Reference discipline: a store whose old value could be the last reference to
an object would run that object's destructor (arbitrary Python code, maybe
re-entering the queue) in the middle of an update. Such old values are swapped
out into locals and released only when the queue is consistent again; a plain
store is used only where the old value is None or held elsewhere.

The list's invariants are the pure twin's (see the ``_queue_py`` docstring);
misuse is refused or repaired by the same rules, in the same order. What both
twins share is in neutral modules (``_core``: argument parsing, which blocks and
pools a queue takes, the count validator; ``_errors``: exceptions and messages);
this module imports nothing of the pure one.

What only this twin has, and why: it reads and writes the link slots by offset
(``_slots.h``, through the slot lookup of ``_member.h`` that the pool guard's
``_screen.h`` shares), so every link it follows is type-checked first, since a raw
read of whatever a caller assigned would crash where the pure twin's attribute
access raises by itself. It keeps the count as a C length plus an offset and hands
Python a cached int through a member of its own, so ``num_free_blocks`` is set and
deleted through ``__setattr__`` / ``__delattr__`` (the pure twin has a property).
A queue made by ``__new__`` alone refuses every method with RuntimeError, where the
pure twin fails at its first read with AttributeError, so that its valid path pays
for no check. Its lazy cursor is a small iterator class, the pure twin's a generator.

What only the pure twin has: it refuses subclasses in ``__init_subclass__`` (the
compiled type is final), and writes the list inside ``try`` blocks whose handlers
undo the call, for exceptions raised between its bytecodes; none arrive inside a
compiled call.

Both let no Python code run between a method's first read of the list and its last
write, so that finalizers called mid-update find it whole: here old values are
swapped out and results allocated first, there allocations and a subclass's checks
come before the reads. The order of work differs with it: ``popleft_n`` here walks
before it unlinks, the pure one unlinks as it walks (as vLLM's does) and relinks on
failure; a bound queue here checks its pool in a pass of its own, the pure
``append_n`` in its loop. Both stop at the same block and raise the same error.
"""

cimport cython
from cpython.object cimport Py_TYPE, PyObject, PyTypeObject
from cpython.sequence cimport PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_CLEAR, Py_INCREF, Py_XDECREF
from cpython.number cimport PyNumber_Index
from cpython.type cimport PyType_Check

from types import GenericAlias

from kvqueue import _core, _errors, _log, _policy
from kvqueue._block import LAYOUT, KVCacheBlock, check_block_type, lookup

cdef extern from "_slots.h":
    Py_ssize_t kv_member_offset(PyTypeObject *tp, object name, int writable)
    PyObject *kvq_get(PyObject *o, Py_ssize_t off)
    void kvq_set(PyObject *o, Py_ssize_t off, PyObject *v)
    object kvq_swap(PyObject *o, Py_ssize_t off, PyObject *v)
    bint kvq_is_block(PyObject *o, PyTypeObject *tp)
    Py_ssize_t kvq_clamped_ssize(object o) except? -1
    Py_ssize_t kvq_exact_ssize(object o)
    int kvq_expose_count(PyTypeObject *tp, Py_ssize_t offset) except -1
    int kvq_hide_vtable(PyTypeObject *tp) except -1
    int kvq_init_layout(object names) except -1

cdef extern from "Python.h":
    const Py_ssize_t PY_SSIZE_T_MAX
    int PyObject_GenericSetAttr(object o, object name, PyObject *value) except -1
    void PyObject_GC_Track(object o)
    void PyObject_GC_UnTrack(object o)


cdef PyObject *NONE = <PyObject *>None


kvq_init_layout(LAYOUT)


cdef inline object _as_sequence(object blocks, str method):
    """``blocks`` as a list or tuple: the common case here, inline."""
    if type(blocks) is list or type(blocks) is tuple:
        return blocks
    return _core.as_sequence(blocks, method)


cdef Py_ssize_t _slot_offset(object block_type, str name) except -1:
    # By the MRO in C, as the pool guard's screens look slots up: a metaclass can lend
    # another class's slot, whose offset points past the end of our blocks.
    cdef Py_ssize_t offset = -1
    if PyType_Check(block_type):
        offset = kv_member_offset(<PyTypeObject *>block_type, name, 1)
    if offset < 0:
        raise TypeError(f"{block_type.__qualname__}.{name} is not a writable object slot")
    return offset


@cython.final
@cython.no_gc_clear
cdef class FreeKVCacheBlockQueue:
    """FreeKVCacheBlockQueue(blocks, *, block_type=None, on_misuse=None)
--

vLLM's ``FreeKVCacheBlockQueue``: free blocks in eviction order.

    The block class is that of ``blocks[0]``, or ``block_type`` (default
    :class:`kvqueue.KVCacheBlock`); the sentinels are ``block_type(block_id=-1)``.
    ``on_misuse`` is ``"raise"`` or ``"repair"``; None reads the environment
    variable ``KVQUEUE_ON_MISUSE`` (unset: ``"raise"``). Building is O(n).

    Raises TypeError for a non-iterable ``blocks`` or a non-block in it,
    ValueError for a block given twice or already linked (under ``"raise"``)
    and for an unknown policy.
    """

    # no_gc_clear: the sentinels must outlive any cycle collection that runs a
    # block's destructor which still calls into this queue; the cycle breaks at
    # the blocks, whose slots the collector clears.
    # The true length, and the count as the int Python reads (see
    # kvq_expose_count): len + _offset, which after an assignment may lie beyond
    # Py_ssize_t, as the pure twin's int may. _set_count keeps the two in step.
    # The previous count's int is kept as a spare: a queue's count mostly swings
    # between two values (alloc, free, alloc, ...), and reusing the int saves an
    # allocation, which the one-block cycles pay for without it, measured side by
    # side (why: see bench/README.md, 'Microbenchmark', and the run in its lab
    # notes, 'What the compiled twin's complications buy'). Both ints are owned
    # references held as C pointers: Cython gives
    # no offset of an object attribute, and the member needs _num_obj's; an int
    # cannot be part of a cycle, so the collector need not see them.
    cdef Py_ssize_t _len
    cdef PyObject *_num_obj
    cdef Py_ssize_t _spare_len
    cdef PyObject *_spare_obj
    cdef readonly object fake_free_list_head
    """The head sentinel, before the first free block."""
    cdef readonly object fake_free_list_tail
    """The tail sentinel, after the last free block."""
    cdef readonly object block_type
    """The class of the blocks this queue threads."""
    # NULL until construction finishes: every method checks it, since the
    # collector can hand out a half-built queue to Python code.
    cdef PyTypeObject *_tp
    # Set while __init__ runs the block class's code: a nested __init__ would
    # otherwise store another class's offsets under the outer one's feet.
    cdef bint _building
    cdef Py_ssize_t _prev
    cdef Py_ssize_t _next
    # num_free_blocks minus the true length: nonzero only after an assignment,
    # and from -len to sys.maxsize, so it never overflows.
    cdef Py_ssize_t _offset
    cdef bint _repair
    cdef object _repairs
    # What admits a batch (None: every block the checks pass); called before any read.
    cdef object _gate
    # The pool this queue's blocks belong to (None: unbound) and its slot.
    cdef object _pool
    cdef Py_ssize_t _pool_off
    cdef object __weakref__

    __class_getitem__ = classmethod(GenericAlias)

    def __init__(self, *args, **kwargs):
        blocks, block_type, on_misuse = _core.constructor_arguments(self, *args, **kwargs)
        if self._tp is not NULL:
            raise RuntimeError(_errors.INITIALIZED)
        if self._building:
            raise RuntimeError(_errors.BUILDING)
        self._building = True
        try:
            self._build(blocks, block_type, on_misuse)
        finally:
            self._building = False

    cdef int _build(self, blocks, block_type, on_misuse) except -1:
        seq = _as_sequence(blocks, "FreeKVCacheBlockQueue")
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        if block_type is None:
            block_type = _core.first_block_type(seq) if n else KVCacheBlock
        else:
            check_block_type(block_type)
        on_misuse = _policy.resolve(on_misuse)
        self._prev = _slot_offset(block_type, "prev_free_block")
        self._next = _slot_offset(block_type, "next_free_block")
        if self._prev == self._next:
            raise TypeError("prev_free_block and next_free_block must be distinct slots")
        head = block_type(block_id=-1)
        tail = block_type(block_id=-1)
        cdef PyTypeObject *tp = <PyTypeObject *>block_type
        if not (kvq_is_block(<PyObject *>head, tp) and kvq_is_block(<PyObject *>tail, tp)):
            raise TypeError(f"{block_type.__qualname__}(block_id=-1) did not make a block")
        kvq_set(<PyObject *>head, self._prev, NONE)
        kvq_set(<PyObject *>head, self._next, <PyObject *>tail)
        kvq_set(<PyObject *>tail, self._prev, <PyObject *>head)
        kvq_set(<PyObject *>tail, self._next, NONE)
        pool = _core.common_pool(block_type, seq)
        if pool is not None:
            self._pool_off = _slot_offset(block_type, "pool")
            self._pool = pool
        self.block_type = block_type
        self.fake_free_list_head = head
        self.fake_free_list_tail = tail
        self._offset = 0
        self._set_count(0, 0)
        self._repair = on_misuse == "repair"
        self._repairs = dict.fromkeys(_policy.QUEUE_MISUSES, 0)
        self._tp = tp
        # Python code ran since `n` was read (the block class, its constructor,
        # finalizers), and `seq` may be the caller's own list: read it again.
        n = PySequence_Fast_GET_SIZE(seq)
        if n:
            self._link("FreeKVCacheBlockQueue", False, seq)
        return 0

    cdef inline object _count_obj(self, Py_ssize_t new_len):
        """The int for the count at a new length; made before the links change,
        so that storing it (``_set_count``) cannot fail halfway through an update."""
        if new_len == self._spare_len and self._spare_obj is not NULL:
            return <object>self._spare_obj
        if self._offset == 0:
            return new_len
        return self._assigned_count_obj(new_len)

    cdef object _assigned_count_obj(self, Py_ssize_t new_len):
        """The int of an assigned count, in Python's arithmetic, which cannot
        overflow. Out of line: kept small, _count_obj is inlined."""
        return <object>new_len + <object>self._offset

    cdef inline void _set_count(self, Py_ssize_t new_len, object num_obj) noexcept:
        # The old spare is an int: releasing it runs no Python code.
        Py_XDECREF(self._spare_obj)
        self._spare_len = self._len
        self._spare_obj = self._num_obj
        Py_INCREF(num_obj)
        self._len = new_len
        self._num_obj = <PyObject *>num_obj

    def __dealloc__(self):
        Py_XDECREF(self._spare_obj)
        Py_XDECREF(self._num_obj)

    cdef inline int _check(self) except -1:
        if self._tp is NULL:
            raise RuntimeError(_errors.UNINITIALIZED)
        return 0

    cdef inline PyObject *_read(self, PyObject *block, Py_ssize_t offset) except NULL:
        """The slot at ``offset``, borrowed; AttributeError if unset, as from Python."""
        cdef PyObject *value = kvq_get(block, offset)
        if value is NULL:
            return self._unset(block, offset)
        return value

    cdef inline PyObject *_follow(self, PyObject *block, Py_ssize_t offset, str method) except NULL:
        """The link at ``offset``: None or a block, else an exception naming ``method``."""
        cdef PyObject *value = kvq_get(block, offset)
        if value is NONE or (value is not NULL and kvq_is_block(value, self._tp)):
            return value
        if value is NULL:
            return self._unset(block, offset)
        raise _errors.corrupted(method, <object>value)

    cdef PyObject *_unset(self, PyObject *block, Py_ssize_t offset) except NULL:
        if offset == self._prev:
            name = "prev_free_block"
        elif offset == self._next:
            name = "next_free_block"
        else:
            name = "pool"
        # The slot's own descriptor raises the interpreter's AttributeError (and no
        # subclass can have replaced it: kvq_is_block checked the layout).
        lookup(self.block_type, name).__get__(<object>block)
        raise AttributeError(name)

    @property
    def on_misuse(self):
        """``"raise"`` or ``"repair"``: what this queue does on misuse."""
        return "repair" if self._repair else "raise"

    @property
    def repairs(self):
        """How many misuses of each kind this queue repaired (a new dict)."""
        self._check()
        return dict(self._repairs)

    @property
    def gate(self):
        """What admits blocks to the list (None: every block the queue's checks pass).

        Called as ``gate(method, blocks)`` by ``append``, ``append_n`` and ``prepend_n``
        with the batch (a list or tuple; ``[block]`` for ``append``) before the queue reads
        its list; the batch methods link the sequence it returns, ``append`` links its block
        only if that sequence is not empty. What the gate raises leaves the queue as it was.
        Settable to None or a callable; raises TypeError for anything else.
        """
        return self._gate

    @gate.setter
    def gate(self, value):
        self._gate = _core.gate(value)

    def __setattr__(self, name, value):
        # Only here, not in the member: a writable member would skip _set_count.
        if name == "num_free_blocks":
            self._check()
            count = _core.count(value)  # Python code (__index__): before the state is read
            self._offset = <Py_ssize_t>count - self._len
            # The spare is an int of the old offset's count.
            Py_CLEAR(self._spare_obj)
            self._set_count(self._len, count)
        else:
            PyObject_GenericSetAttr(self, name, <PyObject *>value)

    def __delattr__(self, name):
        if name == "num_free_blocks":
            raise AttributeError(_errors.COUNT_UNDELETABLE)
        PyObject_GenericSetAttr(self, name, NULL)

    def popleft(self):
        """Pop the first free block. O(1).

        Raises ValueError when the queue is empty.
        """
        self._check()
        head = self.fake_free_list_head
        cdef PyObject *first = self._follow(<PyObject *>head, self._next, "popleft")
        if first is <PyObject *>self.fake_free_list_tail or first is NONE:
            # vLLM asserts that the count is 0 here before it raises ValueError.
            if self._offset != -self._len:
                raise _errors.out_of_sync(<object>self._num_obj)
            raise _errors.empty()
        block = <object>first
        next_block = <object>self._follow(first, self._next, "popleft")
        if next_block is None:
            raise _errors.invalid_next("popleft")
        num_obj = self._count_obj(self._len - 1)
        # head.next held `block` (kept alive by the local); next.prev is swapped out.
        kvq_set(<PyObject *>head, self._next, <PyObject *>next_block)
        _old = kvq_swap(<PyObject *>next_block, self._prev, <PyObject *>head)
        _old_prev = kvq_swap(first, self._prev, NONE)
        kvq_set(first, self._next, NONE)
        self._set_count(self._len - 1, num_obj)
        return block

    def popleft_n(self, n, /):
        """Pop the first ``n`` free blocks, in order. O(n).

        Raises TypeError for a non-integer ``n``, ValueError for a negative
        one, AssertionError when ``n`` exceeds ``num_free_blocks``.
        """
        self._check()
        cdef Py_ssize_t count
        if type(n) is int:
            # Its own index: no Python code can run, no generic conversion needed.
            index = n
            count = kvq_exact_ssize(n)
        else:
            # __index__ runs once, before any state is read: it may be Python code.
            index = PyNumber_Index(n)
            count = kvq_clamped_ssize(index)
        cdef Py_ssize_t i
        if count <= 0:
            if count == 0:
                return []
            raise _errors.negative(index)
        if not self._takes(count):
            self._refuse_takes(count, index)
        # Allocate before reading the list: on 3.11 an allocation can run a
        # collection, whose finalizers may call this queue (and free the first
        # block). Until it is full and returned, `ret` is hidden from the
        # collector, so no gc.get_objects() caller sees its empty slots. Its
        # size is at most the true length, never an assigned count.
        cdef list ret = PyList_New(count)
        PyObject_GC_UnTrack(ret)
        if not self._takes(count):
            self._refuse_takes(count, index)
        head = self.fake_free_list_head
        cdef PyObject *tail = <PyObject *>self.fake_free_list_tail
        cdef PyObject *curr = self._follow(<PyObject *>head, self._next, "popleft_n")
        # Walk first, unlink after: a short or broken list raises untouched.
        for i in range(count):
            if curr is NONE or curr is tail:
                raise _errors.out_of_sync(<object>self._num_obj)
            Py_INCREF(<object>curr)
            PyList_SET_ITEM(ret, i, <object>curr)
            curr = self._follow(curr, self._next, "popleft_n")
        if curr is NONE:
            raise _errors.invalid_next("popleft_n")
        num_obj = self._count_obj(self._len - count)
        # head.next held ret[0]; curr.prev is swapped out; the popped blocks'
        # links point at blocks held by `ret`, or at `head` and `curr`, which
        # the head keeps alive.
        kvq_set(<PyObject *>head, self._next, curr)
        _old = kvq_swap(curr, self._prev, <PyObject *>head)
        for i in range(count):
            kvq_set(PyList_GET_ITEM(ret, i), self._prev, NONE)
            kvq_set(PyList_GET_ITEM(ret, i), self._next, NONE)
        self._set_count(self._len - count, num_obj)
        PyObject_GC_Track(ret)
        return ret

    cdef inline bint _takes(self, Py_ssize_t count) noexcept:
        """Whether popleft_n(count > 0) can take ``count`` blocks: the count first
        (count > len + offset, written so that neither side can overflow), then the
        true length."""
        return count - self._len <= self._offset and count <= self._len

    cdef int _refuse_takes(self, Py_ssize_t count, object index) except -1:
        if count - self._len > self._offset:
            raise _errors.too_many(index, <object>self._num_obj)
        raise _errors.out_of_sync(<object>self._num_obj)

    def remove(self, block, /):
        """Take ``block`` out of the middle of the queue. O(1).

        Raises TypeError for a non-block, RuntimeError for a block that is
        not linked, ValueError for a block of another pool; under
        ``"repair"`` the last two are no-ops.
        """
        self._check()
        cdef PyObject *b = <PyObject *>block
        if not kvq_is_block(b, self._tp):
            raise _errors.not_a_block(block, self.block_type, "remove()")
        if not self._in_pool(b):
            self._misused_remove(block)
            return
        prev_block = <object>self._follow(b, self._prev, "remove")
        next_block = <object>self._follow(b, self._next, "remove")
        if prev_block is None or next_block is None:
            self._misused_remove(block)
            return
        num_obj = self._count_obj(self._len - 1)
        _old_next = kvq_swap(<PyObject *>prev_block, self._next, <PyObject *>next_block)
        _old_prev = kvq_swap(<PyObject *>next_block, self._prev, <PyObject *>prev_block)
        kvq_set(b, self._prev, NONE)
        kvq_set(b, self._next, NONE)
        self._set_count(self._len - 1, num_obj)

    cdef int _misused_remove(self, object block) except -1:
        """Which misuse a refused ``remove(block)`` was, raised or repaired. Out of the
        O(1) call's body, as ``_misused_append``: kept small, that body is inlined."""
        if self._pool is not None and kvq_get(<PyObject *>block, self._pool_off) is not (
            <PyObject *>self._pool
        ):
            self._read(<PyObject *>block, self._pool_off)
            # A sentinel's pool is None, but removing one is the unbound queue's error.
            if block is not self.fake_free_list_head and block is not self.fake_free_list_tail:
                return self._misuse("remove", block, "other_pool")
        return self._misuse("remove", block, "not_linked")

    def append(self, block, /):
        """Put ``block`` at the end of the queue (evicted last). O(1).

        Raises TypeError for a non-block, ValueError for a linked block or a
        sentinel (under ``"repair"``: skipped), and what the :attr:`gate` raises.
        """
        self._check()
        if self._gate is not None and not self._gate("append", [block]):
            return
        tail = self.fake_free_list_tail
        last_block = <object>self._follow(<PyObject *>tail, self._prev, "append")
        if last_block is None:
            raise RuntimeError(_errors.TAIL_LOST)
        cdef PyObject *b = <PyObject *>block
        if not kvq_is_block(b, self._tp):
            raise _errors.not_a_block(block, self.block_type, "append()")
        if (
            self._read(b, self._prev) is not NONE
            or self._read(b, self._next) is not NONE
            or not self._in_pool(b)
        ):
            self._misused_append(block)
            return
        # _insert_one's body, written out: gcc stopped inlining that helper here
        # once the module grew, and the call showed in this cycle's cost under
        # callgrind (why: see bench/README.md, 'Microbenchmark').
        num_obj = self._count_obj(self._len + 1)
        kvq_set(b, self._prev, <PyObject *>last_block)
        kvq_set(b, self._next, <PyObject *>tail)
        _old_next = kvq_swap(<PyObject *>last_block, self._next, b)
        _old_prev = kvq_swap(<PyObject *>tail, self._prev, b)
        self._set_count(self._len + 1, num_obj)

    cdef int _misused_append(self, object block) except -1:
        """Which misuse a refused ``append(block)`` was, raised or repaired."""
        cdef PyObject *b = <PyObject *>block
        if self._read(b, self._prev) is NONE and self._read(b, self._next) is NONE:
            self._read(b, self._pool_off)
            return self._misuse("append", block, "other_pool")
        if block is self.fake_free_list_head or block is self.fake_free_list_tail:
            return self._misuse("append", block, "sentinel")
        return self._misuse("append", block, "linked")

    cdef inline int _insert_one(self, PyObject *b, object left, object right) except -1:
        """Link the checked, unlinked block ``b`` between ``left`` and ``right``."""
        num_obj = self._count_obj(self._len + 1)
        kvq_set(b, self._prev, <PyObject *>left)
        kvq_set(b, self._next, <PyObject *>right)
        _old_next = kvq_swap(<PyObject *>left, self._next, b)
        _old_prev = kvq_swap(<PyObject *>right, self._prev, b)
        self._set_count(self._len + 1, num_obj)
        return 0

    cdef inline bint _in_pool(self, PyObject *b) noexcept:
        return self._pool is None or kvq_get(b, self._pool_off) is <PyObject *>self._pool

    cdef inline bint _is_fresh(self, PyObject *b) noexcept:
        """An exact-type block of the pool with no links: the one-block batches' fast path."""
        return (
            Py_TYPE(<object>b) == self._tp
            and kvq_get(b, self._prev) is NONE
            and kvq_get(b, self._next) is NONE
            and self._in_pool(b)
        )

    def append_n(self, blocks, /):
        """Put ``blocks`` at the end of the queue, in order. O(len(blocks)).

        Raises as :meth:`append`, before anything is linked.
        """
        self._check()
        seq = _as_sequence(blocks, "append_n")
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        if n == 0:
            return
        if self._gate is not None:
            seq = _as_sequence(self._gate("append_n", seq), "append_n")
            n = PySequence_Fast_GET_SIZE(seq)
            if n == 0:
                return
        cdef PyObject *b = PySequence_Fast_GET_ITEM(seq, 0)
        # One block, the most frequent batch, is linked as append() links it;
        # anything but a fresh block goes through _link, which reports it.
        if n == 1 and self._is_fresh(b):
            tail = self.fake_free_list_tail
            last_block = <object>self._follow(<PyObject *>tail, self._prev, "append_n")
            if last_block is None:
                raise AssertionError(_errors.TAIL_LOST)
            self._insert_one(b, last_block, tail)
        else:
            self._link("append_n", False, seq)

    def prepend_n(self, blocks, /):
        """Put ``blocks`` at the front of the queue (evicted first), in order.
        O(len(blocks)).

        Raises as :meth:`append`, before anything is linked.
        """
        self._check()
        seq = _as_sequence(blocks, "prepend_n")
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        if n == 0:
            return
        if self._gate is not None:
            seq = _as_sequence(self._gate("prepend_n", seq), "prepend_n")
            n = PySequence_Fast_GET_SIZE(seq)
            if n == 0:
                return
        cdef PyObject *b = PySequence_Fast_GET_ITEM(seq, 0)
        if n == 1 and self._is_fresh(b):
            head = self.fake_free_list_head
            first_block = <object>self._follow(<PyObject *>head, self._next, "prepend_n")
            if first_block is None:
                raise AssertionError(_errors.HEAD_LOST)
            self._insert_one(b, head, first_block)
        else:
            self._link("prepend_n", True, seq)

    cdef inline int _link(
        self, str method, bint front, object blocks, bint screened=False
    ) except -1:
        """Link the non-empty list or tuple ``blocks`` at the front or the end; 1 if
        it did.

        Each block is checked as it is linked; on the first bad one the links
        made so far are undone. A block seen twice is caught because its first
        visit already gave it a ``prev_free_block``. No Python code can run
        inside the loop (every old value replaced is None), so ``blocks`` cannot
        change under it. Under ``"repair"`` a bad batch is screened and its
        good blocks linked; ``screened`` marks that second pass, which returns
        0, with nothing linked, if one of them was linked meanwhile.
        """
        # Inlined, so that a caller's constant ``front`` reads one end only; the loop is
        # _link_run, out of line.
        if front:
            left = self.fake_free_list_head
            right = <object>self._follow(<PyObject *>left, self._next, method)
            if right is None:
                raise AssertionError(_errors.HEAD_LOST)
        else:
            right = self.fake_free_list_tail
            left = <object>self._follow(<PyObject *>right, self._prev, method)
            if left is None:
                raise AssertionError(_errors.TAIL_LOST)
        return self._link_run(method, front, left, right, blocks, screened)

    cdef int _link_run(
        self, str method, bint front, object left, object right, object blocks, bint screened
    ) except -1:
        """``_link``'s loop: ``blocks`` linked between ``left`` and ``right``."""
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks)
        cdef Py_ssize_t i
        cdef PyObject *b
        cdef PyTypeObject *tp = self._tp
        cdef Py_ssize_t P = self._prev
        cdef Py_ssize_t N = self._next
        cdef PyObject *prev = <PyObject *>left
        # A bound queue's pool is checked in a pass of its own, which leaves the
        # linking loop as it is for an unbound one: the loop stops where it found
        # the first block of another pool, and that block fails as in the pure twin.
        cdef Py_ssize_t limit = n if self._pool is None else self._checked_run(blocks)
        # An int allocation cannot start a collection (ints are not tracked),
        # so no Python code runs here before the loop reads `blocks`.
        num_obj = self._count_obj(self._len + n)
        for i in range(limit):
            b = PySequence_Fast_GET_ITEM(blocks, i)
            if kvq_is_block(b, tp) and kvq_get(b, P) is NONE and kvq_get(b, N) is NONE:
                kvq_set(b, P, prev)
                if i:
                    kvq_set(prev, N, b)
                prev = b
                continue
            self._unlink_run(blocks, i)
            return self._link_failed(method, front, blocks, i, screened)
        if limit < n:
            self._unlink_run(blocks, limit)
            return self._link_failed(method, front, blocks, limit, screened)
        kvq_set(prev, N, <PyObject *>right)
        _old_prev = kvq_swap(<PyObject *>right, P, prev)
        _old_next = kvq_swap(<PyObject *>left, N, PySequence_Fast_GET_ITEM(blocks, 0))
        self._set_count(self._len + n, num_obj)
        return 1

    cdef Py_ssize_t _checked_run(self, object blocks) noexcept:
        """``len(blocks)`` if every item is a block of the queue's pool, else the index
        of the first that is not (a bound queue's check, in a pass of its own)."""
        cdef Py_ssize_t i
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks)
        cdef PyObject *b
        for i in range(n):
            b = PySequence_Fast_GET_ITEM(blocks, i)
            if not kvq_is_block(b, self._tp) or kvq_get(b, self._pool_off) is not (
                <PyObject *>self._pool
            ):
                return i
        return n

    cdef int _link_failed(
        self, str method, bint front, object blocks, Py_ssize_t position, bint screened
    ) except -1:
        """``_link`` stopped at ``blocks[position]``, with nothing linked: raise, repair,
        or, on the screened pass, return 0."""
        block = <object>PySequence_Fast_GET_ITEM(blocks, position)
        cdef PyObject *b = <PyObject *>block
        if not kvq_is_block(b, self._tp):
            raise _errors.not_a_block(block, self.block_type, f"{method}()")
        linked = self._read(b, self._prev) is not NONE or self._read(b, self._next) is not NONE
        if not linked and self._pool is not None:
            self._read(b, self._pool_off)  # unset: the AttributeError the pure twin gets
        sentinels = (self.fake_free_list_head, self.fake_free_list_tail)
        kind = _core.link_misuse(block, blocks, position, linked, sentinels)
        if screened:
            return 0
        if self._repair:
            self._link_repaired(method, front, blocks)
            return 1
        raise _errors.misuse(method, kind, block)

    cdef int _link_repaired(self, str method, bint front, object blocks) except -1:
        """Link the good blocks of a batch that failed ``_link``, then report the rest.

        Raises TypeError, with nothing linked, if the batch holds a non-block.
        Screens again if a block it found free was linked before it could link
        it (a finalizer run between the two passes may free one).
        """
        while True:
            good, skipped = self._screen(method, blocks)
            if not good or self._link(method, front, good, True):
                break
        for block, kind in skipped:
            self._misuse(method, block, kind)
        return 0

    cdef tuple _screen(self, str method, object blocks):
        """The blocks of a batch that can be linked, and the rest with their misuse."""
        # A private copy: the collector may run finalizers that change `blocks`.
        cdef list items = list(blocks)
        cdef PyObject *b
        sentinels = (self.fake_free_list_head, self.fake_free_list_tail)
        seen = set()
        good = []
        skipped = []
        for block in items:
            b = <PyObject *>block
            if not kvq_is_block(b, self._tp):
                raise _errors.not_a_block(block, self.block_type, f"{method}()")
            if block is sentinels[0] or block is sentinels[1]:
                skipped.append((block, "sentinel"))
            elif id(block) in seen:
                skipped.append((block, "duplicate"))
            elif self._read(b, self._prev) is not NONE or self._read(b, self._next) is not NONE:
                skipped.append((block, "linked"))
            elif self._pool is not None and self._read(b, self._pool_off) is not (
                <PyObject *>self._pool
            ):
                skipped.append((block, "other_pool"))
            else:
                seen.add(id(block))
                good.append(block)
        return good, skipped

    cdef int _misuse(self, str method, object block, str kind) except -1:
        """Raise under ``"raise"``; else count and report the repair. The message
        is made only here, when it is needed."""
        if not self._repair:
            raise _errors.misuse(method, kind, block)
        count = self._repairs[kind] + 1
        self._repairs[kind] = count
        _log.queue_repaired(method, block, kind, count)
        return 0

    cdef void _unlink_run(self, object blocks, Py_ssize_t count) noexcept:
        """Clear the links of the first ``count`` blocks of ``blocks`` (all held by it)."""
        cdef Py_ssize_t i
        cdef PyObject *b
        for i in range(count):
            b = PySequence_Fast_GET_ITEM(blocks, i)
            kvq_set(b, self._prev, NONE)
            kvq_set(b, self._next, NONE)

    def get_all_free_blocks(self):
        """All free blocks in eviction order (a snapshot). O(n).

        Raises RuntimeError if the list is corrupted (longer than its count).
        """
        self._check()
        # Allocated first: the allocation may run finalizers (see popleft_n).
        cdef list ret = []
        cdef PyObject *curr = self._follow(
            <PyObject *>self.fake_free_list_head, self._next, "get_all_free_blocks"
        )
        if curr is NONE:
            raise RuntimeError(_errors.HEAD_LOST)
        cdef Py_ssize_t limit = self._len
        cdef PyObject *next_block
        while True:
            next_block = self._follow(curr, self._next, "get_all_free_blocks")
            if next_block is NONE:
                return ret
            if len(ret) >= limit:
                raise _errors.too_long(limit)
            ret.append(<object>curr)
            curr = next_block

    def iter_blocks_after(self, cursor, /):
        """Iterate the free blocks after ``cursor`` (None: from the front).

        Lazy like vLLM's generator: each successor is read when it is asked
        for, so the iterator follows the live list across mutations. O(1) per
        step. Raises TypeError for a cursor that is neither None nor a block.
        """
        self._check()
        if cursor is None:
            return _BlockIterator(self, self.fake_free_list_head)
        if not kvq_is_block(<PyObject *>cursor, self._tp):
            raise _errors.not_a_block(cursor, self.block_type, "iter_blocks_after()")
        return _BlockIterator(self, cursor)

    def __iter__(self):
        self._check()
        return _BlockIterator(self, self.fake_free_list_head)

    def __len__(self):
        self._check()
        # The interpreter's own errors for the pure twin's int, however large.
        if self._offset > 0 and self._len > PY_SSIZE_T_MAX - self._offset:
            raise _errors.len_overflow()
        if self._len + self._offset < 0:
            raise ValueError("__len__() should return >= 0")
        return self._len + self._offset

    def __reduce_ex__(self, protocol, /):
        """Refuse: copy, deepcopy and pickle raise TypeError (a copy would share the links)."""
        raise TypeError(_errors.UNCOPYABLE)

    def __repr__(self):
        if self._tp is NULL:
            return f"<{type(self).__qualname__} num_free_blocks=0 block_type=uninitialized>"
        return (
            f"<{type(self).__qualname__} num_free_blocks={<object>self._num_obj} "
            f"block_type={self.block_type.__qualname__}>"
        )


cdef Py_ssize_t _count_offset():
    """Where a queue keeps the int that num_free_blocks reads."""
    cdef FreeKVCacheBlockQueue probe = FreeKVCacheBlockQueue.__new__(FreeKVCacheBlockQueue)
    return <char *>&probe._num_obj - <char *><PyObject *>probe


kvq_expose_count(<PyTypeObject *>FreeKVCacheBlockQueue, _count_offset())
kvq_hide_vtable(<PyTypeObject *>FreeKVCacheBlockQueue)


@cython.final
cdef class _BlockIterator:
    """The lazy cursor behind ``iter_blocks_after``: it holds the last block it
    yielded and reads that block's successor only on the next ``next()``."""

    cdef FreeKVCacheBlockQueue _queue
    # The last block yielded (or the start); None once exhausted, for good.
    cdef object _curr

    def __cinit__(self, FreeKVCacheBlockQueue queue not None, curr):
        # Reachable from Python as type(it)(...): check what is handed in.
        queue._check()
        if curr is not None and not kvq_is_block(<PyObject *>curr, queue._tp):
            raise _errors.not_a_block(curr, queue.block_type, "iter_blocks_after()")
        self._queue = queue
        self._curr = curr

    def __iter__(self):
        return self

    def __next__(self):
        if self._curr is None:
            raise StopIteration
        queue = self._queue
        cdef PyObject *next_block = queue._follow(
            <PyObject *>self._curr, queue._next, "iter_blocks_after"
        )
        if next_block is NONE or next_block is <PyObject *>queue.fake_free_list_tail:
            self._curr = None
            raise StopIteration
        self._curr = <object>next_block
        return self._curr
