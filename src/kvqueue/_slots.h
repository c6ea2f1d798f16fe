/* The C behind kvqueue's compiled queue (_queue.pyx): the blocks' link slots read
   and written by offset, the subclass layout check, and the two changes made to
   the queue's type at import. Everything here is static to that one module. */

#ifndef KVQUEUE_SLOTS_H
#define KVQUEUE_SLOTS_H

#include "_member.h"

#define KVQ_SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* The link, borrowed; NULL when the slot was never set or was deleted. */
static inline PyObject *kvq_get(PyObject *o, Py_ssize_t off)
{
    return KVQ_SLOT(o, off);
}

/* Store v, releasing the old value at once (it must be None or held elsewhere). */
static inline void kvq_set(PyObject *o, Py_ssize_t off, PyObject *v)
{
    PyObject *old = KVQ_SLOT(o, off);
    Py_INCREF(v);
    KVQ_SLOT(o, off) = v;
    Py_XDECREF(old);
}

/* Store v and return the old value as a new reference (None if unset). */
static inline PyObject *kvq_swap(PyObject *o, Py_ssize_t off, PyObject *v)
{
    PyObject *old = KVQ_SLOT(o, off);
    Py_INCREF(v);
    KVQ_SLOT(o, off) = v;
    if (old == NULL) {
        Py_INCREF(Py_None);
        old = Py_None;
    }
    return old;
}

/* An int as Py_ssize_t, clamped instead of overflowing: out-of-range
   counts take the same error paths as in-range ones. */
#define kvq_clamped_ssize(o) PyNumber_AsSsize_t((o), NULL)

/* num_free_blocks as a read-only T_OBJECT_EX member, not Cython's getset
   property: the 3.11+ interpreter reads such a member as fast as a
   __slots__ field (LOAD_ATTR_SLOT), and vLLM's block pool reads the count
   dozens of times per scheduler step. `offset` is that of the queue's count. */
static PyMemberDef kvq_count_member = {
    "num_free_blocks", Py_T_OBJECT_EX, 0, Py_READONLY,
    "The number of free blocks. Assignable, as vLLM's plain attribute is (its "
    "tests set 0 to fake a full cache): later calls then move the assigned count, "
    "while the queue's own checks keep using the true length. Raises TypeError "
    "for a non-integer, ValueError for one below 0 or above sys.maxsize."
};
static int kvq_expose_count(PyTypeObject *tp, Py_ssize_t offset)
{
    PyObject *descr;
    int err;
    kvq_count_member.offset = offset;
    descr = PyDescr_NewMember(tp, &kvq_count_member);
    if (descr == NULL) return -1;
    err = PyDict_SetItemString(tp->tp_dict, "num_free_blocks", descr);
    Py_DECREF(descr);
    PyType_Modified(tp);
    return err;
}

/* An exact int as Py_ssize_t, clamped like kvq_clamped_ssize but without the
   two generic conversions: a compact value is read in place. */
static inline Py_ssize_t kvq_exact_ssize(PyObject *o)
{
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return PyNumber_AsSsize_t(o, NULL);
    }
    return v;
}

/* Cython's C method table, which no other module cimports from this
   final type: hidden so that help() and dir() match the pure twin's (help()
   would list `__pyx_vtable__ = <capsule object NULL>`, which
   tests/test_surface.py's help test refuses). */
static int kvq_hide_vtable(PyTypeObject *tp)
{
    if (PyDict_DelItemString(tp->tp_dict, "__pyx_vtable__") < 0) return -1;
    PyType_Modified(tp);
    return 0;
}

/* What a subclass of the block class must inherit untouched: the names of
   _block.LAYOUT (the one place they are written), a tuple of str held for the
   module's life. */
static PyObject *kvq_layout = NULL;

static int kvq_init_layout(PyObject *names)
{
    Py_ssize_t i;
    if (!PyTuple_CheckExact(names)) goto bad;
    for (i = 0; i < PyTuple_GET_SIZE(names); i++) {
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(names, i))) goto bad;
    }
    Py_INCREF(names);
    Py_XSETREF(kvq_layout, names);
    return 0;
bad:
    PyErr_SetString(PyExc_TypeError, "the block layout must be a tuple of str");
    return -1;
}

#if defined(__GNUC__)
#define KVQ_NOINLINE __attribute__((noinline))
#elif defined(_MSC_VER)
#define KVQ_NOINLINE __declspec(noinline)
#else
#define KVQ_NOINLINE
#endif

/* A subclass of tp that keeps its layout. Out of line: kvq_is_block is inlined
   at every link the queue follows, where the exact type is the rule.
   _PyType_Lookup runs no Python code and sets no exception. */
static KVQ_NOINLINE int kvq_is_subblock(PyTypeObject *sub, PyTypeObject *tp)
{
    Py_ssize_t i;
    PyObject *name;
    if (!PyType_IsSubtype(sub, tp)) return 0;
    for (i = 0; i < PyTuple_GET_SIZE(kvq_layout); i++) {
        name = PyTuple_GET_ITEM(kvq_layout, i);
        if (_PyType_Lookup(sub, name) != _PyType_Lookup(tp, name)) return 0;
    }
    return 1;
}

/* An instance of tp, or of a subclass that keeps tp's layout (_block.is_block). */
static inline int kvq_is_block(PyObject *o, PyTypeObject *tp)
{
    return Py_TYPE(o) == tp || kvq_is_subblock(Py_TYPE(o), tp);
}

#endif /* KVQUEUE_SLOTS_H */
